"""A KV event log and its live fan-out to WatchKvEvents subscribers (workers and kvmanagers).

Transport-free (asyncio only). ``KvEventHub.publish`` is the engine's KV event sink: it appends
the step's events to the log (numbering them) and queues the batch for every subscriber without
ever waiting, so the engine's event path is never blocked by a slow subscriber. Each subscriber
has a bounded queue; one that falls more than ``queue_batches`` behind is cut off (its ``next()``
raises ``ResourceExhausted``) and may resubscribe from its last seq: the log keeps more batches
(``buffer_batches``) than a queue holds, so that usually resumes without a snapshot.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Sequence

from kvmesh import errors
from kvmesh.kv.eventlog import KvEventLog
from kvmesh.kv.events import KvEvent, KvEventBatch

log = logging.getLogger(__name__)


class KvSubscription:
    """One subscriber: the batches to send first (a snapshot, or the missed batches of a resumed
    epoch), then live batches from ``next()``."""

    def __init__(self, hub: KvEventHub, initial: list[KvEventBatch], resumed: bool) -> None:
        self.initial = initial
        self.resumed = resumed  # True: ``initial`` are buffered batches, not a snapshot
        self._hub = hub
        self._queue: deque[KvEventBatch] = deque()
        self._wakeup = asyncio.Event()
        self._behind = False
        self._closed = False

    @property
    def queued(self) -> int:
        return len(self._queue)

    async def next(self) -> KvEventBatch | None:
        """The next live batch; None once the hub is closed. Raises ``ResourceExhausted`` if
        this subscriber fell too far behind (it was cut off; resubscribe)."""
        while True:
            if self._behind:
                raise errors.ResourceExhausted(
                    f"KV event subscriber fell more than {self._hub.queue_batches} batches "
                    "behind; resubscribe from the last seq received"
                )
            if self._queue:
                return self._queue.popleft()
            if self._closed:
                return None
            self._wakeup.clear()
            await self._wakeup.wait()

    def close(self) -> None:
        """Unsubscribes (idempotent)."""
        self._hub._subscribers.discard(self)

    def _push(self, batch: KvEventBatch) -> bool:
        if len(self._queue) >= self._hub.queue_batches:
            self._behind = True
            self._queue.clear()
            self._wakeup.set()
            return False
        self._queue.append(batch)
        self._wakeup.set()
        return True

    def _end(self) -> None:
        self._closed = True
        self._wakeup.set()


class KvEventHub:
    def __init__(self, log: KvEventLog, queue_batches: int = 1024) -> None:
        if queue_batches < 1:
            raise ValueError(f"queue_batches must be >= 1, got {queue_batches}")
        self.log = log
        self.queue_batches = queue_batches
        self._subscribers: set[KvSubscription] = set()
        self._closed = False
        self.cut_off = 0  # subscribers cut off for falling behind (cumulative)

    @property
    def subscribers(self) -> int:
        return len(self._subscribers)

    def publish(self, events: Sequence[KvEvent]) -> None:
        """The engine's KV event sink: log the step's events and queue them for everyone."""
        batch = self.log.append(events)
        if batch is None:
            return
        for sub in list(self._subscribers):
            if not sub._push(batch):
                self._subscribers.discard(sub)
                self.cut_off += 1
                log.warning(
                    "KV event subscriber cut off at seq %d: more than %d batches behind",
                    batch.seq,
                    self.queue_batches,
                )

    def subscribe(self, epoch: str, from_seq: int) -> KvSubscription:
        """A new subscriber: it resumes at ``from_seq`` if ``epoch`` is the log's and every batch
        from there is still buffered, else starts with a snapshot. No batch can slip between the
        first batches and the live ones (both are taken in one synchronous step)."""
        missed = self.log.since(epoch, from_seq) if epoch else None
        if missed is None:
            sub = KvSubscription(self, [self.log.snapshot()], resumed=False)
        else:
            sub = KvSubscription(self, missed, resumed=True)
        if self._closed:
            sub._end()
        else:
            self._subscribers.add(sub)
        return sub

    def close(self) -> None:
        """Ends every subscriber's stream (after what is queued) and refuses new live ones."""
        self._closed = True
        for sub in list(self._subscribers):
            sub._end()
        self._subscribers.clear()
