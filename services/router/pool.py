"""gRPC channels to the workers, and the load streams that keep the worker set's load fresh."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass

import grpc

from kvmesh.discovery.keys import WorkerId
from kvmesh.telemetry import client_interceptors
from kvmesh.tls import Tls, open_channel
from kvmesh.v1 import worker_pb2, worker_pb2_grpc

from .connections import ConnectionMap
from .core.types import LoadSnapshot
from .core.workers import Change, WorkerSet
from .mux import InProcessStub, ServeStream, StreamStub, WorkerMux

log = logging.getLogger(__name__)

_BACKOFF_S = (0.1, 0.2, 0.5, 1.0, 2.0)


class WorkerPool:
    """``local``: workers served in this process (``services/node``), by id: their data path
    (``GenerateMany``) is a call of their handler; load, KV events and the rest use gRPC."""

    def __init__(
        self,
        workers: WorkerSet,
        load_interval_s: float = 0.25,
        tls: Tls | None = None,
        local: Mapping[WorkerId, ServeStream] | None = None,
    ) -> None:
        self._workers = workers
        self._tls = tls  # the channels' TLS (mutual with the router's certificate); None: off
        self._load_interval_s = load_interval_s
        self._local = dict(local or {})
        self._conns: ConnectionMap[WorkerId, _Conn] = ConnectionMap(_close_later)

    def apply(self, change: Change) -> None:
        """Opens channels for new workers, closes them for gone ones (called on the loop)."""
        for wid in change.removed:
            self._drop(wid)
        for rec in (*change.added, *change.updated):
            if self._conns.address(rec.worker_id) == rec.address:
                continue
            self._drop(rec.worker_id)
            channel = open_channel(rec.address, self._tls, interceptors=client_interceptors())
            rank = rec.data_parallel_rank if rec.data_parallel_rank >= 0 else None
            task = asyncio.create_task(
                self._watch_load(rec.worker_id, channel, rank), name=f"load-{rec.worker_id}"
            )
            serve = self._local.get(rec.worker_id)
            stub: StreamStub = (
                worker_pb2_grpc.WorkerStub(channel) if serve is None else InProcessStub(serve)
            )
            mux = WorkerMux(stub, rec.worker_id, rank)
            self._conns.put(rec.worker_id, rec.address, _Conn(channel, task, mux))
            log.info(
                "worker %s at %s joined%s",
                rec.worker_id,
                rec.address,
                " (in this process: its data path is a call)" if serve is not None else "",
            )

    def stub(self, worker_id: WorkerId) -> worker_pb2_grpc.WorkerStub | None:
        conn = self._conns.get(worker_id)
        return worker_pb2_grpc.WorkerStub(conn.channel) if conn else None

    def mux(self, worker_id: WorkerId) -> WorkerMux | None:
        """The worker's ``GenerateMany`` data path (one stream for all requests)."""
        conn = self._conns.get(worker_id)
        return conn.mux if conn else None

    def _drop(self, worker_id: WorkerId) -> None:
        address = self._conns.address(worker_id)
        if self._conns.drop(worker_id) is not None:
            log.info("worker %s at %s left", worker_id, address)

    async def _watch_load(
        self, worker_id: WorkerId, channel: grpc.aio.Channel, rank: int | None = None
    ) -> None:
        """``rank``: a data-parallel rank's target: that rank's load."""
        stub = worker_pb2_grpc.WorkerStub(channel)
        attempt = 0
        while True:
            try:
                stream = stub.WatchLoad(
                    worker_pb2.WatchLoadRequest(
                        min_interval_s=self._load_interval_s, data_parallel_rank=rank
                    )
                )
                async for msg in stream:
                    attempt = 0
                    self._workers.set_load(worker_id, load_from_pb(msg, time.monotonic()))
            except grpc.aio.AioRpcError as exc:
                log.debug("load stream of %s ended: %s", worker_id, exc.code())
            self._workers.load_stream_ended(worker_id)
            await asyncio.sleep(_BACKOFF_S[min(attempt, len(_BACKOFF_S) - 1)])
            attempt += 1

    async def close(self) -> None:
        await self._conns.close()


@dataclass(frozen=True, slots=True)
class _Conn:
    channel: grpc.aio.Channel
    load_task: asyncio.Task[None]
    mux: WorkerMux


async def _close_later(conn: _Conn) -> None:
    """Stops the load stream; lets in-flight streams on the old channel finish (a grace)."""
    conn.load_task.cancel()
    await asyncio.gather(conn.load_task, return_exceptions=True)
    await conn.channel.close(grace=5.0)
    await conn.mux.close()


def load_from_pb(msg: worker_pb2.WorkerLoad, reported_s: float = 0.0) -> LoadSnapshot:
    return LoadSnapshot(
        running_requests=msg.running_requests,
        waiting_requests=msg.waiting_requests,
        in_flight_requests=msg.in_flight_requests,
        kv_cache_usage=msg.kv_cache_usage,
        prefix_cache_queried_tokens=msg.prefix_cache_queried_tokens,
        prefix_cache_hit_tokens=msg.prefix_cache_hit_tokens,
        prefill_computed_tokens=msg.prefill_computed_tokens,
        prefill_s=msg.prefill_seconds,
        generation_tokens=msg.generation_tokens,
        decode_tokens=msg.decode_tokens,
        decode_s=msg.decode_seconds,
        spec_draft_tokens=msg.spec_draft_tokens,
        spec_accepted_tokens=msg.spec_accepted_tokens,
        reported_s=reported_s,
    )
