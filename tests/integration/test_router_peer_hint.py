"""The router names a peer kvmanager in the worker call: a real etcd, two real kvmanager daemons
(kvm-a on node-a, kvm-b on node-b), one simulated worker (services/worker/sim: a simulator, not
an engine) on node-b behind the real worker gRPC service, and a real router. No worker runs on
node-a, yet the router follows kvm-a's tier events of the layout node-b's worker uses. Blocks put
into kvm-a make the router send the request to b1 with ``kv_source`` naming kvm-a (counted in
/metrics); once b1's engine holds the prompt itself, no hint is sent. Each call also says how
many leading blocks b1's own kvmanager holds (``store_prefix_blocks``). (The connector side, with real
vLLM engines fetching through their kvmanager, is test_peer_fetch_vllm.py.)"""

from __future__ import annotations

import asyncio
import functools
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvmesh.client import RouterClient, make_request
from kvmesh.discovery.keys import WorkerId
from kvmesh.kv.hashing import HashConfig, block_hashes
from kvmesh.v1 import kvmanager_pb2, kvmanager_pb2_grpc
from services.kvmanager.config import KvManagerConfig
from services.kvmanager.core.config import StoreConfig
from services.kvmanager.core.rates import Transfer
from services.kvmanager.main import RunningKvManager, start_kvmanager
from services.kvmanager.servicer import layout_from_pb
from services.router.config import RouterConfig
from services.router.core.index import store_id
from services.router.main import start_router
from services.worker.config import WorkerConfig
from services.worker.core import GenerateRequest, KvSource, OutputDelta
from services.worker.server import start_worker
from services.worker.sim.engine import SimEngineConfig, SimulatedEngine
from services.worker.sim.model import SimWorkerConfig
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
PROMPT2 = [999 - t % 900 for t in range(20 * BLOCK)]  # another conversation: 20 blocks
HASHES2 = tuple(block_hashes(PROMPT2, HashConfig(block_size=BLOCK)))
B1 = WorkerId("b1")


class RecordingEngine(SimulatedEngine):
    """The simulator, remembering every request it was given (the hint included)."""

    def __init__(self) -> None:
        super().__init__(
            SimEngineConfig(
                worker=SimWorkerConfig(capacity_blocks=1024, block_size=BLOCK),
                model="sim",
                max_model_len=4096,
                vocab_size=1000,
                speedup=50.0,
            ),
            hasher=functools.partial(block_hashes, cfg=HashConfig(block_size=BLOCK)),
        )
        self.seen: list[GenerateRequest] = []

    async def generate(self, request: GenerateRequest) -> AsyncIterator[OutputDelta]:
        self.seen.append(request)
        async for delta in super().generate(request):
            yield delta


async def put_blocks(kvm: RunningKvManager, n: int, hashes: tuple[int, ...] = HASHES) -> None:
    async with grpc.aio.insecure_channel(kvm.address) as channel:
        stub = kvmanager_pb2_grpc.KvManagerStub(channel)

        async def gen():
            yield kvmanager_pb2.PutBlocksRequest(
                layout=LAYOUT,
                blocks=[
                    kvmanager_pb2.KvBlock(block_hash=h, data=bytes(BLOCK_BYTES)) for h in hashes[:n]
                ],
            )

        resp = await stub.PutBlocks(gen(), timeout=10)
    assert resp.stored == n


def counter(url: str, name: str) -> float:
    with urllib.request.urlopen(url, timeout=5) as resp:
        text = resp.read().decode()
    return sum(
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == name and s.labels.get("model") == "sim"
    )


async def test_router_names_the_peer_kvmanager_holding_the_prefix(etcd, tmp_path: Path):
    cluster = "peerhint"
    endpoints = tuple(etcd.endpoints)
    kvms = [
        await start_kvmanager(
            KvManagerConfig(
                kvmanager_id=kid,
                node=node,
                cluster=cluster,
                etcd_endpoints=endpoints,
                store=StoreConfig(cpu_bytes=64 * BLOCK_BYTES),
                drain_grace_s=1.0,
                metrics_port=-1,
                metrics_refresh_s=0.1,  # publishes its measured rates this often
            )
        )
        for kid, node in (("kvm-a", "node-a"), ("kvm-b", "node-b"))
    ]
    engine = RecordingEngine()
    worker = await start_worker(
        WorkerConfig(
            worker_id=B1,
            node="node-b",
            kv_layout=KEY,
            cluster=cluster,
            etcd_endpoints=endpoints,
            drain_grace_s=1.0,
        ),
        engine,
    )
    router = await start_router(
        RouterConfig(
            cluster=cluster,
            etcd_endpoints=endpoints,
            policy="precise-prefix",
            drain_grace_s=1.0,
            metrics_refresh_s=0.1,
        )
    )
    peer, own = store_id("kvm-a", KEY), store_id("kvm-b", KEY)
    try:
        # node-a has no worker: its kvmanager is still followed, as a peer of b1's layout.
        await eventually(lambda: set(router.tier_sync.plan.streams) == {peer, own}, 15.0)
        assert dict(router.index.links()) == {B1: own}
        await eventually(lambda: B1 in router.index.workers(), 15.0)
        await put_blocks(kvms[0], 20)
        await eventually(lambda: router.index.match_stores(HASHES).get(peer) is not None, 15.0)
        await eventually(lambda: router.index.match_stores(HASHES)[peer].blocks == 20, 15.0)

        async with RouterClient(router.address) as client:
            await client.wait_for_models()
            done = await client.complete(make_request([*PROMPT, 7], max_tokens=2))
            assert done.usage is not None and done.usage.worker_id == B1
            # Priced: kvm-b never fetched from kvm-a (the link is unmeasured: tried), and the
            # fetch may take as long as recomputing its 20 blocks, at least the 0.25 s floor.
            assert engine.seen[-1].kv_source == KvSource("kvm-a", 20, 0.0, 0.25)
            # b1's own kvmanager (kvm-b, followed exactly) holds none of it: the worker is told,
            # so that its connector need not look up.
            assert engine.seen[-1].store_prefix_blocks == 0
            assert router.metrics_server is not None
            url = router.metrics_server.url
            assert await asyncio.to_thread(counter, url, "kvmesh_router_peer_hints_total") == 1
            blocks = await asyncio.to_thread(counter, url, "kvmesh_router_peer_hint_blocks_total")
            assert blocks == 20

            # b1's engine now holds the prompt itself (its KV events say so): no hint.
            await eventually(lambda: router.index.match(HASHES, [B1]).get(B1) is not None, 15.0)
            await eventually(lambda: router.index.match(HASHES, [B1])[B1].gpu_blocks == 20, 15.0)
            await client.complete(make_request([*PROMPT, 8], max_tokens=2))
            assert engine.seen[-1].kv_source is None
            await put_blocks(kvms[1], 12)  # kvm-b now holds 12 leading blocks itself
            await eventually(lambda: router.index.match_stores(HASHES).get(own) is not None)
            await eventually(lambda: router.index.match_stores(HASHES)[own].blocks == 12)
            await client.complete(make_request([*PROMPT, 9], max_tokens=2))
            assert engine.seen[-1].store_prefix_blocks == 12
            assert await asyncio.to_thread(counter, url, "kvmesh_router_peer_hints_total") == 1

            # kvm-b measures its link from kvm-a as slow (one fetch of 20 blocks in 5 s; how a
            # fetch is measured: test_kvmanager_peer.py): it publishes it on its etcd record,
            # the router reads it, and stops naming kvm-a to b1: recomputing is cheaper.
            kvms[1].servicer.rates.add(KEY, Transfer.PEER, 20 * BLOCK, 5.0, source="kvm-a")
            rates = router.tier_sync.kvmanagers
            await eventually(lambda: rates.peer_s_per_token("kvm-b", "kvm-a", KEY) > 0, 15.0)
            assert rates.peer_s_per_token("kvm-b", "kvm-a", KEY) == pytest.approx(5.0 / 640)
            await put_blocks(kvms[0], 20, HASHES2)
            await eventually(lambda: router.index.match_stores(HASHES2).get(peer) is not None)
            await eventually(lambda: router.index.match_stores(HASHES2)[peer].blocks == 20)
            await client.complete(make_request([*PROMPT2, 7], max_tokens=2))
            assert engine.seen[-1].kv_source is None
            assert await asyncio.to_thread(counter, url, "kvmesh_router_peer_hints_total") == 1
            skipped = "kvmesh_router_peer_hints_skipped_total"
            assert await asyncio.to_thread(counter, url, skipped) == 1
    finally:
        await router.stop()
        await worker.stop()
        for kvm in kvms:
            await kvm.stop()
