"""A SIMULATED KV hand-off for ``SimulatedEngine`` (scale tests of prefill/decode
disaggregation; not a store, nothing is copied): ``SimKvStores`` stands in for the node
kvmanagers' block sets, shared in one process and keyed by kvmanager id.

- A simulated engine with ``kvmanager_id`` "saves" every prompt block it computes into that
  store, as the KV connector does, landing ``save_delay_s`` later (the connector's saver thread
  is asynchronous: the race a real decode worker must survive).
- A request whose ``kv_source`` names a store waits, bounded by ``wait_s`` (or the hint's own
  ``handoff_wait_s``: an overlapped hand-off, sent while the prefill still runs), until the store
  holds the named blocks (the connector's hand-off wait), copies them into its own node's store
  when that is another one (peer fetch), and is admitted with them as ``external_blocks``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass

from kvmesh.kv.events import BlockHash


@dataclass(frozen=True, slots=True)
class HandoffConfig:
    save_delay_s: float = 0.0  # a computed block lands in the node store this much later, s
    wait_s: float = 1.0  # the longest a request waits for handed-over blocks, s
    poll_s: float = 0.005  # how often it looks, s


class SimKvStores:
    """Simulated node kvmanagers: kvmanager id -> the block hashes it holds."""

    def __init__(self, config: HandoffConfig | None = None) -> None:
        self.config = config or HandoffConfig()
        self._blocks: dict[str, set[BlockHash]] = {}
        self._pending: set[asyncio.TimerHandle] = set()

    def put(self, kvmanager_id: str, hashes: Sequence[BlockHash]) -> None:
        """Saves ``hashes`` to ``kvmanager_id`` (after ``save_delay_s``)."""
        delay = self.config.save_delay_s
        if delay <= 0:
            self._blocks.setdefault(kvmanager_id, set()).update(hashes)
            return
        loop = asyncio.get_running_loop()
        handle: asyncio.TimerHandle | None = None

        def land() -> None:
            self._blocks.setdefault(kvmanager_id, set()).update(hashes)
            if handle is not None:
                self._pending.discard(handle)

        handle = loop.call_later(delay, land)
        self._pending.add(handle)

    def held(self, kvmanager_id: str, hashes: Sequence[BlockHash]) -> int:
        """Leading blocks of ``hashes`` the store holds."""
        have = self._blocks.get(kvmanager_id, set())
        n = 0
        for h in hashes:
            if h not in have:
                break
            n += 1
        return n

    async def load(
        self,
        source: str,
        own: str,
        hashes: Sequence[BlockHash],
        blocks: int,
        wait_s: float = 0.0,
    ) -> tuple[int, float]:
        """Waits (bounded by ``wait_s``, or the config's when 0) until ``source`` holds the
        first ``blocks`` of ``hashes``; copies what it holds into ``own`` (a peer fetch, when
        another node). Returns (blocks held, seconds waited); fewer blocks than asked means the
        rest is recomputed."""
        want = hashes[: max(0, blocks)]
        started = time.monotonic()
        end = started + (wait_s or self.config.wait_s)
        got = self.held(source, want)
        while got < len(want) and time.monotonic() < end:
            await asyncio.sleep(self.config.poll_s)
            got = self.held(source, want)
        if own and own != source and got:
            self._blocks.setdefault(own, set()).update(want[:got])
        return got, time.monotonic() - started

    def close(self) -> None:
        for handle in self._pending:
            handle.cancel()
        self._pending.clear()
