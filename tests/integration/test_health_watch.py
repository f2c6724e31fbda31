"""``grpc.health.v1.Health/Watch`` on the real router, worker (simulated engine) and kvmanager
services, through their real servers and server interceptors (``kvmesh.telemetry.ServerSpans``),
on a real etcd: the watch says SERVING at once and NOT_SERVING when the service starts to shut
down, as Kubernetes and grpc health probes that watch expect. (The health servicer streams with
``context.write`` from a coroutine, not an async generator.)"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from kvmesh.telemetry import ServerSpans, server_interceptors, setup_tracing
from services.kvmanager.config import KvManagerConfig
from services.kvmanager.core.config import StoreConfig
from services.kvmanager.main import start_kvmanager
from services.router.config import RouterConfig
from services.router.main import start_router
from services.worker.config import WorkerConfig
from services.worker.server import start_worker
from services.worker.sim.engine import SimEngineConfig, SimulatedEngine

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING

Started = tuple[str, Callable[[], Awaitable[None]]]  # (gRPC address, stop)


@pytest.fixture(scope="module", autouse=True)
def tracing_on() -> None:
    """Tracing on, so the servers carry ``ServerSpans`` (with tracing off they have no
    interceptor at all, and the Watch bug this guards against could not show)."""
    if not isinstance(trace.get_tracer_provider(), TracerProvider):
        setup_tracing(
            "kvmesh-health-test", extra_processor=SimpleSpanProcessor(InMemorySpanExporter())
        )
    assert any(isinstance(i, ServerSpans) for i in server_interceptors())


async def router(endpoints: tuple[str, ...], cluster: str, tmp_path: Path) -> Started:
    r = await start_router(
        RouterConfig(cluster=cluster, etcd_endpoints=endpoints, drain_grace_s=1.0)
    )
    return r.address, r.stop


async def worker(endpoints: tuple[str, ...], cluster: str, tmp_path: Path) -> Started:
    w = await start_worker(
        WorkerConfig(
            worker_id="sim-0", cluster=cluster, etcd_endpoints=endpoints, drain_grace_s=1.0
        ),
        SimulatedEngine(SimEngineConfig(model="sim", vocab_size=1000)),
    )
    return w.address, w.stop


async def kvmanager(endpoints: tuple[str, ...], cluster: str, tmp_path: Path) -> Started:
    k = await start_kvmanager(
        KvManagerConfig(
            kvmanager_id="node-a",
            node="node-a",
            cluster=cluster,
            etcd_endpoints=endpoints,
            store=StoreConfig(cpu_bytes=1 << 20, disk_dir=None),
            drain_grace_s=1.0,
        )
    )
    return k.address, k.stop


@pytest.mark.parametrize("start", [router, worker, kvmanager], ids=lambda f: f.__name__)
async def test_watch_streams_serving_then_not_serving(etcd, tmp_path, start):
    address, stop = await start(tuple(etcd.endpoints), f"watch-{start.__name__}", tmp_path)
    stopping: asyncio.Task[None] | None = None
    try:
        async with grpc.aio.insecure_channel(address) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            call = health.Watch(health_pb2.HealthCheckRequest(service=""), timeout=30)
            replies = aiter(call)
            assert (await anext(replies)).status == SERVING
            stopping = asyncio.create_task(stop())  # health NOT_SERVING first, then the rest
            assert (await anext(replies)).status == NOT_SERVING
            call.cancel()
    finally:
        await (stopping if stopping is not None else stop())
