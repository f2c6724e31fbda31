"""``kvmesh status`` against a real etcd, the real worker service serving a simulated engine, a
real kvmanager and a real router, plus records of services that are gone (unreachable, never a
crash); the CLI's table and ``--json`` output, and its exit code when etcd does not answer."""

from __future__ import annotations

import asyncio
import functools
import json
import socket
from pathlib import Path

import grpc
import pytest

from kvmesh import cli
from kvmesh.discovery.keys import (
    KvManagerRecord,
    Role,
    WorkerId,
    WorkerRecord,
    kvmanager_key,
    worker_key,
)
from kvmesh.kv.hashing import HashConfig, block_hashes
from kvmesh.status import gather
from kvmesh.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from services.kvmanager.config import KvManagerConfig
from services.kvmanager.core.config import StoreConfig
from services.kvmanager.main import start_kvmanager
from services.router.config import RouterConfig
from services.router.main import start_router
from services.worker.config import WorkerConfig
from services.worker.server import start_worker
from services.worker.sim.engine import SimEngineConfig, SimulatedEngine
from services.worker.sim.model import SimWorkerConfig
from tests.support import eventually

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

CLUSTER = "statuscli"
MIB = 1 << 20


def sim_engine() -> SimulatedEngine:
    return SimulatedEngine(
        SimEngineConfig(
            worker=SimWorkerConfig(capacity_blocks=512, block_size=32),
            model="sim",
            max_model_len=4096,
            vocab_size=1000,
            speedup=50.0,
        ),
        hasher=functools.partial(block_hashes, cfg=HashConfig(block_size=32)),
    )


def dead_address() -> str:
    """A loopback port nothing listens on (bound, then closed)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


@pytest.fixture
async def cluster(etcd, etcd_client, tmp_path: Path):
    endpoints = tuple(etcd.endpoints)
    kvm = await start_kvmanager(
        KvManagerConfig(
            kvmanager_id="kvm-a",
            node="node-a",
            cluster=CLUSTER,
            etcd_endpoints=endpoints,
            store=StoreConfig(cpu_bytes=8 * MIB, disk_bytes=64 * MIB, disk_dir=tmp_path),
            drain_grace_s=1.0,
            metrics_port=-1,
        )
    )
    worker = await start_worker(
        WorkerConfig(
            worker_id="sim-a",
            node="node-a",
            role=Role.DECODE,
            cluster=CLUSTER,
            etcd_endpoints=endpoints,
            drain_grace_s=1.0,
            metrics_port=-1,
        ),
        sim_engine(),
    )
    router = await start_router(
        RouterConfig(
            router_id="router-a",
            cluster=CLUSTER,
            etcd_endpoints=endpoints,
            drain_grace_s=1.0,
            metrics_port=-1,
        )
    )
    # Records of services that are gone (no lease: deleted at the end).
    gone_worker = WorkerRecord(
        worker_id=WorkerId("sim-gone"), address=dead_address(), model="sim", model_path=""
    )
    gone_kvm = KvManagerRecord(kvmanager_id="kvm-gone", address=dead_address(), node="node-b")
    keys = [
        (worker_key(CLUSTER, Role.BOTH, "sim-gone"), gone_worker.to_json()),
        (kvmanager_key(CLUSTER, "kvm-gone"), gone_kvm.to_json()),
    ]
    for key, value in keys:
        await etcd_client.put(key.encode(), value.encode())
    try:
        yield worker
    finally:
        for key, _ in keys:
            await etcd_client.delete(key.encode())
        await router.stop()
        await worker.stop()
        await kvm.stop()


async def test_status_reads_etcd_and_asks_every_service(etcd, cluster):
    worker = cluster
    async with grpc.aio.insecure_channel(worker.address) as channel:
        stub = worker_pb2_grpc.WorkerStub(channel)
        prompt = list(range(1, 201))
        for rid in ("s1", "s2"):
            req = worker_pb2.WorkerGenerateRequest(
                request_id=rid,
                prompt_token_ids=prompt,
                sampling=common_pb2.SamplingParams(max_tokens=2, temperature=0.0),
            )
            [m async for m in stub.Generate(req, timeout=30)]
    load = worker.engine.load()

    s = await gather(list(etcd.endpoints), CLUSTER, timeout_s=2.0)
    by_id = {w.worker_id: w for w in s.workers}
    assert set(by_id) == {"sim-a", "sim-gone"}
    a = by_id["sim-a"]
    assert (a.reachable, a.role, a.node, a.state, a.address) == (
        True,
        "decode",
        "node-a",
        "serving",
        worker.address,
    )
    assert (a.running, a.waiting, a.in_flight) == (0, 0, 0)
    assert a.kv_cache_usage == pytest.approx(load.kv_cache_usage)
    assert a.cache_hit_rate == pytest.approx(
        load.prefix_cache_hit_tokens / load.prefix_cache_queried_tokens
    )
    assert a.cache_hit_rate is not None and a.cache_hit_rate > 0
    gone = by_id["sim-gone"]
    assert not gone.reachable and gone.error and gone.running is None

    kvms = {k.kvmanager_id: k for k in s.kvmanagers}
    assert set(kvms) == {"kvm-a", "kvm-gone"}
    cpu, disk = kvms["kvm-a"].tier("cpu"), kvms["kvm-a"].tier("disk")
    assert kvms["kvm-a"].reachable and kvms["kvm-a"].node == "node-a"
    assert cpu is not None and cpu.capacity_bytes == 8 * MIB
    assert disk is not None and disk.capacity_bytes == 64 * MIB
    assert not kvms["kvm-gone"].reachable and kvms["kvm-gone"].error

    assert [(r.router_id, r.reachable, r.serving) for r in s.routers] == [("router-a", True, True)]


async def test_cli_table_json_and_exit_codes(etcd, cluster, capsys):
    argv = ["status", "--etcd", ",".join(etcd.endpoints), "--cluster", CLUSTER]
    assert await asyncio.to_thread(cli.main, argv) == 0
    table = capsys.readouterr().out
    assert "WORKERS (2)" in table and "KVMANAGERS (2)" in table and "ROUTERS (1)" in table
    row = next(line for line in table.splitlines() if line.startswith("sim-a "))
    assert "decode" in row and "serving" in row
    assert "8.0 MiB" in table  # kvm-a's CPU capacity
    assert "worker sim-gone: UNAVAILABLE" in table
    assert "kvmanager kvm-gone:" in table

    assert await asyncio.to_thread(cli.main, [*argv, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["cluster"] == CLUSTER
    assert {w["worker_id"]: w["reachable"] for w in data["workers"]} == {
        "sim-a": True,
        "sim-gone": False,
    }
    assert data["routers"][0]["router_id"] == "router-a"

    down = ["status", "--etcd", dead_address(), "--cluster", CLUSTER, "--timeout-s", "0.5"]
    assert await asyncio.to_thread(cli.main, down) == 1
    assert "etcd unreachable" in capsys.readouterr().err


async def test_status_shows_tenants_from_the_routers_metrics(etcd, tmp_path: Path):
    """A keyed router with flow control publishes its /metrics URL in etcd; ``kvmesh status``
    sums its tenant counters: admitted, rejected by reason (a rate limit here), tokens."""
    import yaml

    from kvmesh.client import make_request
    from kvmesh.status import format_table
    from kvmesh.v1 import router_pb2_grpc
    from services.router.core.admission import AdmissionConfig
    from services.router.core.auth import hash_key

    name = "statustenants"
    endpoints = tuple(etcd.endpoints)
    keys = tmp_path / "keys.yaml"
    tree = {"tenants": {"team-a": {"keys": [hash_key("sk-a")], "requests_per_minute": 1}}}
    keys.write_text(yaml.safe_dump(tree))
    worker = await start_worker(
        WorkerConfig(worker_id="sim-t", cluster=name, etcd_endpoints=endpoints, metrics_port=-1),
        sim_engine(),
    )
    router = await start_router(
        RouterConfig(
            router_id="router-t",
            cluster=name,
            etcd_endpoints=endpoints,
            drain_grace_s=1.0,
            http_port=-1,
            api_keys_file=keys,
            admission=AdmissionConfig(enabled=True),
        )
    )
    try:
        await eventually(lambda: len(router.workers) > 0, what="the worker is known")
        async with grpc.aio.insecure_channel(router.address) as ch:
            stub = router_pb2_grpc.RouterStub(ch)
            meta = (("authorization", "Bearer sk-a"),)
            req = make_request(list(range(1, 70)), max_tokens=3, ignore_eos=True)
            [m async for m in stub.Generate(req, metadata=meta, timeout=20)]
            with pytest.raises(grpc.aio.AioRpcError) as err:  # 1 request a minute
                [m async for m in stub.Generate(req, metadata=meta, timeout=20)]
            assert err.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
        s = await gather(list(endpoints), name, timeout_s=2.0)
        assert s.routers[0].reachable
        (t,) = s.tenants
        assert (t.tenant, t.queued, t.admitted, t.rejected) == ("team-a", 0, 1, 1)
        assert t.rejected_by == (("rate-limit", 1),)
        assert t.uncached_tokens == 69 and t.output_tokens == 3
        table = format_table(s)
        assert "TENANTS (1" in table and "rate-limit 1" in table
    finally:
        await router.stop()
        await worker.stop()
