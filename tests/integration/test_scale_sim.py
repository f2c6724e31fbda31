"""Precise prefix routing at cluster scale, on simulated workers (services/worker/sim: a
simulator, not an engine) behind the real worker gRPC service, a real etcd and a real router:
conversations come back to the worker that holds them; a worker that leaves is forgotten."""

from __future__ import annotations

import asyncio
import functools
import random

import pytest

from kvmesh.client import RouterClient, make_request
from kvmesh.discovery.keys import WorkerId
from kvmesh.kv.hashing import HashConfig, block_hashes
from services.router.config import RouterConfig
from services.router.main import start_router
from services.worker.config import WorkerConfig
from services.worker.server import start_worker
from services.worker.sim.engine import SimEngineConfig, SimulatedEngine
from services.worker.sim.model import SimWorkerConfig

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

WORKERS = 24
VOCAB = 1000
PREFIX = 1600  # 50 blocks of 32


def sim_engine() -> SimulatedEngine:
    return SimulatedEngine(
        SimEngineConfig(
            worker=SimWorkerConfig(capacity_blocks=2048, block_size=32),
            model="sim",
            max_model_len=16_384,
            vocab_size=VOCAB,
            speedup=50.0,
        ),
        hasher=functools.partial(block_hashes, cfg=HashConfig(block_size=32)),
    )


@pytest.fixture
async def cluster(etcd, request):
    name = f"scale{abs(hash(request.node.name)) % 10**6}"
    endpoints = tuple(etcd.endpoints)
    workers = [
        await start_worker(
            WorkerConfig(
                worker_id=f"sim-{i:02d}",
                cluster=name,
                etcd_endpoints=endpoints,
                drain_grace_s=1.0,
            ),
            sim_engine(),
        )
        for i in range(WORKERS)
    ]
    router = await start_router(
        RouterConfig(cluster=name, etcd_endpoints=endpoints, drain_grace_s=1.0)
    )
    try:
        yield router, workers
    finally:
        await router.stop()
        for w in workers:
            await w.stop()


async def converse(client: RouterClient, sessions: int, turns: int, seed: int):
    rng = random.Random(seed)
    history = {s: [rng.randrange(VOCAB) for _ in range(PREFIX)] for s in range(sessions)}
    served: dict[int, list[tuple[str, int]]] = {s: [] for s in range(sessions)}
    for _ in range(turns):
        results = await asyncio.gather(
            *(
                client.complete(
                    make_request(history[s] + [rng.randrange(VOCAB) for _ in range(50)],
                                 max_tokens=4, session_id=f"sess-{seed}-{s}"),
                    timeout_s=60,
                )
                for s in range(sessions)
            )
        )  # fmt: skip
        for s, c in enumerate(results):
            served[s].append((c.usage.worker_id, c.usage.cached_prompt_tokens))
            history[s] += c.token_ids
        await asyncio.sleep(0.3)  # think time: KV events reach the router
    return served


async def test_turns_return_to_their_worker_at_scale(cluster):
    router, _ = cluster
    async with RouterClient(router.address) as client:
        models = await client.wait_for_models()
        assert models.models[0].workers == WORKERS
        served = await converse(client, sessions=16, turns=3, seed=1)
    for s, turns in served.items():
        first_worker = turns[0][0]
        for worker, cached in turns[1:]:
            assert worker == first_worker, (s, turns)
            assert cached >= PREFIX - 32, (s, turns)
    homes = {turns[0][0] for turns in served.values()}
    assert len(homes) >= 8, f"16 cold sessions spread over the fleet, got {len(homes)} workers"
    assert router.index.stats().workers == WORKERS


async def test_a_worker_that_leaves_is_forgotten(cluster):
    router, workers = cluster
    async with RouterClient(router.address) as client:
        await client.wait_for_models()
        served = await converse(client, sessions=6, turns=1, seed=2)
        gone = served[0][0][0]
        victim = next(w for w in workers if w.worker_id == gone)
        await victim.stop()  # drains, revokes its lease: etcd deletes its key at once
        for _ in range(50):
            if router.workers.get(WorkerId(gone)) is None:
                break
            await asyncio.sleep(0.1)
        assert router.workers.get(WorkerId(gone)) is None
        assert router.index.view(WorkerId(gone)).state.value == "unknown"
        c = await client.complete(make_request(list(range(100)), max_tokens=2), timeout_s=30)
        assert c.usage.worker_id != gone
