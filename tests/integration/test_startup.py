"""Start-up and readiness on real parts (docs/failover.md, "Start-up and readiness"): a router,
worker (simulated engine) or kvmanager process started while etcd is down serves health
NOT_SERVING, logs one WARNING per retry, turns SERVING and registers once etcd is up, and exits
cleanly on SIGTERM while it waits; a router reports NOT_SERVING (gRPC health, HTTP /health 503
with the reason) until the KV event streams of the workers etcd lists are synced, or its ready
timeout passes; a restarted router process is ready within seconds with an index that routes a
cached prefix to the worker holding it on its first request."""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import signal
import socket
import sys
import time
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from kvmesh.client import RouterClient, make_request
from kvmesh.discovery.etcd import Registrar
from kvmesh.discovery.keys import (
    Role,
    WorkerId,
    WorkerRecord,
    kvmanager_key,
    router_key,
    worker_key,
)
from kvmesh.kv.hashing import HashConfig, block_hashes
from kvmesh.lifetime import PARENT_PID_ENV
from services.router.config import RouterConfig
from services.router.main import start_router
from services.worker.config import WorkerConfig
from services.worker.server import start_worker
from services.worker.sim.engine import SimEngineConfig, SimulatedEngine
from services.worker.sim.model import SimWorkerConfig
from tests.support import eventually

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

REPO = Path(__file__).resolve().parents[2]
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
BLOCK = 32


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def health_of(address: str) -> int | None:
    """The overall health status, or None when nothing answers."""
    try:
        async with grpc.aio.insecure_channel(address) as channel:
            reply = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=2
            )
    except grpc.aio.AioRpcError:
        return None
    return int(reply.status)


def engine() -> SimulatedEngine:
    return SimulatedEngine(
        SimEngineConfig(
            worker=SimWorkerConfig(capacity_blocks=4096, block_size=BLOCK),
            model="sim",
            max_model_len=4096,
            vocab_size=1000,
            speedup=50.0,
        ),
        hasher=functools.partial(block_hashes, cfg=HashConfig(block_size=BLOCK)),
    )


# ---- processes started while etcd is down --------------------------------------------------
def service_argv(service: str, cluster: str, endpoint: str, port: int) -> list[str]:
    common = ["--cluster", cluster, "--etcd", endpoint, "--port", str(port)]
    common += ["--etcd-retry-max-s", "1", "--drain-grace-s", "1", "--metrics-port", "-1"]
    if service == "router":
        return ["-m", "services.router.main", *common, "--router-id", "r0", "--http-port", "-1"]
    if service == "worker":
        return ["-m", "services.worker.main", *common, "--engine", "simulated", "--worker-id", "w0"]
    return ["-m", "services.kvmanager.main", *common, "--kvmanager-id", "k0", "--cpu-bytes", "1MiB"]


def record_key(service: str, cluster: str) -> bytes:
    if service == "router":
        return router_key(cluster, "r0").encode()
    if service == "worker":
        return worker_key(cluster, Role.BOTH, "w0").encode()
    return kvmanager_key(cluster, "k0").encode()


@pytest.fixture
async def spawn(tmp_path: Path) -> AsyncIterator:
    """Starts a service process (stderr to a file); kills what a test left running."""
    procs: list[asyncio.subprocess.Process] = []

    async def start(
        argv: list[str], env: dict[str, str] | None = None
    ) -> tuple[asyncio.subprocess.Process, Path]:
        err = tmp_path / f"stderr-{len(procs)}.log"
        with err.open("wb") as f:
            proc = await asyncio.create_subprocess_exec(
                sys.executable,
                *argv,
                cwd=REPO,
                stdout=asyncio.subprocess.PIPE,
                stderr=f,
                env={**os.environ, **(env or {})},
            )
        procs.append(proc)
        return proc, err

    yield start
    for proc in procs:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


def clean(stderr: str) -> None:
    assert "Traceback" not in stderr, stderr
    assert "Event loop is closed" not in stderr, stderr
    assert "ERROR" not in stderr, stderr


@pytest.mark.parametrize("service", ["router", "worker", "kvmanager"])
async def test_started_while_etcd_is_down_waits_not_serving_then_registers(
    private_etcd, spawn, service
):
    cluster = f"down{service}{os.getpid()}"
    await private_etcd.astop()
    port = free_port()
    proc, err = await spawn(service_argv(service, cluster, private_etcd.endpoint, port))
    address = f"127.0.0.1:{port}"
    await eventually(
        lambda: "retrying in" in err.read_text(), 60, "a WARNING saying etcd is retried"
    )
    line = next(ln for ln in err.read_text().splitlines() if "retrying in" in ln)
    assert "WARNING" in line and "etcd unreachable" in line and private_etcd.endpoint in line
    assert "health stays NOT_SERVING until registered" in line
    assert await health_of(address) == NOT_SERVING
    assert proc.returncode is None  # it has not given up

    await private_etcd.astart()
    statuses: list[int | None] = []

    async def serving() -> bool:
        statuses.append(await health_of(address))
        return statuses[-1] == SERVING

    deadline = time.monotonic() + 30
    while not await serving():
        assert time.monotonic() < deadline, f"not SERVING after etcd came back: {statuses}"
        await asyncio.sleep(0.1)
    assert proc.stdout is not None
    ready = (await asyncio.wait_for(proc.stdout.readline(), 10)).decode()
    assert ready.startswith("KVMESH_"), ready
    import aetcd

    client = aetcd.Client(host=private_etcd.host, port=private_etcd.client_port, timeout=5)
    try:
        assert await client.get(record_key(service, cluster)) is not None
    finally:
        await client.close()
    proc.send_signal(signal.SIGTERM)
    assert await asyncio.wait_for(proc.wait(), 30) == 0
    clean(err.read_text())


@pytest.mark.parametrize("service", ["router", "worker", "kvmanager"])
async def test_sigterm_while_waiting_for_etcd_exits_cleanly(spawn, service):
    port = free_port()
    nobody = f"127.0.0.1:{free_port()}"  # nobody listens there
    proc, err = await spawn(service_argv(service, f"term{os.getpid()}", nobody, port))
    await eventually(lambda: "retrying in" in err.read_text(), 60, "the retry WARNING")
    assert await health_of(f"127.0.0.1:{port}") == NOT_SERVING
    proc.send_signal(signal.SIGTERM)
    assert await asyncio.wait_for(proc.wait(), 20) == 0
    assert proc.stdout is not None
    assert b"READY" not in await proc.stdout.read()
    stderr = err.read_text()
    clean(stderr)
    assert "stopped before it" in stderr


@pytest.mark.parametrize("service", ["router", "worker", "kvmanager"])
async def test_a_service_stops_when_its_launcher_is_killed(etcd, spawn, service):
    # kvmesh up (kvmesh/launcher.py) names itself in KVMESH_PARENT_PID: killed with SIGKILL, it
    # cannot stop its children, which then stop themselves as on SIGTERM (kvmesh/lifetime.py).
    launcher = await asyncio.create_subprocess_exec("sleep", "120")
    cluster = f"orphan{service}{os.getpid()}"
    proc, err = await spawn(
        service_argv(service, cluster, etcd.endpoints[0], free_port()),
        env={PARENT_PID_ENV: str(launcher.pid)},
    )
    assert proc.stdout is not None
    ready = (await asyncio.wait_for(proc.stdout.readline(), 60)).decode()
    assert ready.startswith("KVMESH_"), ready
    launcher.kill()
    await launcher.wait()
    assert await asyncio.wait_for(proc.wait(), 30) == 0  # drained and left, as on SIGTERM
    stderr = err.read_text()
    clean(stderr)
    assert f"launcher process {launcher.pid} is gone; stopping" in stderr
    import aetcd

    client = aetcd.Client(host=etcd.host, port=etcd.client_port, timeout=5)
    try:
        assert await client.get(record_key(service, cluster)) is None
    finally:
        await client.close()


# ---- router readiness: the KV index first ---------------------------------------------------
def sim_record(wid: str, address: str) -> WorkerRecord:
    return WorkerRecord(
        worker_id=WorkerId(wid),
        address=address,
        model="sim",
        model_path="",
        max_model_len=4096,
        block_size=BLOCK,
        vocab_size=1000,
    )


async def http_health(url: str) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as s, s.get(url) as resp:
        return resp.status, await resp.json()


async def test_router_is_not_serving_until_a_known_workers_kv_snapshot_arrives(etcd):
    """The worker etcd lists is not up yet (its KV stream cannot open): the router's gRPC
    health is NOT_SERVING and /health 503 with the reason, requests are refused; once the
    worker is up its snapshot arrives and only then does the router serve, with the worker's
    blocks in its index."""
    cluster = f"ready{os.getpid()}"
    worker_port, port, http_port = free_port(), free_port(), free_port()
    reg = Registrar(
        etcd.endpoints,
        worker_key(cluster, Role.BOTH, "w-late"),
        sim_record("w-late", f"127.0.0.1:{worker_port}").to_json(),
        ttl_s=10,
    )
    await reg.start()
    worker = None
    config = RouterConfig(
        cluster=cluster,
        etcd_endpoints=tuple(etcd.endpoints),
        port=port,
        http_port=http_port,
        drain_grace_s=1.0,
        ready_timeout_s=60.0,
    )
    starting = asyncio.create_task(start_router(config))
    try:
        address = f"127.0.0.1:{port}"
        code, body = 0, {}

        async def syncing() -> bool:
            nonlocal code, body
            try:
                code, body = await http_health(f"http://127.0.0.1:{http_port}/health")
            except aiohttp.ClientError:
                return False
            return "syncing the KV index" in str(body)

        deadline = time.monotonic() + 20
        while not await syncing():
            assert time.monotonic() < deadline, (code, body)
            await asyncio.sleep(0.05)
        assert code == 503
        assert await health_of(address) == NOT_SERVING
        async with RouterClient(address) as client:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await client.complete(make_request(list(range(1, 70)), max_tokens=1), 10)
        assert refused.value.code() is grpc.StatusCode.UNAVAILABLE
        assert "router is starting" in (refused.value.details() or "")

        # Blocks the worker holds before any router saw them: only its snapshot carries them.
        sim = engine()
        worker = await start_worker(
            WorkerConfig(worker_id="w-late", port=worker_port, cluster=cluster), sim
        )
        router = await asyncio.wait_for(starting, 30)
        try:
            assert await health_of(address) == SERVING
            assert router.kv_sync.stats()[WorkerId("w-late")].snapshots >= 1
            code, body = await http_health(f"http://127.0.0.1:{http_port}/health")
            assert code == 200, body
        finally:
            await router.stop()
    finally:
        if not starting.done():
            starting.cancel()
            await asyncio.gather(starting, return_exceptions=True)
        if worker is not None:
            await worker.stop()
        await reg.close()


async def test_router_serves_after_its_ready_timeout_naming_the_workers_not_synced(etcd, caplog):
    cluster = f"readyto{os.getpid()}"
    reg = Registrar(
        etcd.endpoints,
        worker_key(cluster, Role.BOTH, "w-gone"),
        sim_record("w-gone", f"127.0.0.1:{free_port()}").to_json(),  # nobody listens there
        ttl_s=10,
    )
    await reg.start()
    try:
        started = time.monotonic()
        with caplog.at_level(logging.WARNING, logger="services.router.main"):
            router = await start_router(
                RouterConfig(
                    cluster=cluster,
                    etcd_endpoints=tuple(etcd.endpoints),
                    http_port=-1,
                    drain_grace_s=1.0,
                    ready_timeout_s=1.0,
                )
            )
        took_s = time.monotonic() - started
        try:
            assert 1.0 <= took_s < 10, took_s
            assert await health_of(router.address) == SERVING
            warned = [r.getMessage() for r in caplog.records if "not synced" in r.getMessage()]
            assert len(warned) == 1 and "w-gone" in warned[0] and "1 of 1" in warned[0], warned
        finally:
            await router.stop()
    finally:
        await reg.close()


# ---- a restarted router: ready within seconds, the same index -----------------------------
N_WORKERS = 4
PROMPTS_PER_WORKER = 8


def prompt(i: int) -> list[int]:
    """Distinct prompts of 8 full blocks each (no shared prefix between two of them)."""
    return [1 + (i * 37 + j * 11) % 997 for j in range(8 * BLOCK)]


async def test_restarted_router_process_is_ready_within_seconds_with_the_same_index(
    etcd, spawn, capsys
):
    cluster = f"restart{os.getpid()}"
    endpoints = tuple(etcd.endpoints)
    workers = [
        await start_worker(
            WorkerConfig(worker_id=f"sim-{i}", cluster=cluster, etcd_endpoints=endpoints),
            engine(),
        )
        for i in range(N_WORKERS)
    ]
    try:
        # The first router fills the workers' caches; who holds which prompt is its decision.
        first = await start_router(
            RouterConfig(cluster=cluster, etcd_endpoints=endpoints, http_port=-1)
        )
        holder: dict[int, str] = {}
        try:
            async with RouterClient(first.address) as client:
                for i in range(N_WORKERS * PROMPTS_PER_WORKER):
                    done = await client.complete(make_request(prompt(i), max_tokens=1), 30)
                    assert done.usage is not None
                    holder[i] = done.usage.worker_id
            await eventually(
                lambda: first.index.block_count == N_WORKERS * PROMPTS_PER_WORKER * 8, 10, "index"
            )
            blocks_before = first.index.block_count
        finally:
            await first.stop()
        assert len(set(holder.values())) > 1, holder  # the prompts spread over the workers

        port = free_port()
        argv = [
            "-m", "services.router.main", "--cluster", cluster, "--etcd", ",".join(endpoints),
            "--port", str(port), "--http-port", "-1", "--metrics-port", "0",
            "--metrics-refresh-s", "0.1",
            # The decision by the index: precise-sticky would also weigh the holder's load
            # report, which can still show the previous back-to-back request (0.5 s of queue
            # against the 224 tokens' prefill saved) and send the next one elsewhere.
            "--policy", "precise-prefix",
            "--drain-grace-s", "1", "--router-id", "restarted",
        ]  # fmt: skip
        started = time.monotonic()
        proc, err = await spawn(argv)
        address = f"127.0.0.1:{port}"
        while await health_of(address) != SERVING:
            assert proc.returncode is None, err.read_text()
            assert time.monotonic() - started < 60, err.read_text()
            await asyncio.sleep(0.02)
        ready_s = time.monotonic() - started
        line = next(ln for ln in err.read_text().splitlines() if "after start" in ln)
        in_router_s = float(line.partition("(ready ")[2].partition(" s")[0])
        synced_s = float(line.partition(" worker(s) synced ")[2].partition(" s")[0])
        with capsys.disabled():
            print(
                f"\nrouter process start -> SERVING with {N_WORKERS} workers holding "
                f"{N_WORKERS * PROMPTS_PER_WORKER * 8} cached blocks: {ready_s:.2f} s "
                f"({in_router_s:.2f} s of it from start_router, the KV index synced "
                f"{synced_s:.2f} s after it; the rest Python imports)"
            )
        assert f"the KV index of {N_WORKERS} worker(s) synced" in line, line
        assert proc.stdout is not None
        ready = (await asyncio.wait_for(proc.stdout.readline(), 10)).decode()
        metrics_url = dict(p.split("=", 1) for p in ready.split()[1:])["metrics"]

        def index_blocks() -> float:
            with urllib.request.urlopen(metrics_url, timeout=5) as resp:
                text = resp.read().decode()
            return next(
                s.value
                for f in text_string_to_metric_families(text)
                for s in f.samples
                if s.name == "kvmesh_router_kv_index_blocks"
            )

        blocks_after = 0.0

        async def same_index() -> bool:
            nonlocal blocks_after
            blocks_after = await asyncio.to_thread(index_blocks)
            return blocks_after == blocks_before

        deadline = time.monotonic() + 10
        while not await same_index():  # the gauge lags the index by up to a refresh
            assert time.monotonic() < deadline, (blocks_after, blocks_before)
            await asyncio.sleep(0.1)
        assert ready_s < 30
        # Its first request for each cached prompt goes to the worker holding it.
        async with RouterClient(address) as client:
            routed = {}
            for i in holder:
                done = await client.complete(make_request(prompt(i), max_tokens=1), 30)
                assert done.usage is not None
                routed[i] = (done.usage.worker_id, done.usage.cached_prompt_tokens)
        assert routed == {i: (wid, 7 * BLOCK) for i, wid in holder.items()}
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 30) == 0
        clean(err.read_text())
    finally:
        for w in workers:
            await w.stop()
