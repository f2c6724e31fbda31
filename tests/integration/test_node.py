"""A router and a worker in one process (services/node): the router's data path to its own
worker is a call of the worker's ``GenerateMany`` handler, not a gRPC stream, and nothing else
changes: the worker stays registered and reachable over gRPC (a second router uses it), a
client that goes away aborts its request in the engine, and ``python -m services.node.main``
prints both ready lines and stops cleanly on SIGTERM. Simulated engines, a real etcd, real gRPC.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from kvmesh.client import RouterClient, make_request
from kvmesh.discovery.keys import WorkerId
from kvmesh.v1 import worker_pb2
from services.node.main import split_argv
from services.router.config import RouterConfig
from services.router.main import start_router
from services.worker.main import parse_args, simulated_engine
from services.worker.mux import StreamBatch, WorkerStreamServer
from services.worker.server import start_worker
from services.worker.sim.engine import SimEngineConfig, fake_token_ids
from tests.support import eventually

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

REPO = Path(__file__).resolve().parents[2]
PROMPT = [3, *range(10, 74)]
VOCAB = SimEngineConfig().vocab_size


def worker_argv(cluster: str, endpoints: str, worker_id: str, speedup: str = "1") -> list[str]:
    return [
        "--engine", "simulated", "--sim-speedup", speedup, "--served-model-name", "sim",
        "--worker-id", worker_id, "--cluster", cluster, "--etcd", endpoints,
        "--metrics-port", "-1", "--drain-grace-s", "1",
    ]  # fmt: skip


def router_config(cluster: str, endpoints: list[str]) -> RouterConfig:
    return RouterConfig(
        cluster=cluster,
        etcd_endpoints=tuple(endpoints),
        drain_grace_s=1.0,
        http_port=-1,
        metrics_port=-1,
    )


@pytest.fixture
async def node(etcd):
    """A worker and a router sharing this loop, the router's data path to it in-process (the
    calls of that path counted); and a second router reaching the same worker over gRPC."""
    cluster = f"node{os.getpid()}{abs(hash(time.monotonic())) % 10**5}"
    config = parse_args(worker_argv(cluster, ",".join(etcd.endpoints), "w0", speedup="0.2"))
    worker = await start_worker(config, simulated_engine(config))
    opened: list[int] = []

    def serve_stream(
        requests: AsyncIterator[worker_pb2.WorkerStreamIn],
    ) -> AsyncIterator[worker_pb2.WorkerStreamOut]:
        opened.append(1)
        return WorkerStreamServer(worker.servicer, StreamBatch).serve(requests)

    local = start_router(router_config(cluster, etcd.endpoints), {WorkerId("w0"): serve_stream})
    router = await local
    other = await start_router(router_config(cluster, etcd.endpoints))
    try:
        yield worker, router, other, opened
    finally:
        await other.stop()
        await router.stop()
        await worker.stop()


async def test_the_router_streams_from_its_own_worker_in_process(node):
    _, router, _, opened = node
    async with RouterClient(router.address) as client:
        await client.wait_for_models()
        request = make_request(PROMPT, max_tokens=24, ignore_eos=True, request_id="local-1")
        c = await client.complete(request, timeout_s=30)
    assert c.token_ids == fake_token_ids("local-1", 24, VOCAB)
    assert c.usage.worker_id == "w0" and c.usage.completion_tokens == 24
    assert opened == [1]  # one in-process stream carried it; no gRPC GenerateMany was opened


async def test_the_worker_still_serves_other_routers_over_grpc(node):
    _, _, other, opened = node
    async with RouterClient(other.address) as client:
        await client.wait_for_models()
        request = make_request(PROMPT, max_tokens=8, ignore_eos=True, request_id="remote-1")
        c = await client.complete(request, timeout_s=30)
    assert c.token_ids == fake_token_ids("remote-1", 8, VOCAB)
    assert c.usage.worker_id == "w0"
    assert opened == []  # that router's path was gRPC: the local one was never opened


async def test_a_client_going_away_aborts_its_request_in_the_engine(node):
    worker, router, _, _ = node
    async with RouterClient(router.address) as client:
        await client.wait_for_models()
        request = make_request(PROMPT, max_tokens=2000, ignore_eos=True, request_id="gone-1")
        stream = client.stream(request, timeout_s=60)
        got = 0
        while got < 3:
            got += len((await anext(stream)).token_ids)
        assert worker.engine.is_running("gone-1")
        stream.cancel()  # the client hangs up mid-stream
    await eventually(lambda: not worker.engine.is_running("gone-1"), 10.0)
    await eventually(lambda: worker.servicer.in_flight == 0, 10.0)


def test_node_flags_need_the_separator():
    assert split_argv(["--port", "0", "--", "--engine", "simulated"]) == (
        ["--port", "0"],
        ["--engine", "simulated"],
    )
    with pytest.raises(SystemExit, match="no '--' between the router's and the worker's flags"):
        split_argv(["--port", "0"])


def test_node_help_says_how_to_split_the_flags(capsys):
    with pytest.raises(SystemExit) as done:
        split_argv(["--help"])
    assert done.value.code == 0
    assert "kvmesh node ROUTER_FLAGS -- WORKER_FLAGS" in capsys.readouterr().out


async def test_the_node_process_prints_both_ready_lines_and_stops_on_sigterm(etcd):
    cluster = f"nodeproc{os.getpid()}"
    endpoints = ",".join(etcd.endpoints)
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "services.node.main",
        "--host", "127.0.0.1", "--port", "0", "--http-port", "0", "--metrics-port", "-1",
        "--cluster", cluster, "--etcd", endpoints,
        "--", *worker_argv(cluster, endpoints, "n0"),
        stdout=asyncio.subprocess.PIPE,
        cwd=REPO,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        lines = [(await asyncio.wait_for(proc.stdout.readline(), 60)).decode() for _ in range(2)]
        assert lines[0].startswith("KVMESH_WORKER_READY worker_id=n0 "), lines
        assert lines[1].startswith("KVMESH_ROUTER_READY address="), lines
        ready = dict(p.split("=", 1) for p in lines[1].split()[1:])
        assert ready["http"].startswith("http://127.0.0.1:")
        async with RouterClient(ready["address"]) as client:
            await client.wait_for_models()
            request = make_request(PROMPT, max_tokens=5, ignore_eos=True, request_id="p-1")
            c = await client.complete(request, timeout_s=30)
        assert c.token_ids == fake_token_ids("p-1", 5, VOCAB) and c.usage.worker_id == "n0"
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 30) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
