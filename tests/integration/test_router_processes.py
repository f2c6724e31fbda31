"""``kvmesh router --processes 2``: two real router processes on one gRPC and one HTTP port
(SO_REUSEPORT), in front of simulated workers (services/worker/sim: a simulator, not an engine)
behind the real worker gRPC service and a real etcd. Connections spread over both processes,
each registers itself, every request is answered, SIGTERM stops them all."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import signal
import sys
import urllib.request
from pathlib import Path

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvmesh.client import RouterClient, make_request
from kvmesh.discovery.keys import routers_prefix
from kvmesh.kv.hashing import HashConfig, block_hashes
from services.worker.config import WorkerConfig
from services.worker.server import start_worker
from services.worker.sim.engine import SimEngineConfig, SimulatedEngine
from services.worker.sim.model import SimWorkerConfig

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

REPO = Path(__file__).resolve().parents[2]


def engine() -> SimulatedEngine:
    return SimulatedEngine(
        SimEngineConfig(
            worker=SimWorkerConfig(capacity_blocks=1024, block_size=32),
            model="sim",
            max_model_len=4096,
            vocab_size=1000,
            speedup=50.0,
        ),
        hasher=functools.partial(block_hashes, cfg=HashConfig(block_size=32)),
    )


def requests_served(url: str) -> float:
    with urllib.request.urlopen(url, timeout=5) as resp:
        text = resp.read().decode()
    return sum(
        s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name == "kvmesh_router_requests_total"
    )


async def test_two_router_processes_share_the_ports(etcd, etcd_client):
    cluster = f"procs{os.getpid()}"
    endpoints = ",".join(etcd.endpoints)
    workers = [
        await start_worker(
            WorkerConfig(
                worker_id=f"sim-{i}", cluster=cluster, etcd_endpoints=tuple(etcd.endpoints)
            ),
            engine(),
        )
        for i in range(2)
    ]
    argv = [
        "-m", "services.router.main",
        "--processes", "2", "--cluster", cluster, "--etcd", endpoints,
        "--http-port", "0", "--drain-grace-s", "1",
    ]  # fmt: skip
    proc = await asyncio.create_subprocess_exec(
        sys.executable, *argv, stdout=asyncio.subprocess.PIPE, cwd=REPO
    )
    try:
        assert proc.stdout is not None
        line = (await asyncio.wait_for(proc.stdout.readline(), 90)).decode()
        fields = dict(p.split("=", 1) for p in line.split()[1:] if "=" in p)
        assert line.startswith("KVMESH_ROUTER_READY") and fields["processes"] == "2", line
        metrics = fields["metrics"].split(",")
        assert len(metrics) == 2
        listed = await etcd_client.get_prefix(routers_prefix(cluster).encode())
        assert len(list(listed)) == 2  # each process registers under its own id

        # gRPC: a channel per client is a connection; the kernel spreads connections.
        for i in range(12):
            async with RouterClient(fields["address"]) as client:
                done = await client.complete(
                    make_request([5 + i, *range(10, 100)], max_tokens=3), timeout_s=30
                )
                assert len(done.token_ids) == 3
        # HTTP: a new connection per request.
        base = fields["http"]
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as s:
            for i in range(12):
                body = {"model": "sim", "prompt": [7 + i, *range(20, 80)], "max_tokens": 2}
                async with s.post(f"{base}/completions", json=body) as resp:
                    assert resp.status == 200, await resp.text()
        counts = [requests_served(url) for url in metrics]
        assert sum(counts) == 24
        assert all(c > 0 for c in counts), counts  # both processes served connections
    finally:
        proc.send_signal(signal.SIGTERM)
        code = await asyncio.wait_for(proc.wait(), 30)
        for w in workers:
            await w.stop()
    assert code == 0


def _running(pid: int) -> bool:
    """Alive and not a zombie waiting for its new parent to reap it."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _children(pid: int) -> list[int]:
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        out += [int(c) for c in (task / "children").read_text().split()]
    return out


async def test_router_processes_stop_when_the_supervisor_is_killed(etcd, etcd_client):
    # A supervisor killed with SIGKILL cannot pass a stop on: its routers must not live on as
    # orphans holding the port and their etcd records.
    cluster = f"orphans{os.getpid()}"
    argv = [
        "-m", "services.router.main",
        "--processes", "2", "--cluster", cluster, "--etcd", ",".join(etcd.endpoints),
        "--http-port", "-1", "--drain-grace-s", "1",
    ]  # fmt: skip
    proc = await asyncio.create_subprocess_exec(
        sys.executable, *argv, stdout=asyncio.subprocess.PIPE, cwd=REPO
    )
    assert proc.stdout is not None
    line = (await asyncio.wait_for(proc.stdout.readline(), 90)).decode()
    assert line.startswith("KVMESH_ROUTER_READY"), line
    children = _children(proc.pid)
    assert len(children) == 2
    proc.kill()
    await proc.wait()
    try:
        for _ in range(200):  # each drains (1 s) and leaves etcd
            alive = [c for c in children if _running(c)]
            if not alive:
                break
            await asyncio.sleep(0.1)
        assert not alive, f"router processes {alive} outlived their supervisor"
    finally:
        for c in children:
            with contextlib.suppress(ProcessLookupError):
                os.kill(c, signal.SIGKILL)
    listed = await etcd_client.get_prefix(routers_prefix(cluster).encode())
    assert not list(listed)  # they stopped as on any stop: records gone with their leases
