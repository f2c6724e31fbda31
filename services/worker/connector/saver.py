"""The connector's saver: one background thread that hands copied-out blocks to the store.

The engine thread copies blocks out of the KV cache into host memory and calls ``try_submit``,
which never waits: when the bytes waiting for the thread would exceed ``max_pending_bytes`` the
job is refused (the caller counts it as skipped; a skipped block is just a later cache miss).
Call ``has_room`` before copying, so a refused job costs no copy. Before saving, the thread asks
the store which leading blocks of the job it already has (blocks filled while decoding were not
in the scheduler's lookup) and saves only the rest. A store that skips held blocks by itself
(``BatchedSave``, the kvmanager) instead gets every job queued when the thread wakes in one call:
the jobs of one engine step (every request that filled a block) cost one round trip, not two
per request; and with ``batch_interval_s`` the thread waits that long after a call before the
next, and after the first job queued while it had none, so that one call carries the jobs of
many steps (each call costs the engine's process and the kvmanager a fixed few hundred
microseconds of CPU, whatever it carries) and never runs beside the step that queued it. It
stops waiting when half of ``max_pending_bytes`` is queued, when an urgent job is queued (blocks
another worker may be waiting for: a prefill handing its KV off), and for ``flush`` and
``close``.

Pure threading; no vLLM or torch imports.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from .client import BatchedSave, BlockBytes, KvBlockClient, SaveChain

log = logging.getLogger(__name__)


@dataclass(slots=True)
class SaveJob:
    """Consecutive blocks of one chain, already copied out of the engine."""

    layout_key: str
    block_hashes: Sequence[int]
    parent_hash: int | None
    blocks: Sequence[BlockBytes]
    nbytes: int
    keep_alive: object = None  # the buffer ``blocks`` are views of, if any
    urgent: bool = False  # another worker may be waiting for these blocks: no batching delay


@dataclass(slots=True)
class SaverStats:
    """Cumulative counts, read with ``BlockSaver.stats()``."""

    submitted_blocks: int = 0
    refused_blocks: int = 0  # refused: queue full (or saver closed)
    saved_blocks: int = 0  # written to the store
    saved_bytes: int = 0
    present_blocks: int = 0  # not written: the store had them (checked on the saver thread)
    failed_blocks: int = 0  # the client raised
    pending_bytes: int = 0


@dataclass(slots=True)
class _State:
    jobs: deque[SaveJob] = field(default_factory=deque)
    pending_bytes: int = 0
    busy: bool = False
    closed: bool = False
    flushing: int = 0  # callers in flush(): send what is queued without waiting
    urgent: int = 0  # urgent jobs queued: send without waiting
    next_send: float = 0.0  # monotonic time before which a batched store gets no call


class BlockSaver:
    """Runs ``client.save`` on a thread of its own, with at most ``max_pending_bytes`` queued.
    ``on_failure(job)`` is called (on the saver thread) when the client raised for a job."""

    def __init__(
        self,
        client: KvBlockClient,
        max_pending_bytes: int,
        on_failure: Callable[[SaveJob], None] | None = None,
        batch_interval_s: float = 0.0,
    ) -> None:
        self._client = client
        self._max = max_pending_bytes
        self._interval_s = batch_interval_s if isinstance(client, BatchedSave) else 0.0
        self._on_failure = on_failure
        self._state = _State()
        self._stats = SaverStats()
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="kvmesh-kv-saver", daemon=True)
        self._thread.start()

    def has_room(self, nbytes: int) -> bool:
        with self._cond:
            s = self._state
            return not s.closed and s.pending_bytes + nbytes <= self._max

    def try_submit(self, job: SaveJob) -> bool:
        """Queues ``job`` if it fits; False (and nothing queued) otherwise. Never blocks."""
        with self._cond:
            s = self._state
            if s.closed or s.pending_bytes + job.nbytes > self._max:
                self._stats.refused_blocks += len(job.block_hashes)
                return False
            if not s.jobs and not s.busy:
                # The first job after a quiet spell waits out the interval too: sent at once,
                # the call would run while its engine step hands out its tokens (on an idle
                # engine, the prefill's first token: 1.7-2 ms of TTFT, docs/serving-cost.md).
                s.next_send = max(s.next_send, time.monotonic() + self._interval_s)
            s.jobs.append(job)
            s.pending_bytes += job.nbytes
            s.urgent += job.urgent
            self._stats.submitted_blocks += len(job.block_hashes)
            # Wake the thread only when it waits for a first job or must stop holding: a
            # wake-up for nothing takes the GIL from the engine thread.
            if len(s.jobs) == 1 or not self._hold(s):
                self._cond.notify_all()
            return True

    def note_refused(self, blocks: int) -> None:
        """Counts blocks the caller skipped after ``has_room`` said no."""
        with self._cond:
            self._stats.refused_blocks += blocks

    def stats(self) -> SaverStats:
        with self._cond:
            return replace(self._stats, pending_bytes=self._state.pending_bytes)

    def flush(self, timeout_s: float) -> bool:
        """Waits until every queued job is done; False if ``timeout_s`` ran out first."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            self._state.flushing += 1
            self._cond.notify_all()
            try:
                while self._state.jobs or self._state.busy:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        return False
                    self._cond.wait(left)
                return True
            finally:
                self._state.flushing -= 1

    def close(self, timeout_s: float = 10.0) -> bool:
        """Saves what is queued (up to ``timeout_s``), then stops the thread. Returns whether
        everything queued was saved."""
        drained = self.flush(timeout_s)
        with self._cond:
            self._state.closed = True
            dropped = len(self._state.jobs)
            self._state.jobs.clear()
            self._state.pending_bytes = 0
            self._state.urgent = 0
            self._cond.notify_all()
        self._thread.join(max(0.0, timeout_s))
        if dropped:
            log.warning("KV saver closed with %d save jobs not done", dropped)
        return drained

    def _run(self) -> None:
        batched = isinstance(self._client, BatchedSave)
        while True:
            with self._cond:
                s = self._state
                while not s.closed and (not s.jobs or self._hold(s)):
                    self._cond.wait(None if not s.jobs else s.next_send - time.monotonic())
                if s.closed:
                    return
                jobs = self._take_layout(s.jobs) if batched else [s.jobs.popleft()]
                s.urgent -= sum(j.urgent for j in jobs)
                s.busy = True
            ok, present = True, 0
            blocks = sum(len(j.block_hashes) for j in jobs)
            try:
                present = self._save_batch(jobs) if batched else self._save(jobs[0])
            except Exception:
                ok = False
                log.warning("saving %d KV blocks failed", blocks, exc_info=True)
                if self._on_failure is not None:
                    for job in jobs:
                        try:
                            self._on_failure(job)
                        except Exception:
                            log.exception("KV saver failure callback failed")
            with self._cond:
                s.busy = False
                nbytes = sum(j.nbytes for j in jobs)
                s.pending_bytes -= nbytes
                if ok:
                    present = min(present, blocks)
                    self._stats.present_blocks += present
                    self._stats.saved_blocks += blocks - present
                    self._stats.saved_bytes += nbytes * (blocks - present) // max(blocks, 1)
                else:
                    self._stats.failed_blocks += blocks
                s.next_send = time.monotonic() + self._interval_s
                self._cond.notify_all()

    def _hold(self, s: _State) -> bool:
        """Whether queued jobs wait for more to join them (the caller holds the lock)."""
        return (
            self._interval_s > 0
            and not s.flushing
            and not s.urgent
            and s.pending_bytes * 2 < self._max
            and time.monotonic() < s.next_send
        )

    @staticmethod
    def _take_layout(queue: deque[SaveJob]) -> list[SaveJob]:
        """The queued jobs of the first job's layout (all of them, in practice: an engine has
        one), removed from ``queue``."""
        key = queue[0].layout_key
        jobs = [j for j in queue if j.layout_key == key]
        rest = [j for j in queue if j.layout_key != key]
        queue.clear()
        queue.extend(rest)
        return jobs

    def _save_batch(self, jobs: list[SaveJob]) -> int:
        """Every job in one ``save_chains`` call (the store skips what it holds)."""
        client = self._client
        assert isinstance(client, BatchedSave)
        chains = [SaveChain(j.block_hashes, j.parent_hash, j.blocks) for j in jobs]
        return client.save_chains(jobs[0].layout_key, chains)

    def _save(self, job: SaveJob) -> int:
        """Saves the blocks of ``job`` the store does not have; returns how many it had."""
        hashes, blocks, parent = job.block_hashes, job.blocks, job.parent_hash
        present = min(self._client.lookup(job.layout_key, hashes), len(hashes))
        if present:
            parent = hashes[present - 1]
            hashes, blocks = hashes[present:], blocks[present:]
        if hashes:
            self._client.save(job.layout_key, hashes, parent, blocks)
        return present
