"""Data-parallel ranks as routing targets (docs/engine.md#data-parallel-ranks), end to end on
simulated ranks (services/worker/sim/ranks.py: each rank a simulated engine with its own KV
cache and KV events) behind the real worker gRPC service, a real etcd and a real router: each
(worker, rank) is a target of its own, its KV events are indexed and its load reported per
rank, the router names the rank in the call and the rank it names is the one that runs it."""

from __future__ import annotations

import asyncio
import functools
import random

import grpc
import pytest

from kvmesh.client import RouterClient, make_request
from kvmesh.discovery.keys import WorkerId, split_target
from kvmesh.kv.hashing import HashConfig, block_hashes
from kvmesh.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from services.router.config import RouterConfig
from services.router.main import start_router
from services.worker.config import WorkerConfig
from services.worker.server import start_worker
from services.worker.sim.engine import SimEngineConfig, SimulatedEngine
from services.worker.sim.model import SimWorkerConfig
from services.worker.sim.ranks import RankedSimEngine
from tests.support import eventually

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

WORKERS = 2
RANKS = 2
VOCAB = 1000
PREFIX = 640  # 20 blocks of 32


def rank_engine() -> SimulatedEngine:
    return SimulatedEngine(
        SimEngineConfig(
            worker=SimWorkerConfig(capacity_blocks=1024, block_size=32),
            model="sim",
            max_model_len=8192,
            vocab_size=VOCAB,
            speedup=50.0,
        ),
        hasher=functools.partial(block_hashes, cfg=HashConfig(block_size=32)),
    )


@pytest.fixture
async def cluster(etcd, request):
    name = f"dp{abs(hash(request.node.name)) % 10**6}"
    endpoints = tuple(etcd.endpoints)
    engines = [RankedSimEngine([rank_engine() for _ in range(RANKS)]) for _ in range(WORKERS)]
    workers = [
        await start_worker(
            WorkerConfig(
                worker_id=f"dp-{i}", cluster=name, etcd_endpoints=endpoints, drain_grace_s=1.0
            ),
            engine,
        )
        for i, engine in enumerate(engines)
    ]
    router = await start_router(
        RouterConfig(cluster=name, etcd_endpoints=endpoints, drain_grace_s=1.0)
    )
    try:
        yield router, workers, engines
    finally:
        await router.stop()
        for w in workers:
            await w.stop()


def targets() -> list[str]:
    return [f"dp-{w}#r{r}" for w in range(WORKERS) for r in range(RANKS)]


async def test_each_rank_is_a_target_and_turns_return_to_their_rank(cluster):
    router, workers, engines = cluster
    assert workers[0].record.data_parallel_size == RANKS  # registered in its etcd record
    await eventually(lambda: sorted(v.record.worker_id for v in router.workers.all()) == targets())
    assert [v.record.data_parallel_rank for v in router.workers.candidates("sim")] == [0, 1] * 2
    await eventually(lambda: not router.kv_sync.not_live([WorkerId(t) for t in targets()]), 5.0)
    rng = random.Random(7)
    sessions = 8
    history = {s: [rng.randrange(VOCAB) for _ in range(PREFIX)] for s in range(sessions)}
    served: dict[int, list[tuple[str, int]]] = {s: [] for s in range(sessions)}
    async with RouterClient(router.address) as client:
        models = await client.wait_for_models()
        assert models.models[0].workers == WORKERS  # workers, not ranks
        for _ in range(3):
            results = await asyncio.gather(
                *(
                    client.complete(
                        make_request(history[s] + [rng.randrange(VOCAB) for _ in range(40)],
                                     max_tokens=4, session_id=f"s{s}"),
                        timeout_s=60,
                    )
                    for s in range(sessions)
                )
            )  # fmt: skip
            for s, c in enumerate(results):
                served[s].append((c.usage.worker_id, c.usage.cached_prompt_tokens))
                history[s] += c.token_ids
            await asyncio.sleep(0.3)  # KV events reach the router
    for s, turns in served.items():
        home = turns[0][0]
        assert home in targets(), turns
        for target, cached in turns[1:]:
            assert target == home, (s, turns)  # precise per rank: back to the same rank
            assert cached >= PREFIX - 32, (s, turns)
    homes = {turns[0][0] for turns in served.values()}
    assert len(homes) == WORKERS * RANKS, f"8 cold sessions over 4 ranks, got {homes}"
    # The rank the router named ran the request: the session's blocks are in that rank's cache
    # and in no other rank's of the worker.
    for s, turns in served.items():
        wid, rank = split_target(turns[0][0])
        engine = engines[int(wid.rsplit("-", 1)[1])]
        hashes = block_hashes(history[s][:PREFIX], HashConfig(block_size=32))
        held = [e.worker.prefix_hit_blocks(hashes) for e in engine.ranks]
        assert held[rank] >= PREFIX // 32 - 1, (s, held)
        assert held[1 - rank] == 0, (s, held)
    # Per-rank index entries and loads, under the rank's target id.
    assert router.index.stats().workers == WORKERS * RANKS

    def rank_loads_seen() -> bool:  # each target's load stream is its rank's, not the sum
        for t in targets():
            wid, rank = split_target(t)
            view = router.workers.get(WorkerId(t))
            engine = engines[int(wid.rsplit("-", 1)[1])]
            want = engine.ranks[rank].load().prefix_cache_queried_tokens  # type: ignore[index]
            if view is None or want == 0 or view.load.prefix_cache_queried_tokens != want:
                return False
        return True

    await eventually(rank_loads_seen, 5.0)


async def test_rank_streams_and_bad_ranks_over_grpc(cluster):
    _, workers, engines = cluster
    w = workers[0]
    async with grpc.aio.insecure_channel(w.address) as channel:
        stub = worker_pb2_grpc.WorkerStub(channel)
        info = await stub.GetInfo(worker_pb2.GetInfoRequest(), timeout=5)
        assert info.data_parallel_size == RANKS
        req = worker_pb2.WorkerGenerateRequest(
            request_id="r1",
            prompt_token_ids=list(range(100)),
            sampling=common_pb2.SamplingParams(max_tokens=2),
            data_parallel_rank=1,
        )
        async for _ in stub.Generate(req, timeout=30):
            pass
        assert engines[0].ranks[1].load().prefix_cache_queried_tokens > 0
        assert engines[0].ranks[0].load().prefix_cache_queried_tokens == 0
        load = await anext(
            aiter(stub.WatchLoad(worker_pb2.WatchLoadRequest(data_parallel_rank=1), timeout=5))
        )
        assert load.worker_id == "dp-0#r1" and load.prefix_cache_queried_tokens > 0
        rank0 = await anext(
            aiter(stub.WatchLoad(worker_pb2.WatchLoadRequest(data_parallel_rank=0), timeout=5))
        )
        assert rank0.worker_id == "dp-0#r0" and rank0.prefix_cache_queried_tokens == 0
        batch = await anext(
            aiter(
                stub.WatchKvEvents(worker_pb2.WatchKvEventsRequest(data_parallel_rank=1), timeout=5)
            )
        )
        assert batch.snapshot and batch.worker_id == "dp-0#r1"
        assert len(batch.events[0].stored.block_hashes) == 3  # 100 tokens: 3 full blocks
        bad = worker_pb2.WorkerGenerateRequest()
        bad.CopyFrom(req)
        bad.request_id, bad.data_parallel_rank = "r2", RANKS
        with pytest.raises(grpc.aio.AioRpcError) as err:
            async for _ in stub.Generate(bad, timeout=10):
                pass
        assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert "data_parallel_rank is 2" in err.value.details()
        with pytest.raises(grpc.aio.AioRpcError) as err:
            async for _ in stub.WatchKvEvents(worker_pb2.WatchKvEventsRequest(), timeout=5):
                pass
        assert err.value.code() is grpc.StatusCode.FAILED_PRECONDITION


async def test_a_worker_that_leaves_takes_all_its_ranks(cluster):
    router, workers, _ = cluster
    await eventually(lambda: len(router.workers) == WORKERS * RANKS)
    await workers[1].stop()
    await eventually(lambda: sorted(v.record.worker_id for v in router.workers.all())
                     == ["dp-0#r0", "dp-0#r1"], 5.0)  # fmt: skip
