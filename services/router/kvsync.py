"""The workers' KV event streams (Worker.WatchKvEvents), kept open and handed to the index.

One ``KvEventSubscriber`` per worker keeps a stream open: it reconnects with backoff, resumes
with ``(epoch, last seq + 1)`` after a lost stream (the worker replays the missed batches if it
still buffers them, else starts with a snapshot), and asks for a snapshot (empty epoch) whenever
``on_batch`` says the index cannot apply what came (a gap, a new epoch) or a batch does not follow
the previous one. ``KvEventSync`` owns one subscriber per worker and follows the worker set like
``WorkerPool`` does (``apply(change)``); ``wait_live`` is the router's readiness: it returns
once the given workers' streams are live (the index exact for them) or a timeout passes. The
kvmanagers' tier event streams
(``KvManager.WatchKvEvents`` of one layout) speak the same protocol and use the same subscriber
with another ``watch`` (``tiersync.py``).

Callbacks run on the event loop, one worker's batches in order:

- ``on_batch(batch) -> bool``: apply the batch; True means "resync me": the stream is dropped and
  reopened for a snapshot (return True for the index's GAP / NEW_EPOCH results);
- ``on_live(worker_id)``: the stream is open and caught up (a snapshot applied, or a resume
  whose missed batches, if any, are applied); from now on the index is current for this worker;
- ``on_lost(worker_id)``: a live stream broke; the index may treat the worker's blocks as
  uncertain until ``on_live`` (after a resume, nothing needs to be re-applied).

Streams are long-lived and have no deadline; a worker that disappears is removed through etcd
(``apply``), which cancels its stream. Each stream has its own channel, so the snapshot size limit
(``max_message_bytes``) does not widen the router's other worker calls.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

import grpc

from kvmesh.discovery.keys import WorkerId
from kvmesh.kv.events import (
    BlockRemoved,
    BlockStored,
    KvEventBatch,
)
from kvmesh.kv_wire import KV_RESUMED_KEY, KV_SEQ_KEY, kv_batch_from_pb
from kvmesh.telemetry import client_interceptors
from kvmesh.tls import Tls, open_channel
from kvmesh.v1 import worker_pb2, worker_pb2_grpc

from .connections import ConnectionMap
from .core.workers import Change

log = logging.getLogger(__name__)

S = TypeVar("S", bound=str)  # what a stream is of: a WorkerId, or a StoreId

OnBatch = Callable[[KvEventBatch], bool]
OnWorker = Callable[[WorkerId], None]


class EventCall(Protocol):
    """A server-streaming call of KvEventBatch messages (grpc.aio's UnaryStreamCall)."""

    def __aiter__(self) -> AsyncIterator[worker_pb2.KvEventBatch]: ...
    async def initial_metadata(self) -> Any: ...
    def cancel(self) -> bool: ...


# (epoch, from_seq) -> the call; built once per channel.
OpenEvents = Callable[[str, int], EventCall]
WatchFactory = Callable[[grpc.aio.Channel], OpenEvents]


def worker_events(channel: grpc.aio.Channel, rank: int | None = None) -> OpenEvents:
    """``Worker.WatchKvEvents``; ``rank``: of that data-parallel rank (its own log)."""
    stub = worker_pb2_grpc.WorkerStub(channel)

    def open_(epoch: str, from_seq: int) -> EventCall:
        request = worker_pb2.WatchKvEventsRequest(
            epoch=epoch, from_seq=from_seq, data_parallel_rank=rank
        )
        return stub.WatchKvEvents(request)

    return open_


BACKOFF_S = (0.1, 0.2, 0.5, 1.0, 2.0)
MAX_MESSAGE_BYTES = 256 * 1024 * 1024  # matches the worker's kv_snapshot_max_bytes default


# ---- one worker --------------------------------------------------------------------------------
@dataclass(slots=True)
class KvStreamStats:
    """One worker's KV event stream, for metrics (counters are cumulative)."""

    live: bool = False  # a stream is open and caught up with the worker's log
    epoch: str = ""  # the epoch of the last batch applied
    last_seq: int = 0  # the seq of the last batch applied
    batches: int = 0  # batches received, snapshots included
    snapshots: int = 0
    blocks_stored: int = 0  # block hashes in BlockStored events (snapshots included)
    blocks_removed: int = 0
    resyncs: int = 0  # snapshots asked for because a batch could not be applied
    reconnects: int = 0  # streams opened again after one ended or failed
    lost: int = 0  # streams that broke after delivering batches (on_lost calls)
    last_batch_s: float = 0.0  # time.monotonic() when the last batch arrived


def _count(stats: KvStreamStats, batch: KvEventBatch) -> None:
    stats.batches += 1
    stats.snapshots += batch.snapshot
    stats.last_batch_s = time.monotonic()
    for ev in batch.events:
        if isinstance(ev, BlockStored):
            stats.blocks_stored += len(ev.block_hashes)
        elif isinstance(ev, BlockRemoved):
            stats.blocks_removed += len(ev.block_hashes)


def channel_options(max_message_bytes: int = MAX_MESSAGE_BYTES) -> list[tuple[str, int]]:
    return [
        ("grpc.max_receive_message_length", max_message_bytes),
        # Reconnect quickly after a blip; the stream loop has its own backoff on top.
        ("grpc.initial_reconnect_backoff_ms", 100),
        ("grpc.min_reconnect_backoff_ms", 100),
        ("grpc.max_reconnect_backoff_ms", 2000),
    ]


class KvEventSubscriber(Generic[S]):
    """Follows one worker's KV events (or, with ``watch``, another source of numbered
    ``KvEventBatch`` streams, such as a kvmanager's tier events of one layout) until
    ``close()``. ``source_id`` names it in logs and in the ``on_lost`` / ``on_live`` calls."""

    def __init__(
        self,
        source_id: S,
        address: str,
        on_batch: OnBatch,
        on_lost: Callable[[S], None] | None = None,
        on_live: Callable[[S], None] | None = None,
        backoff_s: Sequence[float] = BACKOFF_S,
        max_message_bytes: int = MAX_MESSAGE_BYTES,
        watch: WatchFactory = worker_events,
        tls: Tls | None = None,
    ) -> None:
        self.source_id = source_id
        self.address = address
        self.stats = KvStreamStats()
        self._on_batch = on_batch
        self._on_lost = on_lost
        self._on_live = on_live
        self._backoff_s = tuple(backoff_s) or (0.0,)
        self._channel = open_channel(
            address,
            tls,
            options=channel_options(max_message_bytes),
            interceptors=client_interceptors(),
        )
        self._open = watch(self._channel)
        self._epoch = ""  # where to resume; empty: ask for a snapshot
        self._next_seq = 0
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(
            self._run(), name=f"kv-events-{self.source_id}"
        )

    async def close(self, grace_s: float = 1.0) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        await self._channel.close(grace=grace_s)

    async def _run(self) -> None:
        attempt = 0
        opened = False
        while True:
            if opened:
                self.stats.reconnects += 1
            opened = True
            resync = False
            call = self._open(self._epoch, self._next_seq)
            try:
                # Headers come first; they say how far the worker's log was when it started.
                # Not dict(metadata): grpc's aio.Metadata iterates pairs but has keys().
                md = {k: v for k, v in await call.initial_metadata() or ()}
                caught_up = int(md.get(KV_SEQ_KEY, 0) or 0)
                if md.get(KV_RESUMED_KEY) == "1" and self._next_seq > caught_up:
                    self._set_live()  # resumed with nothing missed
                    attempt = 0
                async for msg in call:
                    batch = kv_batch_from_pb(msg)
                    if not self._handle(batch):
                        resync = True
                        break
                    attempt = 0
                    if batch.snapshot or batch.seq >= caught_up:
                        self._set_live()
                ended = "the worker ended the stream"
            except grpc.aio.AioRpcError as exc:
                ended = f"{exc.code().name}: {exc.details()}"
            except Exception as exc:  # a bug must not end the stream for good: log, retry
                log.exception("KV event stream of %s failed", self.source_id)
                ended = f"{type(exc).__name__}: {exc}"
            finally:
                call.cancel()
            if resync:
                self.stats.resyncs += 1
                self.stats.live = False  # the index asked for it: on_live again after the snapshot
                self._epoch, self._next_seq = "", 0
                log.info("KV events of %s: resubscribing for a snapshot", self.source_id)
                if attempt:  # the last stream applied nothing either: do not spin
                    await asyncio.sleep(self._backoff_s[min(attempt, len(self._backoff_s) - 1)])
                attempt += 1
                continue
            level = logging.INFO if self.stats.live else logging.DEBUG  # not every retry
            log.log(level, "KV event stream of %s ended (%s)", self.source_id, ended)
            self._set_lost()
            await asyncio.sleep(self._backoff_s[min(attempt, len(self._backoff_s) - 1)])
            attempt += 1

    def _set_live(self) -> None:
        if self.stats.live:
            return
        self.stats.live = True
        log.info(
            "KV events of %s live (epoch %s, seq %d)",
            self.source_id,
            self._epoch,
            self._next_seq - 1,
        )
        if self._on_live is not None:
            try:
                self._on_live(self.source_id)
            except Exception:
                log.exception("on_live failed for %s", self.source_id)

    def _set_lost(self) -> None:
        if not self.stats.live:
            return
        self.stats.live = False
        self.stats.lost += 1
        if self._on_lost is not None:
            try:
                self._on_lost(self.source_id)
            except Exception:
                log.exception("on_lost failed for %s", self.source_id)

    def _handle(self, batch: KvEventBatch) -> bool:
        """Applies one batch; False if the stream must be reset to a snapshot."""
        _count(self.stats, batch)
        follows = batch.snapshot or (
            batch.epoch == self._epoch and batch.seq == self._next_seq and self._next_seq > 0
        )
        if not follows:  # the worker sent what we did not ask for; do not apply it
            log.warning(
                "KV events of %s: batch epoch=%s seq=%d does not follow epoch=%s seq=%d",
                self.source_id,
                batch.epoch,
                batch.seq,
                self._epoch,
                self._next_seq - 1,
            )
            return False
        try:
            resync = self._on_batch(batch)
        except Exception:
            log.exception("on_batch failed for %s seq=%d; resyncing", self.source_id, batch.seq)
            resync = True
        if resync:
            return False
        self._epoch, self._next_seq = batch.epoch, batch.seq + 1
        self.stats.epoch, self.stats.last_seq = batch.epoch, batch.seq
        return True


# ---- all workers -------------------------------------------------------------------------------
class KvEventSync:
    """One ``KvEventSubscriber`` per worker of the set; follows its changes like ``WorkerPool``."""

    def __init__(
        self,
        on_batch: OnBatch,
        on_lost: OnWorker | None = None,
        on_live: OnWorker | None = None,
        backoff_s: Sequence[float] = BACKOFF_S,
        max_message_bytes: int = MAX_MESSAGE_BYTES,
        tls: Tls | None = None,
    ) -> None:
        self._on_batch = on_batch
        self._tls = tls
        self._on_lost = on_lost
        self._on_live = on_live
        self._backoff_s = tuple(backoff_s)
        self._max_message_bytes = max_message_bytes
        self._subscribers: ConnectionMap[WorkerId, KvEventSubscriber[WorkerId]] = ConnectionMap(
            KvEventSubscriber.close
        )
        self._changed = asyncio.Event()  # a stream went live or a worker left: wakes wait_live

    def _live(self, wid: WorkerId) -> None:
        self._changed.set()
        if self._on_live is not None:
            self._on_live(wid)

    def apply(self, change: Change) -> None:
        """Opens streams for new workers (or moved ones), closes them for gone ones (on the
        loop)."""
        for wid in change.removed:
            self._subscribers.drop(wid)
        if change.removed:
            self._changed.set()
        for rec in (*change.added, *change.updated):
            if self._subscribers.address(rec.worker_id) == rec.address:
                continue
            rank = rec.data_parallel_rank
            sub = KvEventSubscriber(
                rec.worker_id,
                rec.address,
                self._on_batch,
                self._on_lost,
                self._live,
                self._backoff_s,
                self._max_message_bytes,
                watch=functools.partial(worker_events, rank=rank) if rank >= 0 else worker_events,
                tls=self._tls,
            )
            self._subscribers.put(rec.worker_id, rec.address, sub)
            sub.start()

    def stats(self) -> dict[WorkerId, KvStreamStats]:
        return {wid: sub.stats for wid, sub in self._subscribers.items()}

    def not_live(self, worker_ids: Iterable[WorkerId]) -> list[WorkerId]:
        """Those of ``worker_ids`` still followed whose stream is not live (sorted)."""
        return sorted(
            wid
            for wid in worker_ids
            if (sub := self._subscribers.get(wid)) is not None and not sub.stats.live
        )

    async def wait_live(self, worker_ids: Iterable[WorkerId], timeout_s: float) -> list[WorkerId]:
        """Waits until the stream of each of ``worker_ids`` is live (its snapshot applied, or
        resumed with nothing missed: the index is exact for it) or the worker is gone, at most
        ``timeout_s``; returns the workers still not live then (sorted; empty: all synced)."""
        wanted = tuple(worker_ids)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            waiting = self.not_live(wanted)
            remaining = deadline - loop.time()
            if not waiting or remaining <= 0:
                return waiting
            self._changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), remaining)

    async def close(self) -> None:
        await self._subscribers.close()
