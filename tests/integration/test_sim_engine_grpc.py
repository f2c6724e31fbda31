"""The real worker gRPC service (start_worker: WorkerServicer, health, reflection) serving a
SimulatedEngine, unchanged: streaming, cached tokens, Abort, client cancel, load and info, and
KV events (with vLLM's block hashes) through WatchKvEvents."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncIterator

import grpc
import pytest

from kvmesh.kv.hashing import HashConfig, block_hashes
from kvmesh.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from services.worker.config import WorkerConfig
from services.worker.server import RunningWorker, start_worker
from services.worker.sim.engine import SimEngineConfig, SimulatedEngine, fake_token_ids
from services.worker.sim.model import SimWorkerConfig

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

VOCAB = 1000
CONFIG = SimEngineConfig(
    worker=SimWorkerConfig(capacity_blocks=512, block_size=32),
    model="sim-tiny",
    max_model_len=4096,
    vocab_size=VOCAB,
    speedup=20.0,
)


@pytest.fixture(scope="module")
async def served() -> AsyncIterator[tuple[RunningWorker, worker_pb2_grpc.WorkerStub]]:
    hasher = functools.partial(block_hashes, cfg=HashConfig(block_size=32))
    engine = SimulatedEngine(CONFIG, hasher=hasher)
    worker = await start_worker(WorkerConfig(worker_id="sim-worker", drain_grace_s=2.0), engine)
    channel = grpc.aio.insecure_channel(worker.address)
    try:
        yield worker, worker_pb2_grpc.WorkerStub(channel)
    finally:
        await channel.close()
        await worker.stop()


def request(rid: str, prompt: list[int], max_tokens: int) -> worker_pb2.WorkerGenerateRequest:
    return worker_pb2.WorkerGenerateRequest(
        request_id=rid,
        prompt_token_ids=prompt,
        sampling=common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0),
    )


async def test_generate_streams_and_second_call_hits_the_cache(served):
    _worker, stub = served
    prompt = [(7 * i) % VOCAB for i in range(200)]
    msgs = [m async for m in stub.Generate(request("g1", prompt, 12), timeout=30)]
    tokens = [t for m in msgs for t in m.token_ids]
    assert tokens == fake_token_ids("g1", 12, VOCAB)
    usage = msgs[-1].finished.usage
    assert msgs[-1].finished.reason == common_pb2.FINISH_REASON_LENGTH
    assert (usage.prompt_tokens, usage.completion_tokens, usage.cached_prompt_tokens) == (
        200,
        12,
        0,
    )
    assert usage.worker_id == "sim-worker" and usage.time_to_first_token_s > 0
    again = [m async for m in stub.Generate(request("g2", prompt, 3), timeout=30)]
    assert again[-1].finished.usage.cached_prompt_tokens == 192  # 6 full blocks of 32


async def test_abort_rpc_and_client_cancel_reach_the_simulator(served):
    worker, stub = served
    call = stub.Generate(request("a1", [1, 2, 3], 4000), timeout=30)
    first = await call.read()
    assert first.token_ids
    await stub.Abort(common_pb2.AbortRequest(request_id="a1"), timeout=5)
    last = first
    while not last.HasField("finished"):
        last = await call.read()
    assert last.finished.reason == common_pb2.FINISH_REASON_ABORT

    engine = worker.engine
    call = stub.Generate(request("c1", [4, 5, 6], 4000), timeout=30)
    await call.read()
    assert engine.worker.is_active("c1")
    call.cancel()
    for _ in range(200):
        if not engine.worker.is_active("c1") and worker.servicer.in_flight == 0:
            break
        await asyncio.sleep(0.01)
    assert not engine.worker.is_active("c1") and not engine.is_running("c1")


async def test_validation_load_and_info(served):
    _worker, stub = served
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.Generate(request("v1", [VOCAB + 5], 2), timeout=5).read()
    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    info = await stub.GetInfo(worker_pb2.GetInfoRequest(), timeout=5)
    assert (info.model, info.block_size, info.max_model_len, info.vocab_size) == (
        "sim-tiny",
        32,
        4096,
        VOCAB,
    )
    call = stub.Generate(request("l1", list(range(300)), 3000), timeout=30)
    await call.read()
    load = await stub.GetLoad(worker_pb2.GetLoadRequest(), timeout=5)
    assert load.running_requests == 1 and load.in_flight_requests == 1
    assert 0 < load.kv_cache_usage <= 1
    call.cancel()


async def test_kv_events_reach_watch_kv_events_with_vllm_hashes(served):
    _worker, stub = served
    watch = stub.WatchKvEvents(worker_pb2.WatchKvEventsRequest(), timeout=30)
    snapshot = await watch.read()
    assert snapshot.snapshot
    prompt = [(11 * i + 3) % VOCAB for i in range(130)]
    [m async for m in stub.Generate(request("k1", prompt, 2), timeout=30)]
    expected = block_hashes(prompt, HashConfig(block_size=32))
    stored: list[int] = []
    while len(stored) < len(expected):
        batch = await watch.read()
        for ev in batch.events:
            if ev.HasField("stored"):
                stored += ev.stored.block_hashes
    assert stored[-len(expected) :] == expected  # 4 full blocks; the 2-token tail is not cached
    watch.cancel()
