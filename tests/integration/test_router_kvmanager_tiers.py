"""A router's KV index learns a node's kvmanager tiers: a real etcd, a real kvmanager daemon on
node-a, simulated workers (services/worker/sim: a simulator, not an engine) behind the real
worker gRPC service, two on node-a and one on node-b, all with the same KV layout. Blocks put
into the kvmanager become CPU/disk matches of node-a's workers only; the precise-prefix scorer
ranks a node-a worker above node-b's and below a worker holding the prefix on its GPU; the
kvmanager leaving takes those matches away; a lost tier stream makes the matches hints until it
resumes."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvmesh.client import RouterClient, make_request
from kvmesh.discovery.keys import KvManagerRecord, WorkerId, kvmanager_key
from kvmesh.kv.hashing import HashConfig, block_hashes
from kvmesh.v1 import kvmanager_pb2, kvmanager_pb2_grpc
from services.kvmanager.config import KvManagerConfig
from services.kvmanager.core.config import StoreConfig
from services.kvmanager.main import RunningKvManager, start_kvmanager
from services.kvmanager.servicer import layout_from_pb
from services.router.config import RouterConfig
from services.router.core.index import PrefixMatch, ViewState, store_id
from services.router.core.scheduler.ledger import InFlightLedger
from services.router.core.scheduler.plugins import CycleContext
from services.router.core.scheduler.prefix import PreciseParams, PrecisePrefixScorer
from services.router.core.types import RouteRequest
from services.router.main import RunningRouter, start_router
from services.worker.config import WorkerConfig
from services.worker.server import RunningWorker, start_worker
from services.worker.sim.engine import SimEngineConfig, SimulatedEngine
from services.worker.sim.model import SimWorkerConfig
from tests.integration.conftest import TcpProxy
from tests.support import eventually

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

BLOCK = 32
LAYOUT = kvmanager_pb2.KvLayout(
    model="sim", block_size=BLOCK, num_layers=2, num_kv_heads=2, head_size=32, dtype="float32"
)
KEY = layout_from_pb(LAYOUT).key
BLOCK_BYTES = layout_from_pb(LAYOUT).block_bytes
PROMPT = list(range(1, 20 * BLOCK + 1))  # 20 full blocks
HASHES = tuple(block_hashes(PROMPT, HashConfig(block_size=BLOCK)))
A1, A2, B1 = WorkerId("a1"), WorkerId("a2"), WorkerId("b1")
STORE = store_id("kvm-a", KEY)


def sim_engine() -> SimulatedEngine:
    return SimulatedEngine(
        SimEngineConfig(
            worker=SimWorkerConfig(capacity_blocks=1024, block_size=BLOCK),
            model="sim",
            max_model_len=4096,
            vocab_size=1000,
            speedup=50.0,
        ),
        hasher=functools.partial(block_hashes, cfg=HashConfig(block_size=BLOCK)),
    )


@dataclass
class Mesh:
    router: RunningRouter
    kvm: RunningKvManager
    workers: list[RunningWorker]
    kvm_stopped: bool = False

    def match(self) -> dict[WorkerId, PrefixMatch]:
        return self.router.index.match(HASHES)

    def scores(self) -> dict[WorkerId, float]:
        """The precise-prefix scorer over the node's candidates, as the router would run it."""
        candidates = self.router.workers.candidates("sim")
        request = RouteRequest("r", "sim", block_hashes=HASHES, prompt_tokens=len(PROMPT))
        scorer = PrecisePrefixScorer("p", PreciseParams(), self.router.index)
        ctx = CycleContext(request, candidates, InFlightLedger(), scorer)
        got = scorer.score(ctx, candidates)
        return {v.record.worker_id: s for v, s in zip(candidates, got, strict=True)}

    async def stop_kvm(self) -> None:
        if not self.kvm_stopped:
            self.kvm_stopped = True
            await self.kvm.stop()


def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(url, timeout=5) as resp:
        text = resp.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def sample(m, name: str, **labels: str) -> float | None:
    want = tuple(sorted(labels.items()))
    return m.get((name, want))


@pytest.fixture
async def mesh(etcd, tmp_path: Path, request):
    cluster = f"tiers{abs(hash(request.node.name)) % 10**6}"
    endpoints = tuple(etcd.endpoints)
    kvm = await start_kvmanager(
        KvManagerConfig(
            kvmanager_id="kvm-a",
            node="node-a",
            cluster=cluster,
            etcd_endpoints=endpoints,
            # Room for 8 blocks in RAM: the first of 20 blocks put are written back to disk.
            store=StoreConfig(
                cpu_bytes=8 * BLOCK_BYTES, disk_bytes=64 * BLOCK_BYTES, disk_dir=tmp_path
            ),
            drain_grace_s=1.0,
            metrics_port=-1,
        )
    )
    workers = [
        await start_worker(
            WorkerConfig(
                worker_id=wid,
                node=node,
                kv_layout=KEY,
                cluster=cluster,
                etcd_endpoints=endpoints,
                drain_grace_s=1.0,
            ),
            sim_engine(),
        )
        for wid, node in ((A1, "node-a"), (A2, "node-a"), (B1, "node-b"))
    ]
    router = await start_router(
        RouterConfig(
            cluster=cluster,
            etcd_endpoints=endpoints,
            policy="precise-prefix",
            drain_grace_s=1.0,
            metrics_refresh_s=0.1,
        )
    )
    m = Mesh(router, kvm, workers)
    try:
        await eventually(lambda: set(router.index.workers()) == {A1, A2, B1}, 15.0)
        await eventually(
            lambda: router.tier_sync.stats().get(STORE, (None, None))[1] is not None, 15.0
        )
        await eventually(lambda: router.tier_sync.stats()[STORE][1].live, 15.0)
        yield m
    finally:
        await router.stop()
        for w in workers:
            await w.stop()
        await m.stop_kvm()


async def put_prompt_blocks(kvm: RunningKvManager) -> None:
    async with grpc.aio.insecure_channel(kvm.address) as channel:
        stub = kvmanager_pb2_grpc.KvManagerStub(channel)

        async def gen():
            for i in range(0, len(HASHES), 4):
                blocks = [
                    kvmanager_pb2.KvBlock(block_hash=h, data=bytes([i % 251]) * BLOCK_BYTES)
                    for h in HASHES[i : i + 4]
                ]
                yield kvmanager_pb2.PutBlocksRequest(
                    layout=LAYOUT if i == 0 else None, blocks=blocks
                )

        resp = await stub.PutBlocks(gen(), timeout=10)
    assert resp.stored == len(HASHES)


async def test_kvmanager_blocks_are_lower_tiers_of_its_nodes_workers_only(mesh: Mesh):
    router = mesh.router
    assert dict(router.index.links()) == {A1: STORE, A2: STORE}
    assert router.index.linked(B1) is None  # node-b has no kvmanager
    assert mesh.match() == {}
    await put_prompt_blocks(mesh.kvm)

    def lower_tiers_in() -> bool:
        m = mesh.match().get(A1)
        return m is not None and m.blocks == len(HASHES) and m.disk_blocks > 0

    await eventually(lower_tiers_in, 15.0)
    got = mesh.match()
    assert set(got) == {A1, A2}  # b1 is on another node
    for wid in (A1, A2):
        m = got[wid]
        assert m.gpu_blocks == 0 and m.cpu_blocks > 0 and m.disk_blocks > 0 and m.exact
        assert m.cpu_blocks + m.disk_blocks == len(HASHES)
    assert router.index.view(STORE).state is ViewState.EXACT

    scores = mesh.scores()
    assert scores[A1] == scores[A2] > scores[B1] == 0.0

    # The router sends the prompt to a node-a worker; its engine then holds it on its GPU.
    async with RouterClient(router.address) as client:
        await client.wait_for_models()
        done = await client.complete(make_request([*PROMPT, 7, 8, 9], max_tokens=2))
    hot = WorkerId(done.usage.worker_id)
    assert hot in (A1, A2)
    cold = A2 if hot == A1 else A1
    await eventually(lambda: mesh.match()[hot].gpu_blocks == len(HASHES), 15.0)
    scores = mesh.scores()
    assert scores[hot] > scores[cold] > scores[B1] == 0.0

    assert router.metrics_server is not None
    await asyncio.sleep(0.3)  # a gauge refresh
    m = await asyncio.to_thread(scrape, router.metrics_server.url)
    labels = {"kvmanager": "kvm-a", "layout": KEY}
    assert sample(m, "kvmesh_router_kv_tier_stream_live", **labels) == 1
    assert sample(m, "kvmesh_router_kv_tier_view_exact", **labels) == 1
    assert sample(m, "kvmesh_router_kv_tier_event_batches", **labels) >= 2
    assert sample(m, "kvmesh_router_kv_tier_linked_workers", **labels) == 2
    cpu = sample(m, "kvmesh_router_kv_tier_blocks", tier="cpu", **labels)
    disk = sample(m, "kvmesh_router_kv_tier_blocks", tier="disk", **labels)
    assert cpu and disk and cpu + disk >= len(HASHES)


async def test_kvmanager_leaving_takes_its_tiers_away(mesh: Mesh):
    router = mesh.router
    await put_prompt_blocks(mesh.kvm)
    await eventually(
        lambda: mesh.match().get(A1, PrefixMatch(A1, 0, 0, 0, 0, True)).blocks == 20, 15.0
    )
    await mesh.stop_kvm()  # revokes its lease: its etcd key goes at once
    await eventually(lambda: router.index.stores() == (), 15.0)
    assert mesh.match() == {}
    assert router.tier_sync.stats() == {}
    assert dict(router.index.links()) == {}
    await asyncio.sleep(0.3)
    assert router.metrics_server is not None
    m = await asyncio.to_thread(scrape, router.metrics_server.url)
    assert not [k for k in m if k[0].startswith("kvmesh_router_kv_tier_")]


async def test_lost_tier_stream_degrades_the_matches_until_it_resumes(etcd, etcd_client):
    """The router reaches a standalone kvmanager through a proxy (its record, written here, names
    the proxy): cutting the proxy loses the stream, resuming it makes the view exact again."""
    cluster = "tierslost"
    endpoints = tuple(etcd.endpoints)
    key = kvmanager_key(cluster, "kvm-p")
    sid, p1 = store_id("kvm-p", KEY), WorkerId("p1")
    async with contextlib.AsyncExitStack() as stack:
        kvm = await start_kvmanager(
            KvManagerConfig(
                kvmanager_id="kvm-p",
                node="node-p",
                cluster=cluster,
                etcd_endpoints=(),
                store=StoreConfig(cpu_bytes=64 * BLOCK_BYTES),
                metrics_port=-1,
            )
        )
        stack.push_async_callback(kvm.stop)
        proxy = TcpProxy("127.0.0.1", int(kvm.address.rsplit(":", 1)[1]))
        await proxy.start()
        stack.push_async_callback(proxy.close)
        record = KvManagerRecord("kvm-p", proxy.endpoint, "node-p").to_json()
        await etcd_client.put(key.encode(), record.encode())
        stack.push_async_callback(etcd_client.delete, key.encode())
        worker = await start_worker(
            WorkerConfig(
                worker_id=p1,
                node="node-p",
                kv_layout=KEY,
                cluster=cluster,
                etcd_endpoints=endpoints,
            ),
            sim_engine(),
        )
        stack.push_async_callback(worker.stop)
        router = await start_router(
            RouterConfig(
                cluster=cluster, etcd_endpoints=endpoints, drain_grace_s=1.0, metrics_port=-1
            )
        )
        stack.push_async_callback(router.stop)

        await put_prompt_blocks(kvm)
        await eventually(lambda: router.index.match(HASHES).get(p1) is not None, 15.0)
        await eventually(lambda: router.index.match(HASHES)[p1].blocks == len(HASHES), 15.0)
        assert router.index.match(HASHES)[p1].exact
        await proxy.cut()
        await eventually(lambda: router.index.view(sid).state is ViewState.DEGRADED, 15.0)
        m = router.index.match(HASHES)[p1]
        assert m.cpu_blocks == len(HASHES) and not m.exact  # kept, as a hint
        await proxy.resume()
        await eventually(lambda: router.index.view(sid).state is ViewState.EXACT, 15.0)
        assert router.index.match(HASHES)[p1].exact
        assert router.tier_sync.stats()[sid][1].lost >= 1
