"""Helpers shared by the test layers (no fixtures here: those are in conftest.py)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable


async def eventually(
    predicate: Callable[[], object],
    timeout_s: float = 10.0,
    what: str = "condition",
    interval_s: float = 0.02,
) -> float:
    """Waits until ``predicate()`` is truthy, polling every ``interval_s``; returns the seconds
    it took. Fails the test with ``what`` when ``timeout_s`` passes first. For what a server
    does after its client has already returned, or what arrives through a watch: never a
    fixed sleep."""
    start = time.monotonic()
    while not predicate():
        waited = time.monotonic() - start
        if waited > timeout_s:
            raise AssertionError(f"{what}: not within {timeout_s} s")
        await asyncio.sleep(interval_s)
    return time.monotonic() - start
