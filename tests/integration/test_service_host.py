"""The service host (kvmesh/service.py) on real gRPC, etcd and sockets: a start-up that fails
or is cancelled half-way (waiting for etcd) leaves nothing running or listening, in-process and in a real process (no "Event loop
is closed" at exit); the error interceptor sends domain errors with their code and anything
else as INTERNAL naming a request id, for unary, generator and coroutine stream handlers."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvmesh import errors
from kvmesh.grpc_errors import FIELD_KEY
from kvmesh.service import Bind, ServiceHost
from services.kvmanager.config import KvManagerConfig, PeerConfig
from services.kvmanager.main import start_kvmanager
from services.router.config import RouterConfig
from services.router.main import start_router
from tests.support import eventually

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def busy_port() -> Iterator[int]:
    """A port held by a listening socket without SO_REUSEPORT: binding it again fails."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield int(s.getsockname()[1])


def listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def other_tasks() -> set[asyncio.Task[object]]:
    return {t for t in asyncio.all_tasks() if t is not asyncio.current_task()}


async def test_kvmanager_metrics_port_in_use_undoes_the_started_server_and_data_plane(busy_port):
    grpc_port, data_port = free_port(), free_port()
    before = other_tasks()
    config = KvManagerConfig(
        port=grpc_port,
        etcd_endpoints=(),
        peer=PeerConfig(data_plane_port=data_port),
        metrics_port=busy_port,
    )
    with pytest.raises(OSError, match=r"(?i)address already in use"):
        await start_kvmanager(config)
    assert not listening(grpc_port)
    assert not listening(data_port)
    assert other_tasks() <= before


async def test_kvmanager_waiting_for_etcd_is_not_serving_and_a_cancel_leaves_nothing(caplog):
    grpc_port, data_port, metrics_port = free_port(), free_port(), free_port()
    before = other_tasks()
    config = KvManagerConfig(
        port=grpc_port,
        etcd_endpoints=(f"127.0.0.1:{free_port()}",),  # nobody listens there
        etcd_retry_max_s=0.5,
        peer=PeerConfig(data_plane_port=data_port),
        metrics_port=metrics_port,
    )
    starting = asyncio.create_task(start_kvmanager(config))
    await eventually(
        lambda: any("retrying in" in r.getMessage() for r in caplog.records), 30, "retry line"
    )
    async with grpc.aio.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=""), timeout=5
        )
    assert reply.status == health_pb2.HealthCheckResponse.NOT_SERVING
    assert not starting.done()  # it waits for etcd; it does not give up
    starting.cancel()  # what a signal does (kvmesh.service.start_or_stop)
    with pytest.raises(asyncio.CancelledError):
        await starting
    for port in (grpc_port, data_port, metrics_port):
        assert not listening(port), port
    assert other_tasks() <= before


async def test_router_http_port_in_use_undoes_server_watchers_record_and_metrics(
    etcd, etcd_client, busy_port
):
    grpc_port, metrics_port = free_port(), free_port()
    before = other_tasks()
    config = RouterConfig(
        port=grpc_port,
        router_id="r-fails",
        cluster="hostfail",
        etcd_endpoints=tuple(etcd.endpoints),
        metrics_port=metrics_port,
        http_port=busy_port,
    )
    with pytest.raises(OSError, match=r"(?i)address already in use"):
        await start_router(config)
    assert not listening(grpc_port)
    assert not listening(metrics_port)
    got = await etcd_client.get(b"/kvmesh/hostfail/routers/r-fails")
    assert got is None  # its lease was revoked
    assert other_tasks() <= before


def test_a_failed_start_exits_with_one_error_line_and_no_loop_closed_noise(busy_port):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "services.kvmanager.main",
            "--etcd",
            "",
            "--data-plane-port",
            "0",
            "--metrics-port",
            str(busy_port),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2, proc.stderr
    assert "Address already in use" in proc.stderr
    assert "Event loop is closed" not in proc.stderr
    assert "Traceback" not in proc.stderr
    assert "KVMESH_KVMANAGER_READY" not in proc.stdout


# ---- the error interceptor -----------------------------------------------------------------
class Failing:
    """Handlers of every shape, raising ``exc``."""

    def __init__(self, exc: Exception) -> None:
        self.exc = exc

    async def unary(self, request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        raise self.exc

    async def generator(
        self, request: bytes, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[bytes]:
        yield b"first"
        raise self.exc

    def returns_generator(
        self, request: bytes, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[bytes]:
        raise self.exc

    async def coroutine_stream(self, request: bytes, context: grpc.aio.ServicerContext) -> None:
        await context.write(b"first")
        raise self.exc


@contextlib.asynccontextmanager
async def serving(exc: Exception) -> AsyncIterator[grpc.aio.Channel]:
    host = ServiceHost(("t.T",), Bind("127.0.0.1", 0), drain_grace_s=0.1)
    f = Failing(exc)
    handlers = {
        "Unary": grpc.unary_unary_rpc_method_handler(f.unary),
        "Generator": grpc.unary_stream_rpc_method_handler(f.generator),
        "ReturnsGenerator": grpc.unary_stream_rpc_method_handler(f.returns_generator),
        "CoroutineStream": grpc.unary_stream_rpc_method_handler(f.coroutine_stream),
    }
    host.server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("t.T", handlers),))
    async with host.starting():
        await host.start_server()
    try:
        async with grpc.aio.insecure_channel(host.address) as channel:
            yield channel
    finally:
        await host.stop()


async def call(channel: grpc.aio.Channel, method: str) -> grpc.aio.AioRpcError:
    path = f"/t.T/{method}"

    async def invoke() -> None:
        if method == "Unary":
            await channel.unary_unary(path)(b"", timeout=5)
        else:
            _ = [m async for m in channel.unary_stream(path)(b"", timeout=5)]

    with pytest.raises(grpc.aio.AioRpcError) as info:
        await invoke()
    return info.value


METHODS = ["Unary", "Generator", "ReturnsGenerator", "CoroutineStream"]


@pytest.mark.parametrize("method", METHODS)
async def test_domain_errors_keep_their_code_and_field(method):
    async with serving(errors.InvalidArgument("temperature is -1", field="sampling.x")) as ch:
        err = await call(ch, method)
    assert err.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert err.details() == "temperature is -1"
    assert (FIELD_KEY, "sampling.x") in tuple(err.trailing_metadata() or ())


@pytest.mark.parametrize("method", METHODS)
async def test_unexpected_errors_are_internal_with_a_request_id_and_no_trace(method, caplog):
    async with serving(RuntimeError("secret detail")) as ch:
        err = await call(ch, method)
    assert err.code() is grpc.StatusCode.INTERNAL
    details = err.details() or ""
    assert "secret detail" not in details and "Traceback" not in details
    rid = details.partition("request_id=")[2].partition(")")[0]
    assert len(rid) == 16  # a fresh id: these requests carry none
    assert any(rid in r.getMessage() and method in r.getMessage() for r in caplog.records)


def test_a_grpc_port_in_use_is_one_error_line_naming_the_flag(busy_port):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "services.kvmanager.main",
            "--etcd",
            "",
            "--port",
            str(busy_port),
            "--data-plane-port",
            "0",
            "--metrics-port",
            "-1",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2, proc.stderr
    assert f"cannot bind the gRPC port 127.0.0.1:{busy_port}" in proc.stderr, proc.stderr
    assert "choose another --port" in proc.stderr
    assert "Traceback" not in proc.stderr
