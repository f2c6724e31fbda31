"""A running worker: the engine, the gRPC server (Worker + health + reflection) and its etcd
record, started in order and stopped in the reverse order with a drain."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from kvmesh import __version__
from kvmesh.discovery.etcd import Registrar
from kvmesh.discovery.hosts import advertised_host, node_name
from kvmesh.discovery.keys import WorkerId, WorkerRecord, WorkerState, check_name, worker_key
from kvmesh.kv.eventlog import KvEventLog
from kvmesh.kv.fanout import KvEventHub
from kvmesh.metrics import MetricsServer, serve_metrics
from kvmesh.telemetry import server_interceptors
from kvmesh.v1 import worker_pb2, worker_pb2_grpc

from .config import WorkerConfig
from .core import Engine
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
    _server: grpc.aio.Server
    _health: health.aio.HealthServicer
    _registrar: Registrar | None  # None: standalone (no etcd)
    _config: WorkerConfig
    _metrics_task: asyncio.Task[None] | None = None  # refreshes the gauges on the loop

    def ready_line(self) -> str:
        metrics = f" metrics={self.metrics_server.url}" if self.metrics_server else ""
        return (
            f"{READY_LINE} worker_id={self.worker_id} address={self.address} port={self.port}"
            f"{metrics}"
        )

    def refresh_metrics(self) -> None:
        """Brings the gauges up to date (on the loop; done every ``metrics_refresh_s``)."""
        refresh_metrics(self.metrics, self.servicer, self.engine, self.kv_events, self._registrar)

    async def stop(self, close_engine: bool = True) -> None:
        """Drains and stops, in order: health NOT_SERVING -> etcd record draining -> refuse new
        Generate calls -> wait for in-flight ones up to drain_grace_s -> abort the rest ->
        revoke the lease -> stop the server -> shut the engine down."""
        cfg = self._config
        await self._health.enter_graceful_shutdown()
        self.servicer.draining = True
        registrar = self._registrar
        if registrar is not None:
            draining = dataclasses.replace(self.record, state=WorkerState.DRAINING)
            try:
                await registrar.update(draining.to_json())
            except Exception as exc:  # etcd down: the lease still expires; keep draining
                log.warning("could not mark %s draining in etcd: %s", self.worker_id, exc)
        in_flight = self.servicer.in_flight
        log.info("draining: %d requests in flight, up to %.1f s", in_flight, cfg.drain_grace_s)
        started = time.monotonic()
        if not await self.servicer.wait_idle(cfg.drain_grace_s):
            n = await self.servicer.abort_all()
            log.warning("drain grace over: aborted %d requests", n)
            await self.servicer.wait_idle(5.0)  # their streams end with reason ABORT
        log.info("drained in %.2f s", time.monotonic() - started)
        if registrar is not None:
            try:
                await registrar.close(revoke=True)
            except Exception as exc:
                log.warning("could not revoke the etcd lease of %s: %s", self.worker_id, exc)
        await self.servicer.close()
        await self._server.stop(grace=1.0)
        if self._metrics_task is not None:
            self._metrics_task.cancel()
            await asyncio.gather(self._metrics_task, return_exceptions=True)
        if self.metrics_server is not None:
            await asyncio.to_thread(self.metrics_server.close)
        if close_engine:
            await self.engine.close()
        log.info("worker %s stopped", self.worker_id)


def refresh_metrics(
    metrics: WorkerMetrics,
    servicer: WorkerServicer,
    engine: Engine,
    kv_events: KvEventHub,
    registrar: Registrar | None,
) -> None:
    log_ = kv_events.log
    metrics.refresh(
        engine.load(),
        servicer.in_flight,
        servicer.draining,
        KvEventState(log_.seq, kv_events.subscribers, kv_events.cut_off, log_.held()),
        None
        if registrar is None
        else EtcdState(registrar.connected, registrar.lease_id is not None),
    )


async def _refresh_metrics_every(worker: RunningWorker, every_s: float) -> None:
    while True:
        try:
            worker.refresh_metrics()
        except Exception:  # a metrics bug must not stop the refreshes (nor the worker)
            log.exception("refreshing the worker's metrics failed")
        await asyncio.sleep(every_s)


def layout_key_of(connector_layout: str) -> str:
    """The KvLayout key (what kvmanagers and routers use) of the engine connector's layout key;
    "" without a connector."""
    if not connector_layout:
        return ""
    from .connector.kvmanager_client import kv_layout

    return kv_layout(connector_layout).key


def default_worker_id(port: int) -> str:
    """``<hostname>-<port>``, made a valid etcd key segment."""
    return check_name("worker id", f"{node_name()}-{port}")


async def start_worker(config: WorkerConfig, engine: Engine) -> RunningWorker:
    """Serves ``engine`` (already started): gRPC server up, health SERVING, etcd record put.

    The engine's KV events go to a new ``KvEventLog`` from here on (``engine``'s sink is
    replaced); its epoch is a fresh uuid, so subscribers of an earlier log take a snapshot."""
    if config.worker_id:
        check_name("worker id", config.worker_id)
    check_name("cluster", config.cluster)
    max_send = max(config.max_request_bytes, config.kv_snapshot_max_bytes)
    server = grpc.aio.server(
        interceptors=server_interceptors(),
        options=[
            ("grpc.max_receive_message_length", config.max_request_bytes),
            ("grpc.max_send_message_length", max_send),
        ],
    )
    port = server.add_insecure_port(f"{config.host}:{config.port}")
    worker_id = config.worker_id or default_worker_id(port)
    address = f"{advertised_host(config.host, config.advertise_host)}:{port}"
    kv_log = KvEventLog(worker_id, uuid.uuid4().hex, config.kv_event_buffer_batches)
    kv_events = KvEventHub(kv_log, config.kv_event_queue_batches)
    engine.set_kv_event_sink(kv_events.publish)
    metrics = WorkerMetrics(model=engine.info.model)
    servicer = WorkerServicer(
        engine,
        worker_id,
        config.role,
        config.load_interval_s,
        kv_events=kv_events,
        max_send_bytes=max_send,
        metrics=metrics,
    )
    worker_pb2_grpc.add_WorkerServicer_to_server(servicer, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server
    )
    await server.start()
    info = engine.info
    record = WorkerRecord(
        worker_id=WorkerId(worker_id),
        address=address,
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
    )
    registrar = None
    metrics_server = None
    try:
        if config.metrics_port >= 0:
            metrics_server = serve_metrics(
                metrics.registry, config.metrics_host, config.metrics_port
            )
        if config.etcd_endpoints:
            registrar = Registrar(
                list(config.etcd_endpoints),
                worker_key(config.cluster, config.role, worker_id),
                record.to_json(),
                ttl_s=config.etcd_ttl_s,
            )
            await registrar.start()
        for name in ("", SERVICE_NAME):
            await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    except BaseException:
        if metrics_server is not None:
            metrics_server.close()
        await server.stop(grace=None)
        raise
    log.info(
        "worker %s serving %s on %s (registered: %s)",
        worker_id,
        info.model,
        address,
        "etcd " + registrar.key if registrar is not None else "no, standalone",
    )
    worker = RunningWorker(
        worker_id=worker_id,
        address=address,
        port=port,
        servicer=servicer,
        engine=engine,
        kv_events=kv_events,
        record=record,
        metrics=metrics,
        metrics_server=metrics_server,
        _server=server,
        _health=health_servicer,
        _registrar=registrar,
        _config=config,
    )
    worker._metrics_task = asyncio.get_running_loop().create_task(
        _refresh_metrics_every(worker, config.metrics_refresh_s), name="worker-metrics"
    )
    return worker
