"""One decode attempt's worker stream, watched: the first-token timeout and, while an
overlapped hand-off's prefill runs, that prefill. What ends an attempt early is an exception
naming its ``core.lifecycle.Outcome``; ``attempt.py`` turns it into an ``Attempt`` and ``proxy.py`` asks
the core what comes next. Per message this adds nothing once the first one is here.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, ClassVar

from kvmesh.v1 import worker_pb2

from .core.lifecycle import Outcome


@dataclass(slots=True)
class Overlap:
    """An overlapped hand-off's prefill, running while the decode call waits for its blocks."""

    task: asyncio.Task[worker_pb2.KvSource | None] | None = None


class EndedEarly(Exception):
    """The decode call is given up before its first message."""

    outcome: ClassVar[Outcome]


class NoFirstToken(EndedEarly):
    """The worker sent nothing within the first-token timeout."""

    outcome = Outcome.NO_FIRST_TOKEN


class HandoffLost(EndedEarly):
    """An overlapped prefill fell back before the decode worker sent anything: the blocks the
    decode worker waits for will not come, so the decode request is sent again without them."""

    outcome = Outcome.HANDOFF_LOST


def fell_back(task: asyncio.Task[worker_pb2.KvSource | None]) -> bool:
    """An overlapped prefill that ended without handing its KV over."""
    return task.done() and (task.cancelled() or task.result() is None)


async def decode_stream(
    call: AsyncIterator[worker_pb2.WorkerGenerateResponse],
    overlap: Overlap,
    first_token_timeout_s: float,
) -> AsyncIterator[worker_pb2.WorkerGenerateResponse]:
    """The decode call's messages; ``NoFirstToken`` when the first does not come within
    ``first_token_timeout_s``. While an overlapped prefill runs and nothing has come yet, also
    watches the prefill: if it falls back, the blocks the decode worker waits for will not come
    (``HandoffLost``: send it again without them). Once the first message is here the prefill
    is not needed any more (the blocks were loaded, or recomputed after the wait)."""
    stream = aiter(call)
    loop = asyncio.get_running_loop()
    give_up_at = loop.time() + first_token_timeout_s
    step: asyncio.Future[worker_pb2.WorkerGenerateResponse] = asyncio.ensure_future(anext(stream))
    try:
        while not step.done():
            task = overlap.task
            watch: set[asyncio.Future[Any]] = (
                {step} if task is None or task.done() else {step, task}
            )
            left = give_up_at - loop.time()
            if left <= 0:
                raise NoFirstToken
            await asyncio.wait(watch, timeout=left, return_when=asyncio.FIRST_COMPLETED)
            if task is not None and not step.done() and fell_back(task):
                raise HandoffLost  # the prefill fell back: its blocks will not come
        try:
            msg = step.result()
        except StopAsyncIteration:
            return
    finally:
        if not step.done():
            step.cancel()
    if overlap.task is not None and not overlap.task.done():
        overlap.task.cancel()  # the decode worker has its blocks, or recomputed them
    yield msg
    async for msg in stream:
        yield msg
