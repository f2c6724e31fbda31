"""``kvmesh router --processes 2``: two real router processes on one gRPC and one HTTP port
(SO_REUSEPORT), in front of simulated workers (services/worker/sim: a simulator, not an engine)
behind the real worker gRPC service and a real etcd. Connections spread over both processes,
each registers itself, every request is answered, SIGTERM stops them all."""

from __future__ import annotations

import asyncio
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
