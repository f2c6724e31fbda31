"""Data-parallel ranks on a real vLLM engine (the tiny model, float32, --data-parallel-size 2):
vLLM's CPU backend starts two ranks here (docs/engine.md#data-parallel-ranks), each with its own
KV cache. Behind the real worker gRPC service, a real etcd and a real router: the worker
registers both ranks, each rank's KV events reach the router's index under its own target id,
each rank reports its own load, a request sent to a rank runs there (its prefix cache, not the
other's), a conversation returns to its rank with its prefix cached, and greedy output is the
same on both ranks. One engine for the module (starting two ranks takes a minute or more)."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import grpc
import pytest

from kvmesh.client import RouterClient, make_request
from kvmesh.discovery.keys import WorkerId
from kvmesh.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from services.router.config import RouterConfig
from services.router.main import start_router
from services.worker.config import EngineConfig, WorkerConfig
from services.worker.server import start_worker
from tests.support import eventually

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

RANKS = 2
VOCAB = 1024


@pytest.fixture(scope="module")
async def engine(vllm_env: object, tiny_model: Path):  # type: ignore[no-untyped-def]
    from services.worker.engine import VllmEngine

    eng = await VllmEngine.start(
        EngineConfig(
            model=str(tiny_model),
            served_model_name="tiny",
            dtype="float32",
            max_model_len=1024,
            block_size=32,
            kv_cache_bytes=8 << 20,
            data_parallel_size=RANKS,
        )
    )
    try:
        yield eng
    finally:
        await eng.close()


@pytest.fixture
async def mesh(engine, etcd, request):  # type: ignore[no-untyped-def]
    name = f"dpv{abs(hash(request.node.name)) % 10**6}"
    endpoints = tuple(etcd.endpoints)
    worker = await start_worker(
        WorkerConfig(worker_id="v0", cluster=name, etcd_endpoints=endpoints, drain_grace_s=1.0),
        engine,
    )
    router = await start_router(
        RouterConfig(cluster=name, etcd_endpoints=endpoints, drain_grace_s=1.0)
    )
    try:
        yield router, worker
    finally:
        await router.stop()
        await worker.stop(close_engine=False)  # the module's engine serves the next test


def prompt(salt: int, n: int = 200) -> list[int]:
    rng = random.Random(salt)
    return [rng.randrange(10, VOCAB) for _ in range(n)]


async def test_two_ranks_start_and_are_routed_to_each_on_its_own(engine, mesh) -> None:
    router, worker = mesh
    assert engine.info.data_parallel_size == RANKS
    assert worker.record.data_parallel_size == RANKS
    targets = [WorkerId("v0#r0"), WorkerId("v0#r1")]
    await eventually(lambda: sorted(v.record.worker_id for v in router.workers.all()) == targets)
    await eventually(lambda: not router.kv_sync.not_live(targets), 30.0)
    async with grpc.aio.insecure_channel(worker.address) as channel:
        stub = worker_pb2_grpc.WorkerStub(channel)
        outs = []
        for rank in range(RANKS):  # the same prompt on each rank: same greedy output
            req = worker_pb2.WorkerGenerateRequest(
                request_id=f"direct-{rank}",
                prompt_token_ids=prompt(1),
                sampling=common_pb2.SamplingParams(max_tokens=8, temperature=0.0),
                data_parallel_rank=rank,
            )
            tokens: list[int] = []
            async for msg in stub.Generate(req, timeout=120):
                tokens += msg.token_ids
            outs.append(tokens)
        assert outs[0] == outs[1] and len(outs[0]) == 8
        # rank 1 only: a prompt it alone has seen
        req = worker_pb2.WorkerGenerateRequest(
            request_id="only-r1",
            prompt_token_ids=prompt(2),
            sampling=common_pb2.SamplingParams(max_tokens=2, temperature=0.0),
            data_parallel_rank=1,
        )
        async for _ in stub.Generate(req, timeout=120):
            pass
    await eventually(
        lambda: (
            engine.rank_load(1).prefix_cache_queried_tokens
            > engine.rank_load(0).prefix_cache_queried_tokens
        ),
        10.0,
    )

    # Each rank's KV events, indexed under its own target: both hold prompt 1's 6 full blocks,
    # rank 1 also prompt 2's.
    def blocks(t: WorkerId) -> int:
        return router.index.view(t).gpu_blocks

    await eventually(lambda: blocks(targets[0]) >= 6 and blocks(targets[1]) >= 12, 10.0)
    assert blocks(targets[1]) - blocks(targets[0]) >= 6
    load = router.workers.get(targets[1])
    assert load is not None
    await eventually(lambda: load.load.prefix_cache_queried_tokens >= 400, 10.0)


async def test_conversations_return_to_their_rank_with_their_prefix_cached(engine, mesh) -> None:
    router, _ = mesh
    targets = [WorkerId("v0#r0"), WorkerId("v0#r1")]
    await eventually(lambda: not router.kv_sync.not_live(targets), 30.0)
    history = {s: prompt(100 + s, 160) for s in range(4)}
    served: dict[int, list[tuple[str, int]]] = {s: [] for s in range(4)}
    async with RouterClient(router.address) as client:
        await client.wait_for_models()
        for _ in range(2):
            results = await asyncio.gather(
                *(
                    client.complete(
                        make_request(history[s] + prompt(200 + s, 20), max_tokens=4,
                                     session_id=f"c{s}"),
                        timeout_s=120,
                    )
                    for s in range(4)
                )
            )  # fmt: skip
            for s, c in enumerate(results):
                served[s].append((c.usage.worker_id, c.usage.cached_prompt_tokens))
                history[s] += prompt(200 + s, 20) + list(c.token_ids)
            await asyncio.sleep(0.5)  # KV events reach the router
    for turns in served.values():
        (first, _), (second, cached) = turns
        assert first in targets and second == first, turns
        assert cached >= 160 - 32, turns  # its rank kept its prefix
    assert {t[0][0] for t in served.values()} == set(targets), served  # both ranks used
