"""A prefix computed on one node is served on another through the router's peer hint: a real
etcd, two real kvmanager daemons as two nodes (kvm-a on node-a, kvm-b on node-b), a real router
and real vLLM workers on the tiny model (float32), one engine at a time.

Worker A (node-a, saving to kvm-a) computes a long prompt through the router; A stops; worker B
(node-b, saving to and loading from kvm-b) starts. The same prompt through the router goes to B
with ``kv_source`` naming kvm-a; B's connector has kvm-b fetch the missing blocks from kvm-a
(KvManager.FetchFromPeer over the data plane) before the prefill and loads them: B reports the
prompt's whole blocks as cached, from a peer (``cached_peer_tokens``), and its greedy output is
A's. A hint naming a kvmanager that does not exist costs nothing but the recompute."""

from __future__ import annotations

import os
from pathlib import Path

import grpc
import pytest

from kvmesh.client import RouterClient, make_request
from kvmesh.discovery.keys import WorkerId
from kvmesh.kv.hashing import HashConfig, block_hashes
from kvmesh.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from services.kvmanager.config import KvManagerConfig
from services.kvmanager.core.config import StoreConfig
from services.kvmanager.main import RunningKvManager, start_kvmanager
from services.router.config import RouterConfig
from services.router.core.index import store_id
from services.router.main import RunningRouter, start_router
from services.worker.config import EngineConfig, WorkerConfig
from services.worker.connector import kv_transfer_config
from services.worker.main import VLLM_ENVIRONMENT
from services.worker.server import layout_key_of
from tests.support import eventually

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

BLOCK = 32
VOCAB = 1024
MAX_TOKENS = 12


def prompt(n: int, salt: int) -> list[int]:
    return [10 + (salt * 7919 + i * 31) % (VOCAB - 10) for i in range(n)]


LONG = prompt(330, 5)  # 10 full blocks and 10 tokens
HASHES = tuple(block_hashes(LONG, HashConfig(block_size=BLOCK)))
WHOLE = (len(LONG) - 1) // BLOCK * BLOCK  # what a full hit loads: never the last token


async def start_node(kid: str, node: str, cluster: str, etcd) -> RunningKvManager:
    return await start_kvmanager(
        KvManagerConfig(
            kvmanager_id=kid,
            node=node,
            cluster=cluster,
            etcd_endpoints=tuple(etcd.endpoints),
            store=StoreConfig(cpu_bytes=16 << 20),
            drain_grace_s=1.0,
            metrics_port=-1,
        )
    )


async def start_vllm_worker(tiny_model: Path, kvm: RunningKvManager, wid: str, cluster, etcd):
    from services.worker.engine import VllmEngine
    from services.worker.server import start_worker

    config = WorkerConfig(
        engine=EngineConfig(
            model=str(tiny_model),
            served_model_name="tiny",
            dtype="float32",
            max_model_len=1024,
            block_size=BLOCK,
            kv_cache_bytes=32 << 20,
            kv_transfer_config=kv_transfer_config(kvm.address, store="kvmanager"),
        ),
        worker_id=wid,
        node=kvm.node,
        cluster=cluster,
        etcd_endpoints=tuple(etcd.endpoints),
        drain_grace_s=2.0,
    )
    engine = await VllmEngine.start(config.engine)
    return engine, await start_worker(config, engine)


async def generate(router: RunningRouter, tokens: list[int]):
    async with RouterClient(router.address) as client:
        await client.wait_for_models()
        return await client.complete(make_request(tokens, max_tokens=MAX_TOKENS, temperature=0.0))


async def test_a_prefix_computed_on_node_a_is_served_on_node_b_via_the_peer_hint(
    tiny_model, etcd, monkeypatch
):
    for key, value in VLLM_ENVIRONMENT.items():
        monkeypatch.setenv(key, os.environ.get(key, value))
    cluster = "peerfetch"
    kvm_a = await start_node("kvm-a", "node-a", cluster, etcd)
    kvm_b = await start_node("kvm-b", "node-b", cluster, etcd)
    router = await start_router(
        RouterConfig(
            cluster=cluster,
            etcd_endpoints=tuple(etcd.endpoints),
            drain_grace_s=1.0,
            metrics_port=-1,
        )
    )
    worker_b = None
    try:
        # Node a computes the prompt; its connector saves the blocks to kvm-a.
        engine_a, worker_a = await start_vllm_worker(tiny_model, kvm_a, "worker-a", cluster, etcd)
        try:
            layout = engine_a.info.connector_layout
            first = await generate(router, LONG)
        finally:
            await worker_a.stop()  # flushes its saves; leaves etcd
        assert first.usage is not None and first.usage.worker_id == "worker-a"
        assert first.usage.cached_prompt_tokens == 0 and len(first.token_ids) == MAX_TOKENS
        key = layout_key_of(layout)
        peer = store_id("kvm-a", key)
        assert kvm_b.peers.stats.blocks_fetched == 0

        # Node b has never seen the prompt; the router can only send it there. It follows kvm-a's
        # blocks of B's layout although no worker runs on node-a any more: a peer.
        _engine_b, worker_b = await start_vllm_worker(tiny_model, kvm_b, "worker-b", cluster, etcd)
        await eventually(
            lambda: router.index.linked(WorkerId("worker-b")) == store_id("kvm-b", key), 30.0
        )
        await eventually(lambda: router.index.match_stores(HASHES).get(peer) is not None, 30.0)
        await eventually(
            lambda: router.index.match_stores(HASHES)[peer].blocks == len(HASHES), 30.0
        )
        second = await generate(router, LONG)
        assert second.usage is not None and second.usage.worker_id == "worker-b"
        assert second.token_ids == first.token_ids, "identical greedy output from fetched KV"
        assert second.usage.cached_prompt_tokens == WHOLE, second.usage
        # Where from: fetched from kvm-a for this request (B's engine and kvm-b had nothing).
        u = second.usage
        assert (u.cached_peer_tokens, u.cached_gpu_tokens, u.cached_cpu_tokens) == (WHOLE, 0, 0)
        assert u.cached_disk_tokens == 0
        assert kvm_b.peers.stats.blocks_fetched >= WHOLE // BLOCK  # over the data plane
        assert kvm_b.peers.stats.fetch_failures == 0
        registry = router.servicer.metrics.registry
        assert registry.get_sample_value("kvmesh_router_peer_hints_total", {"model": "tiny"}) == 1

        # A hint naming a kvmanager nobody knows: NOT_FOUND inside, a recompute outside.
        other = prompt(200, 9)
        async with grpc.aio.insecure_channel(worker_b.address) as ch:
            stub = worker_pb2_grpc.WorkerStub(ch)
            req = worker_pb2.WorkerGenerateRequest(
                request_id="ghost",
                prompt_token_ids=other,
                sampling=common_pb2.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0),
                kv_source=worker_pb2.KvSource(kvmanager_id="kvm-nowhere", blocks=6),
            )
            tokens, cached = [], -1
            async for msg in stub.Generate(req, timeout=120):
                tokens.extend(msg.token_ids)
                if msg.HasField("finished"):
                    cached = msg.finished.usage.cached_prompt_tokens
        assert len(tokens) == MAX_TOKENS and cached == 0
    finally:
        if worker_b is not None:
            await worker_b.stop()
        await router.stop()
        await kvm_a.stop()
        await kvm_b.stop()
