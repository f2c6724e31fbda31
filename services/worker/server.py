"""A running worker: the engine, the gRPC server (Worker + health + reflection) and its etcd
record, started in order and stopped in the reverse order with a drain."""

from __future__ import annotations

import dataclasses
import logging
import time
import uuid
from dataclasses import dataclass

import grpc

from kvmesh import __version__
from kvmesh.discovery.hosts import node_name
from kvmesh.discovery.keys import (
    WorkerId,
    WorkerRecord,
    WorkerState,
    check_name,
    target_id,
    worker_key,
)
from kvmesh.kv.eventlog import KvEventLog
from kvmesh.kv.fanout import KvEventHub
from kvmesh.metrics import MetricsServer
from kvmesh.service import Bind, ServiceHost
from kvmesh.v1 import worker_pb2, worker_pb2_grpc

from .config import WorkerConfig
from .core import Engine, RankedEngine
from .metrics import EtcdState, KvEventState, WorkerMetrics
from .servicer import WorkerServicer

log = logging.getLogger(__name__)

SERVICE_NAME = worker_pb2.DESCRIPTOR.services_by_name["Worker"].full_name
READY_LINE = "KVMESH_WORKER_READY"


@dataclass
class RunningWorker:
    """A started worker: what main(), tests and ``kvmesh up`` need to reach and stop it."""

    worker_id: str
    address: str
    port: int
    servicer: WorkerServicer
    engine: Engine
    kv_events: KvEventHub  # the engine's KV event log (its epoch) and the stream fan-out
    record: WorkerRecord
    metrics: WorkerMetrics
    metrics_server: MetricsServer | None  # None: --metrics-port -1
    _host: ServiceHost

    @property
    def _server(self) -> grpc.aio.Server:
        return self._host.server

    def ready_line(self) -> str:
        metrics = f" metrics={self.metrics_server.url}" if self.metrics_server else ""
        return (
            f"{READY_LINE} worker_id={self.worker_id} address={self.address} port={self.port}"
            f"{metrics}"
        )

    def refresh_metrics(self) -> None:
        """Brings the gauges up to date (on the loop; done every ``metrics_refresh_s``)."""
        log_ = self.kv_events.log
        etcd = self._host.etcd_state()
        self.metrics.refresh(
            self.engine.load(),
            self.servicer.in_flight,
            self.servicer.draining,
            KvEventState(log_.seq, self.kv_events.subscribers, self.kv_events.cut_off, log_.held()),
            None if etcd is None else EtcdState(*etcd),
        )

    async def stop(self, close_engine: bool = True) -> None:
        """Drains and stops, in order: health NOT_SERVING -> refuse new Generate calls -> etcd
        record draining -> wait for in-flight ones up to drain_grace_s -> abort the rest ->
        revoke the lease -> end the watch streams -> stop the server -> shut the engine down."""
        await self._host.stop()
        if close_engine:
            await self.engine.close()
        log.info("worker %s stopped", self.worker_id)


async def _drain(servicer: WorkerServicer, grace_s: float) -> None:
    """In-flight requests get ``grace_s`` to finish; then they are aborted."""
    log.info("draining: %d requests in flight, up to %.1f s", servicer.in_flight, grace_s)
    started = time.monotonic()
    if not await servicer.wait_idle(grace_s):
        n = await servicer.abort_all()
        log.warning("drain grace over: aborted %d requests", n)
        await servicer.wait_idle(5.0)  # their streams end with reason ABORT
    log.info("drained in %.2f s", time.monotonic() - started)


def layout_key_of(connector_layout: str) -> str:
    """The KvLayout key (what kvmanagers and routers use) of the engine connector's layout key;
    "" without a connector."""
    if not connector_layout:
        return ""
    from .connector.kvmanager_client import kv_layout

    return kv_layout(connector_layout).key


def _rank_hubs(
    engine: RankedEngine, worker_id: str, config: WorkerConfig
) -> tuple[KvEventHub, ...]:
    """One KV event log and fan-out per data-parallel rank (each rank its own cache), named by
    the rank's target id (``<worker>#r<rank>``: what the router's index keys it by)."""
    hubs = []
    for rank in range(engine.info.data_parallel_size):
        log_ = KvEventLog(
            target_id(worker_id, rank), uuid.uuid4().hex, config.kv_event_buffer_batches
        )
        hub = KvEventHub(log_, config.kv_event_queue_batches)
        engine.set_rank_kv_event_sink(rank, hub.publish)
        hubs.append(hub)
    return tuple(hubs)


def default_worker_id(port: int) -> str:
    """``<hostname>-<port>``, made a valid etcd key segment."""
    return check_name("worker id", f"{node_name()}-{port}")


async def start_worker(config: WorkerConfig, engine: Engine) -> RunningWorker:
    """Serves ``engine`` (already started): gRPC server up, etcd record put, health SERVING; a
    step that fails undoes the ones before it (the engine stays the caller's).

    The engine's KV events go to a new ``KvEventLog`` from here on (``engine``'s sink is
    replaced); its epoch is a fresh uuid, so subscribers of an earlier log take a snapshot."""
    if config.worker_id:
        check_name("worker id", config.worker_id)
    check_name("cluster", config.cluster)
    max_send = max(config.max_request_bytes, config.kv_snapshot_max_bytes)
    bind = Bind(config.host, config.port, config.advertise_host, config.max_request_bytes, max_send)
    # The in-flight requests had their grace in drain(); the server's is for the rest.
    host = ServiceHost((SERVICE_NAME,), bind, 1.0, config.etcd_retry_max_s, tls=config.tls.load())
    info = engine.info
    metrics = WorkerMetrics(model=info.model, spec_positions=info.num_speculative_tokens)
    async with host.starting():
        port = host.bind_port()
        worker_id = config.worker_id or default_worker_id(port)
        kv_log = KvEventLog(worker_id, uuid.uuid4().hex, config.kv_event_buffer_batches)
        kv_events = KvEventHub(kv_log, config.kv_event_queue_batches)
        engine.set_kv_event_sink(kv_events.publish)
        servicer = WorkerServicer(
            engine,
            worker_id,
            config.role,
            config.load_interval_s,
            kv_events=kv_events,
            max_send_bytes=max_send,
            metrics=metrics,
        )
        if info.data_parallel_size > 1 and isinstance(engine, RankedEngine):
            servicer.rank_kv_events = _rank_hubs(engine, worker_id, config)
        worker_pb2_grpc.add_WorkerServicer_to_server(servicer, host.server)
        record = WorkerRecord(
            worker_id=WorkerId(worker_id),
            address=host.address,
            model=info.model,
            model_path=info.model_path,
            role=config.role,
            node=config.node or node_name(),  # as the node's kvmanager names it
            version=__version__,
            state=WorkerState.SERVING,
            max_model_len=info.max_model_len,
            block_size=info.block_size,
            vocab_size=info.vocab_size,
            kv_layout=config.kv_layout or layout_key_of(info.connector_layout),
            vllm_version=info.vllm_version,
            max_running_requests=info.max_running_requests,
            data_parallel_size=max(info.data_parallel_size, 1),
        )
        host.on_draining.append(lambda: setattr(servicer, "draining", True))
        host.draining_record = lambda: dataclasses.replace(
            record, state=WorkerState.DRAINING
        ).to_json()
        host.drain = lambda: _drain(servicer, config.drain_grace_s)
        host.before_server_stop.append(servicer.close)  # ends WatchLoad and WatchKvEvents
        await host.start_server()
        host.serve_metrics(metrics.registry, config.metrics_host, config.metrics_port)
        if config.etcd_endpoints:
            await host.register(
                config.etcd_endpoints,
                worker_key(config.cluster, config.role, worker_id),
                record.to_json(),
                config.etcd_ttl_s,
                config.etcd_security.load(),
            )
        worker = RunningWorker(
            worker_id=worker_id,
            address=host.address,
            port=port,
            servicer=servicer,
            engine=engine,
            kv_events=kv_events,
            record=record,
            metrics=metrics,
            metrics_server=host.metrics_server,
            _host=host,
        )
        host.refresh_every(config.metrics_refresh_s, worker.refresh_metrics)
    log.info(
        "worker %s serving %s on %s (registered: %s)",
        worker_id,
        info.model,
        host.address,
        "etcd " + host.registrar.key if host.registrar is not None else "no, standalone",
    )
    return worker
