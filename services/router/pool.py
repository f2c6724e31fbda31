"""gRPC channels to the workers, and the load streams that keep the worker set's load fresh."""

from __future__ import annotations

import asyncio
import logging

import grpc

from kvmesh.discovery.keys import WorkerId
from kvmesh.telemetry import client_interceptors
from kvmesh.v1 import worker_pb2, worker_pb2_grpc

from .core.types import LoadSnapshot
from .core.workers import Change, WorkerSet

log = logging.getLogger(__name__)

_BACKOFF_S = (0.1, 0.2, 0.5, 1.0, 2.0)


class WorkerPool:
    def __init__(self, workers: WorkerSet, load_interval_s: float = 0.25) -> None:
        self._workers = workers
        self._load_interval_s = load_interval_s
        self._channels: dict[WorkerId, tuple[str, grpc.aio.Channel]] = {}
        self._load_tasks: dict[WorkerId, asyncio.Task[None]] = {}
        self._closing: set[asyncio.Task[None]] = set()

    def apply(self, change: Change) -> None:
        """Opens channels for new workers, closes them for gone ones (called on the loop)."""
        for wid in change.removed:
            self._drop(wid)
        for rec in (*change.added, *change.updated):
            current = self._channels.get(rec.worker_id)
            if current is not None and current[0] == rec.address:
                continue
            self._drop(rec.worker_id)
            channel = grpc.aio.insecure_channel(rec.address, interceptors=client_interceptors())
            self._channels[rec.worker_id] = (rec.address, channel)
            self._load_tasks[rec.worker_id] = asyncio.create_task(
                self._watch_load(rec.worker_id, channel), name=f"load-{rec.worker_id}"
            )
            log.info("worker %s at %s joined", rec.worker_id, rec.address)

    def stub(self, worker_id: WorkerId) -> worker_pb2_grpc.WorkerStub | None:
        entry = self._channels.get(worker_id)
        return worker_pb2_grpc.WorkerStub(entry[1]) if entry else None

    def _drop(self, worker_id: WorkerId) -> None:
        task = self._load_tasks.pop(worker_id, None)
        if task is not None:
            task.cancel()
        entry = self._channels.pop(worker_id, None)
        if entry is not None:
            log.info("worker %s at %s left", worker_id, entry[0])
            # Let in-flight streams on the old channel finish; close it after a grace.
            closer = asyncio.create_task(_close_later(entry[1], task))
            self._closing.add(closer)
            closer.add_done_callback(self._closing.discard)

    async def _watch_load(self, worker_id: WorkerId, channel: grpc.aio.Channel) -> None:
        stub = worker_pb2_grpc.WorkerStub(channel)
        attempt = 0
        while True:
            try:
                stream = stub.WatchLoad(
                    worker_pb2.WatchLoadRequest(min_interval_s=self._load_interval_s)
                )
                async for msg in stream:
                    attempt = 0
                    self._workers.set_load(worker_id, load_from_pb(msg))
            except grpc.aio.AioRpcError as exc:
                log.debug("load stream of %s ended: %s", worker_id, exc.code())
            await asyncio.sleep(_BACKOFF_S[min(attempt, len(_BACKOFF_S) - 1)])
            attempt += 1

    async def close(self) -> None:
        for wid in list(self._channels):
            self._drop(wid)
        if self._closing:
            await asyncio.gather(*self._closing, return_exceptions=True)


async def _close_later(channel: grpc.aio.Channel, task: asyncio.Task[None] | None) -> None:
    if task is not None:
        await asyncio.gather(task, return_exceptions=True)
    await channel.close(grace=5.0)


def load_from_pb(msg: worker_pb2.WorkerLoad) -> LoadSnapshot:
    return LoadSnapshot(
        running_requests=msg.running_requests,
        waiting_requests=msg.waiting_requests,
        in_flight_requests=msg.in_flight_requests,
        kv_cache_usage=msg.kv_cache_usage,
        prefix_cache_queried_tokens=msg.prefix_cache_queried_tokens,
        prefix_cache_hit_tokens=msg.prefix_cache_hit_tokens,
    )
