"""``Worker.GenerateMany``, the router's data path, on the real worker gRPC service serving the
simulated engine (a simulator, not an engine), through the router's own ``WorkerMux``: the same
outputs as one ``Generate`` per request, batched (fewer messages than outputs), aborts, deadlines,
refusals with their status and field, and a broken stream ending every request on it with
UNAVAILABLE, the next request opening a new one."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncIterator

import grpc
import pytest

from kvmesh.grpc_errors import FIELD_KEY
from kvmesh.kv.hashing import HashConfig, block_hashes
from kvmesh.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from services.router.mux import WorkerMux
from services.worker.config import WorkerConfig
from services.worker.server import RunningWorker, start_worker
from services.worker.sim.engine import SimEngineConfig, SimulatedEngine, fake_token_ids
from services.worker.sim.model import SimWorkerConfig

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

VOCAB = 1000


def engine(speedup: float = 20.0) -> SimulatedEngine:
    config = SimEngineConfig(
        worker=SimWorkerConfig(capacity_blocks=512, block_size=32),
        model="sim-tiny",
        max_model_len=4096,
        vocab_size=VOCAB,
        speedup=speedup,
    )
    return SimulatedEngine(
        config, hasher=functools.partial(block_hashes, cfg=HashConfig(block_size=32))
    )


@pytest.fixture
async def served() -> AsyncIterator[tuple[RunningWorker, worker_pb2_grpc.WorkerStub]]:
    worker = await start_worker(WorkerConfig(worker_id="mux-w", drain_grace_s=1.0), engine())
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


def prompt(i: int, n: int = 100) -> list[int]:
    return [(i * 31 + 7 * j) % VOCAB for j in range(n)]


async def collect(call) -> list[worker_pb2.WorkerGenerateResponse]:  # type: ignore[no-untyped-def]
    return [m async for m in call]


async def test_same_outputs_as_unary_generate_in_fewer_messages(served):
    _worker, stub = served
    n = 12
    unary = await asyncio.gather(
        *(collect(stub.Generate(request(f"u{i}", prompt(i), 16), timeout=30)) for i in range(n))
    )
    # The raw stream: count the messages the worker sends for n concurrent requests.
    up: asyncio.Queue[worker_pb2.WorkerStreamIn | None] = asyncio.Queue()

    async def ups() -> AsyncIterator[worker_pb2.WorkerStreamIn]:
        while (msg := await up.get()) is not None:
            yield msg

    call = stub.GenerateMany(ups(), timeout=30)
    for i in range(n):
        up.put_nowait(
            worker_pb2.WorkerStreamIn(call=i + 1, generate=request(f"m{i}", prompt(i), 16))
        )
    outputs: dict[str, list[worker_pb2.WorkerGenerateResponse]] = {}
    ends: dict[str, int] = {}
    batches = 0
    async for batch in call:
        batches += 1
        for out, number in zip(batch.outputs, batch.output_calls, strict=True):
            assert out.request_id == f"m{number - 1}"
            outputs.setdefault(out.request_id, []).append(out)
        for end in batch.ends:
            ends[f"m{end.call - 1}"] = end.code
        if len(ends) == n:
            up.put_nowait(None)
    assert ends == {f"m{i}": 0 for i in range(n)}
    for i, msgs in enumerate(unary):
        tokens = [t for m in outputs[f"m{i}"] for t in m.token_ids]
        # The simulator's tokens follow the request id; everything else matches the unary call.
        assert tokens == fake_token_ids(f"m{i}", 16, VOCAB)
        assert [t for m in msgs for t in m.token_ids] == fake_token_ids(f"u{i}", 16, VOCAB)
        mine, theirs = outputs[f"m{i}"][-1].finished, msgs[-1].finished
        assert mine.reason == theirs.reason
        assert mine.usage.prompt_tokens == theirs.usage.prompt_tokens == 100
        assert outputs[f"m{i}"][-1].finished.usage.completion_tokens == 16
    total_outputs = sum(len(v) for v in outputs.values())
    assert batches < total_outputs / 2, (batches, total_outputs)  # a step's outputs go together


async def test_router_mux_abort_deadline_refusal_and_reconnect(served):
    worker, stub = served
    mux = WorkerMux(stub, "mux-w")
    try:
        # Two requests on one stream: the router's view of each is the unary call's.
        a, b = (
            mux.generate(request("r1", prompt(1), 8), 30),
            mux.generate(request("r2", prompt(2), 8), 30),
        )
        got = await asyncio.gather(collect(a), collect(b))
        assert [t for m in got[0] for t in m.token_ids] == fake_token_ids("r1", 8, VOCAB)
        assert got[1][-1].HasField("finished") and await b.code() is grpc.StatusCode.OK
        assert b.cancel() is False  # ended: nothing to cancel

        # Abort mid-stream: the engine stops the request.
        long = mux.generate(request("r3", prompt(3), 3000), 30)
        first = await anext(long)
        assert first.token_ids and worker.servicer.in_flight == 1
        assert long.cancel() is True
        for _ in range(100):
            if worker.servicer.in_flight == 0:
                break
            await asyncio.sleep(0.05)
        assert worker.servicer.in_flight == 0

        # A retry of the same request id right after its abort, on the same stream, is served.
        again = mux.generate(request("r3", prompt(3), 5), 30)
        assert [t for m in await collect(again) for t in m.token_ids] == fake_token_ids(
            "r3", 5, VOCAB
        )

        # A deadline the request cannot meet ends it on the worker with DEADLINE_EXCEEDED.
        slow = mux.generate(request("r4", prompt(4), 3000), 0.3)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await collect(slow)
        assert err.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED

        # A refusal keeps its status, message and field, as the unary RPC's.
        bad = mux.generate(request("r5", [VOCAB + 5], 4), 30)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await collect(bad)
        assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert "vocab" in (err.value.details() or "").lower()
        unary = stub.Generate(request("r5u", [VOCAB + 5], 4), timeout=10)
        with pytest.raises(grpc.aio.AioRpcError) as uerr:
            await collect(unary)
        assert uerr.value.details() == err.value.details().replace("r5", "r5u")
        field = {k: v for k, v in err.value.trailing_metadata() or ()}.get(FIELD_KEY)
        assert field == {k: v for k, v in uerr.value.trailing_metadata() or ()}.get(FIELD_KEY)
        assert field == "input"

        # The worker goes away mid-stream: every request on the stream ends UNAVAILABLE.
        c1, c2 = (
            mux.generate(request("r6", prompt(6), 3000), 30),
            mux.generate(request("r7", prompt(7), 3000), 30),
        )
        await anext(c1)
        await worker._server.stop(None)  # the process dies: no drain, its RPCs are cut
        for c in (c1, c2):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await collect(c)
            assert err.value.code() is grpc.StatusCode.UNAVAILABLE
    finally:
        await mux.close()


async def test_a_new_stream_after_the_old_one_broke():
    first = await start_worker(WorkerConfig(worker_id="mux-x", drain_grace_s=0.5), engine())
    port = first.address.rsplit(":", 1)[1]
    channel = grpc.aio.insecure_channel(first.address)
    mux = WorkerMux(worker_pb2_grpc.WorkerStub(channel), "mux-x")
    second: RunningWorker | None = None
    try:
        assert len(await collect(mux.generate(request("s1", prompt(1), 4), 30))) >= 1
        await first._server.stop(None)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await collect(mux.generate(request("s2", prompt(2), 4), 30))
        assert err.value.code() is grpc.StatusCode.UNAVAILABLE
        second = await start_worker(
            WorkerConfig(worker_id="mux-x", port=int(port), drain_grace_s=0.5), engine()
        )
        for _ in range(50):  # the channel reconnects; then a request opens a fresh stream
            try:
                msgs = await collect(mux.generate(request("s3", prompt(3), 4), 30))
                break
            except grpc.aio.AioRpcError:
                await asyncio.sleep(0.1)
        assert [t for m in msgs for t in m.token_ids] == fake_token_ids("s3", 4, VOCAB)
    finally:
        await mux.close()
        await channel.close()
        await first.stop()
        if second is not None:
            await second.stop()
