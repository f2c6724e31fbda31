"""A worker's KV event log: numbers batches, remembers what is held (for snapshots) and keeps
the last batches (for resuming subscribers). Pure; fed by whatever engine the worker runs (vLLM's
ZMQ events, or the simulated engine) and read by the WatchKvEvents servicer.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

from .events import (
    AllBlocksCleared,
    BlockHash,
    BlockRemoved,
    BlockStored,
    KvEvent,
    KvEventBatch,
    Tier,
)


class KvEventLog:
    def __init__(self, worker_id: str, epoch: str, buffer_batches: int = 4096) -> None:
        self.worker_id = worker_id
        self.epoch = epoch
        self._seq = 0
        self._buffer: deque[KvEventBatch] = deque(maxlen=buffer_batches)
        # What is held now, per tier, in insertion order (dicts keep order): hash -> parent.
        self._held: dict[Tier, dict[BlockHash, BlockHash | None]] = {t: {} for t in Tier}
        self._block_size = 0

    @property
    def seq(self) -> int:
        """The seq of the last batch appended (0: none yet)."""
        return self._seq

    def held(self, tier: Tier = Tier.GPU) -> int:
        return len(self._held[tier])

    def append(self, events: Iterable[KvEvent]) -> KvEventBatch | None:
        """Applies one step's events and returns them as the next numbered batch (None if
        there were none)."""
        evs = tuple(events)
        if not evs:
            return None
        for ev in evs:
            self._apply(ev)
        self._seq += 1
        batch = KvEventBatch(self.worker_id, self.epoch, self._seq, evs)
        self._buffer.append(batch)
        return batch

    def _apply(self, ev: KvEvent) -> None:
        if isinstance(ev, BlockStored):
            held = self._held[ev.tier]
            parent = ev.parent_hash
            for h in ev.block_hashes:
                held[h] = parent
                parent = h
            if ev.block_size:
                self._block_size = ev.block_size
        elif isinstance(ev, BlockRemoved):
            held = self._held[ev.tier]
            for h in ev.block_hashes:
                held.pop(h, None)
        elif isinstance(ev, AllBlocksCleared):
            for tier in [ev.tier] if ev.tier is not None else list(Tier):
                self._held[tier].clear()

    def snapshot(self) -> KvEventBatch:
        """Everything held now, parents before children (insertion order), as BlockStored
        events that each carry one run of chained blocks; tagged with the seq of the last
        batch it covers."""
        events: list[KvEvent] = []
        for tier, held in self._held.items():
            run: list[BlockHash] = []
            run_parent: BlockHash | None = None
            for h, parent in held.items():
                if run and parent == run[-1]:
                    run.append(h)
                    continue
                if run:
                    events.append(BlockStored(tuple(run), run_parent, tier, self._block_size))
                run, run_parent = [h], parent
            if run:
                events.append(BlockStored(tuple(run), run_parent, tier, self._block_size))
        return KvEventBatch(self.worker_id, self.epoch, self._seq, tuple(events), snapshot=True)

    def since(self, epoch: str, from_seq: int) -> list[KvEventBatch] | None:
        """Batches ``from_seq`` onwards if this epoch still buffers all of them, else None (the
        subscriber needs a snapshot)."""
        if epoch != self.epoch or from_seq < 1 or from_seq > self._seq + 1:
            return None
        if from_seq == self._seq + 1:
            return []
        if not self._buffer or self._buffer[0].seq > from_seq:
            return None
        start = from_seq - self._buffer[0].seq
        return list(self._buffer)[start:]
