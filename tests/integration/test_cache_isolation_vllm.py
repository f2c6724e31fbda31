"""Caches that never leak (issue 15 section 2), golden on real vLLM: a real etcd, a kvmanager, a
real vLLM worker (tiny model) whose KV connector saves to and loads from that kvmanager, and a
router with a key file of five tenants: alice, bob and eve each on their own, carol and dave
sharing ``cache_group: team``.

The same prompt from alice twice: the second is served from the cache. From bob, and from carol:
nothing cached (``cached_tokens`` 0). From dave after carol: cached (the group shares). The
worker's KV events then hold three disjoint block chains for that one prompt (alice's, bob's,
the team's) and no unsalted one, each exactly the chain the router hashed with the tenant's
salt (so precise prefix routing finds the tenant's blocks: the router's index matches them on
the worker); the kvmanager holds the same salted chains and no unsalted block. With the engine's
own copy forgotten, eve's request of the prompt gets nothing from the kvmanager's three copies,
while alice's and the team's come back from its CPU tier."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import yaml

from kvmesh.client import RouterClient, make_request
from kvmesh.kv.hashing import HashConfig, RequestKeys, block_hashes
from kvmesh.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from services.kvmanager.config import KvManagerConfig
from services.kvmanager.core.config import StoreConfig
from services.kvmanager.main import RunningKvManager, start_kvmanager
from services.router.config import RouterConfig
from services.router.core.auth import derive_cache_salt, hash_key
from services.router.main import RunningRouter, start_router
from services.worker.config import EngineConfig, WorkerConfig
from services.worker.connector import kv_transfer_config
from services.worker.connector.kvmanager_client import kv_layout
from services.worker.main import VLLM_ENVIRONMENT
from services.worker.server import RunningWorker, start_worker
from tests.support import eventually

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

BLOCK = 32
VOCAB = 1024
PROMPT = [10 + (4242 * 7919 + i * 31) % (VOCAB - 10) for i in range(8 * BLOCK + 5)]  # 8 blocks
LOADABLE = (len(PROMPT) - 1) // BLOCK * BLOCK  # whole blocks, never the last token
SEED = "golden-test-cache-salt-seed"
TENANTS = {"alice": "", "bob": "", "carol": "team", "dave": "team", "eve": ""}
KEYS = {name: f"sk-{name}" for name in TENANTS}
CFG = HashConfig(block_size=BLOCK)


def salt(tenant: str) -> str:
    return derive_cache_salt(SEED, tenant, TENANTS[tenant])


def chain(tenant: str | None) -> list[int]:
    """The prompt's block hashes as vLLM computes them for ``tenant`` (None: unsalted)."""
    keys = RequestKeys(cache_salt=salt(tenant)) if tenant else RequestKeys()
    return [int(h) for h in block_hashes(PROMPT, CFG, keys=keys)]


@dataclass
class Mesh:
    router: RunningRouter
    worker: RunningWorker
    kvm: RunningKvManager
    engine: object  # services.worker.engine.VllmEngine (imported with vLLM's environment set)

    async def cached(self, tenant: str, rid: str) -> common_pb2.Usage:
        """The usage of the prompt from ``tenant`` (greedy, 2 tokens), through the router."""
        async with RouterClient(self.router.address, api_key=KEYS[tenant]) as client:
            done = await client.complete(
                make_request(PROMPT, max_tokens=2, temperature=0.0, request_id=rid), 120
            )
        assert done.usage is not None
        return done.usage

    async def worker_blocks(self) -> set[int]:
        """Every block the worker's KV events say its engine holds (their snapshot)."""
        async with grpc.aio.insecure_channel(self.worker.address) as channel:
            stream = worker_pb2_grpc.WorkerStub(channel).WatchKvEvents(
                worker_pb2.WatchKvEventsRequest(), timeout=30
            )
            first = await anext(aiter(stream))
            stream.cancel()
        assert first.snapshot
        return {h for e in first.events for h in e.stored.block_hashes}


@pytest.fixture
async def mesh(tiny_model: Path, etcd, tmp_path: Path, monkeypatch) -> AsyncIterator[Mesh]:
    for key, value in VLLM_ENVIRONMENT.items():
        monkeypatch.setenv(key, os.environ.get(key, value))
    from services.worker.engine import VllmEngine

    key_file = tmp_path / "keys.yaml"
    tree = {
        "cache_salt_seed": SEED,
        "tenants": {
            name: {"keys": [hash_key(KEYS[name])], **({"cache_group": g} if g else {})}
            for name, g in TENANTS.items()
        },
    }
    key_file.write_text(yaml.safe_dump(tree))
    cluster, node = "salted", "node-salted"
    endpoints = tuple(etcd.endpoints)
    kvm = await start_kvmanager(
        KvManagerConfig(
            kvmanager_id="kvm-salted",
            node=node,
            cluster=cluster,
            etcd_endpoints=endpoints,
            store=StoreConfig(cpu_bytes=8 << 20, disk_bytes=16 << 20, disk_dir=tmp_path / "kv"),
            drain_grace_s=1.0,
            metrics_port=-1,
        )
    )
    worker = router = None
    try:
        config = WorkerConfig(
            engine=EngineConfig(
                model=str(tiny_model),
                served_model_name="tiny",
                dtype="float32",
                max_model_len=512,
                block_size=BLOCK,
                kv_cache_bytes=16 << 20,
                kv_transfer_config=kv_transfer_config(kvm.address, store="kvmanager"),
            ),
            worker_id="w-salted",
            node=node,
            cluster=cluster,
            etcd_endpoints=endpoints,
            drain_grace_s=2.0,
            metrics_port=-1,
        )
        engine = await VllmEngine.start(config.engine)
        worker = await start_worker(config, engine)
        router = await start_router(
            RouterConfig(
                cluster=cluster,
                etcd_endpoints=endpoints,
                http_port=-1,
                metrics_port=-1,
                drain_grace_s=1.0,
                api_keys_file=key_file,
                api_keys_reload_s=0,
            )
        )
        await eventually(
            lambda: router.workers.candidates("tiny"), 30.0, "the router sees the worker"
        )
        yield Mesh(router, worker, kvm, engine)
    finally:
        if router is not None:
            await router.stop()
        if worker is not None:
            await worker.stop()
        await kvm.stop()


async def test_the_same_prompt_never_shares_a_block_across_tenants(mesh: Mesh) -> None:
    # One tenant: the second request is served from its first's blocks.
    assert (await mesh.cached("alice", "alice-1")).cached_prompt_tokens == 0
    assert (await mesh.cached("alice", "alice-2")).cached_prompt_tokens == LOADABLE
    # Another tenant, the same prompt: nothing of alice's is served (engine or kvmanager).
    bob = await mesh.cached("bob", "bob-1")
    assert bob.cached_prompt_tokens == 0 and bob.prompt_tokens == len(PROMPT)
    # A group shares: carol computes, dave is served hers; still nothing of alice's or bob's.
    assert (await mesh.cached("carol", "carol-1")).cached_prompt_tokens == 0
    assert (await mesh.cached("dave", "dave-1")).cached_prompt_tokens == LOADABLE

    alice, bob_chain, team, plain = chain("alice"), chain("bob"), chain("carol"), chain(None)
    assert team == chain("dave") and len(alice) == len(PROMPT) // BLOCK
    chains = {"alice": alice, "bob": bob_chain, "team": team}
    assert len({h for c in chains.values() for h in c}) == 3 * len(alice)  # pairwise disjoint

    # The router's index follows the worker's KV events: each tenant's chain, hashed by the
    # router with the tenant's salt, is the one the engine published (precise routing finds it).
    for name, hashes in chains.items():
        await eventually(
            lambda hashes=hashes: (
                mesh.router.index.match(hashes).get("w-salted") is not None
                and mesh.router.index.match(hashes)["w-salted"].gpu_blocks == len(hashes)
            ),
            30.0,
            f"the router's index holds {name}'s blocks on the worker",
        )
    assert mesh.router.index.match(plain) == {}  # no unsalted block was ever stored
    held = await mesh.worker_blocks()
    for name, hashes in chains.items():
        assert set(hashes) <= held, f"{name}'s BlockStored hashes"
    assert not set(plain) & held

    # The kvmanager keys blocks by the engine's hashes: salted the same way, no unsalted copy.
    layout = kv_layout(mesh.engine.info.connector_layout)  # type: ignore[attr-defined]
    store = mesh.kvm.store
    for name, hashes in chains.items():
        await eventually(
            lambda hashes=hashes: len(store.lookup(layout, hashes)) == len(hashes),
            30.0,
            f"{name}'s blocks reach the kvmanager",
        )
    assert store.lookup(layout, plain) == []

    # The engine forgets its own copies: only the kvmanager holds the prompt now, three times.
    assert await mesh.engine.llm.reset_prefix_cache()  # type: ignore[attr-defined]
    hits = store.stats.hits_cpu
    eve = await mesh.cached("eve", "eve-1")
    assert eve.cached_prompt_tokens == 0 and eve.cached_cpu_tokens == 0
    assert store.stats.hits_cpu == hits, "nothing of another tenant's was read for eve"
    again = await mesh.cached("alice", "alice-3")
    assert again.cached_prompt_tokens == LOADABLE and again.cached_cpu_tokens > 0
    assert (await mesh.cached("dave", "dave-2")).cached_prompt_tokens == LOADABLE
