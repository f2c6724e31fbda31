"""The worker over real gRPC on a real vLLM engine (tiny model, float32): streaming, greedy
equality with the engine itself, cancellation and deadlines reaching the engine, validation,
Abort, load, health, prefix caching, tracing, drain and etcd registration, and the process
entry point. One engine is shared by the module (its start dominates the runtime)."""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import signal
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from kvmesh.discovery.keys import Role, WorkerRecord, WorkerState, worker_key
from kvmesh.telemetry import setup_tracing
from kvmesh.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from services.worker.config import EngineConfig, WorkerConfig
from services.worker.main import VLLM_ENVIRONMENT

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

MAX_MODEL_LEN = 1024
VOCAB_SIZE = 1024  # the tiny model's
BLOCK_SIZE = 32
REPO = Path(__file__).resolve().parents[2]


@dataclass
class Harness:
    worker: object  # services.worker.server.RunningWorker
    engine: object  # services.worker.engine.VllmEngine
    stub: worker_pb2_grpc.WorkerStub
    channel: grpc.aio.Channel
    spans: InMemorySpanExporter
    config: WorkerConfig


def _span_exporter() -> InMemorySpanExporter:
    exporter = InMemorySpanExporter()
    provider = trace.get_tracer_provider()
    if isinstance(provider, TracerProvider):  # another module set one up already
        provider.add_span_processor(SimpleSpanProcessor(exporter))
    else:
        setup_tracing("kvmesh-worker-test", extra_processor=SimpleSpanProcessor(exporter))
    return exporter


@pytest.fixture(scope="module")
async def h(tiny_model: Path) -> AsyncIterator[Harness]:
    with pytest.MonkeyPatch.context() as mp:
        for key, value in VLLM_ENVIRONMENT.items():
            mp.setenv(key, os.environ.get(key, value))
        spans = _span_exporter()
        from services.worker.engine import VllmEngine
        from services.worker.server import start_worker
        from services.worker.traced import TracedEngine

        config = WorkerConfig(
            engine=EngineConfig(
                model=str(tiny_model),
                served_model_name="tiny",
                dtype="float32",
                max_model_len=MAX_MODEL_LEN,
                block_size=BLOCK_SIZE,
                kv_cache_bytes=64 << 20,
            ),
            worker_id="test-worker",
            drain_grace_s=5.0,
        )
        engine = await VllmEngine.start(config.engine)
        worker = await start_worker(config, TracedEngine(engine))
        channel = grpc.aio.insecure_channel(worker.address)
        try:
            yield Harness(
                worker, engine, worker_pb2_grpc.WorkerStub(channel), channel, spans, config
            )
        finally:
            await channel.close()
            await worker.stop()


def gen_request(
    rid: str, prompt: list[int], max_tokens: int = 16, **sampling: object
) -> worker_pb2.WorkerGenerateRequest:
    sampling.setdefault("temperature", 0.0)
    return worker_pb2.WorkerGenerateRequest(
        request_id=rid,
        prompt_token_ids=prompt,
        sampling=common_pb2.SamplingParams(max_tokens=max_tokens, **sampling),
    )


def prompt_of(n: int, salt: int) -> list[int]:
    """``n`` token ids unique to ``salt`` (no prefix shared with other tests' prompts)."""
    return [10 + (salt * 7919 + i * 31) % (VOCAB_SIZE - 10) for i in range(n)]


async def collect(stub, req, deadline_s=60.0) -> list[worker_pb2.WorkerGenerateResponse]:
    return [m async for m in stub.Generate(req, timeout=deadline_s)]


async def wait_idle(stub, timeout_s: float = 10.0) -> worker_pb2.WorkerLoad:
    """Polls GetLoad until the engine and the service report nothing running and no KV block
    in use (bounded). The engine's stats can lag the service's own count by a step."""
    deadline = time.monotonic() + timeout_s
    while True:
        load = await stub.GetLoad(worker_pb2.GetLoadRequest(), timeout=5)
        idle = load.running_requests == load.waiting_requests == load.in_flight_requests == 0
        idle = idle and load.kv_cache_usage == 0.0
        if idle or time.monotonic() > deadline:
            return load
        await asyncio.sleep(0.05)


# ---- health, info ---------------------------------------------------------------------------
async def test_health_serving(h: Harness) -> None:
    stub = health_pb2_grpc.HealthStub(h.channel)
    for service in ("", "kvmesh.v1.Worker"):
        resp = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
        assert resp.status == health_pb2.HealthCheckResponse.SERVING, service


async def test_get_info(h: Harness) -> None:
    info = await h.stub.GetInfo(worker_pb2.GetInfoRequest(), timeout=5)
    assert info.worker_id == "test-worker"
    assert info.model == "tiny"
    assert info.max_model_len == MAX_MODEL_LEN
    assert info.block_size == BLOCK_SIZE
    assert info.vocab_size == VOCAB_SIZE
    assert info.role == common_pb2.WORKER_ROLE_BOTH


# ---- generation -----------------------------------------------------------------------------
async def test_stream_arrives_before_the_last_token(h: Harness) -> None:
    max_tokens = 200
    req = gen_request("stream-1", prompt_of(40, 1), max_tokens, ignore_eos=True)
    started = time.monotonic()
    arrivals: list[tuple[float, worker_pb2.WorkerGenerateResponse]] = []
    async for msg in h.stub.Generate(req, timeout=60):
        arrivals.append((time.monotonic() - started, msg))
    first_t, first = arrivals[0]
    last_t, last = arrivals[-1]
    assert 0 < len(first.token_ids) < max_tokens
    assert not first.HasField("finished")
    assert len(arrivals) > 10
    assert first_t < last_t / 2, (first_t, last_t)
    assert sum(len(m.token_ids) for _, m in arrivals) == max_tokens
    assert all(not m.HasField("finished") for _, m in arrivals[:-1])
    fin = last.finished
    assert fin.reason == common_pb2.FINISH_REASON_LENGTH
    assert fin.usage.prompt_tokens == 40
    assert fin.usage.completion_tokens == max_tokens
    assert fin.usage.worker_id == "test-worker"
    assert 0 < fin.usage.time_to_first_token_s < last_t
    assert all(m.request_id == "stream-1" for _, m in arrivals)


async def test_greedy_output_equals_the_engines_own(h: Harness) -> None:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    prompt = prompt_of(50, 2)
    msgs = await collect(h.stub, gen_request("greedy-grpc", prompt, 24, ignore_eos=True))
    via_grpc = [t for m in msgs for t in m.token_ids]
    text_grpc = "".join(m.text for m in msgs)
    final = None
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    (engine_input,) = h.engine.llm.renderer.render_cmpl([TokensPrompt(prompt_token_ids=prompt)])
    async for out in h.engine.llm.generate(engine_input, params, "greedy-direct"):
        final = out
    assert final is not None
    assert via_grpc == list(final.outputs[0].token_ids)
    assert text_grpc == final.outputs[0].text


async def test_second_request_hits_the_prefix_cache(h: Harness) -> None:
    prompt = prompt_of(100, 3)
    before = await h.stub.GetLoad(worker_pb2.GetLoadRequest(), timeout=5)
    first = (await collect(h.stub, gen_request("prefix-1", prompt, 4)))[-1].finished.usage
    second = (await collect(h.stub, gen_request("prefix-2", prompt, 4)))[-1].finished.usage
    assert first.cached_prompt_tokens == 0
    assert second.cached_prompt_tokens == 96  # full 32-token blocks of the 100-token prompt
    after = await wait_idle(h.stub)
    assert after.prefix_cache_queried_tokens - before.prefix_cache_queried_tokens == 200
    assert after.prefix_cache_hit_tokens - before.prefix_cache_hit_tokens == 96
    # vLLM's decode timing over the wire: each request's tokens after its first, and their time
    decoded = sum(max(u.completion_tokens - 1, 0) for u in (first, second))
    assert after.decode_tokens - before.decode_tokens == decoded
    assert (after.decode_seconds > before.decode_seconds) == (decoded > 0)


async def test_stop_string_is_handled_by_the_engine(h: Harness) -> None:
    prompt = prompt_of(30, 4)
    msgs = await collect(h.stub, gen_request("stop-probe", prompt, 40, ignore_eos=True))
    text = "".join(m.text for m in msgs)
    stop = text[len(text) // 2 :][:3]
    assert stop.strip(), f"need printable text to pick a stop string from: {text!r}"
    msgs = await collect(h.stub, gen_request("stop-1", prompt, 40, stop=[stop], ignore_eos=True))
    fin = msgs[-1].finished
    assert fin.reason == common_pb2.FINISH_REASON_STOP
    assert fin.stop_reason == stop
    got = "".join(m.text for m in msgs)
    assert got == text[: text.index(stop)]


# ---- cancellation, deadlines, Abort ---------------------------------------------------------
async def test_client_cancel_aborts_in_the_engine(h: Harness) -> None:
    call = h.stub.Generate(gen_request("cancel-1", prompt_of(20, 5), 900, ignore_eos=True))
    seen = 0
    async for _ in call:
        seen += 1
        if seen == 3:
            break
    busy = await h.stub.GetLoad(worker_pb2.GetLoadRequest(), timeout=5)
    assert busy.running_requests == 1 and busy.in_flight_requests == 1
    call.cancel()
    load = await wait_idle(h.stub)
    assert (load.running_requests, load.waiting_requests, load.in_flight_requests) == (0, 0, 0)
    assert load.kv_cache_usage == 0.0
    assert h.engine.llm.get_num_unfinished_requests() == 0


async def test_deadline_exceeded_aborts_in_the_engine(h: Harness) -> None:
    req = gen_request("deadline-1", prompt_of(20, 6), 900, ignore_eos=True)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await collect(h.stub, req, deadline_s=0.5)
    assert err.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
    load = await wait_idle(h.stub)
    assert (load.running_requests, load.waiting_requests, load.in_flight_requests) == (0, 0, 0)
    assert h.engine.llm.get_num_unfinished_requests() == 0


async def test_abort_rpc_ends_the_stream_with_abort(h: Harness) -> None:
    call = h.stub.Generate(gen_request("abort-1", prompt_of(20, 7), 900, ignore_eos=True))
    msgs = []
    async for msg in call:
        msgs.append(msg)
        if len(msgs) == 2:
            await h.stub.Abort(common_pb2.AbortRequest(request_id="abort-1"), timeout=5)
    assert msgs[-1].finished.reason == common_pb2.FINISH_REASON_ABORT
    assert 0 < msgs[-1].finished.usage.completion_tokens < 900
    await wait_idle(h.stub)


async def test_abort_unknown_id_is_not_found(h: Harness) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await h.stub.Abort(common_pb2.AbortRequest(request_id="no-such-request"), timeout=5)
    assert err.value.code() is grpc.StatusCode.NOT_FOUND
    assert "no-such-request" in err.value.details()


async def test_duplicate_request_id_in_flight_is_invalid(
    h: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The retry waits duplicate_wait_s for the first copy to go; shortened here so the first
    # (900 tokens: ~2 s on a quiet machine, as long as the default wait) is surely still running.
    monkeypatch.setattr(h.worker.servicer, "_duplicate_wait_s", 0.3)  # type: ignore[attr-defined]
    call = h.stub.Generate(gen_request("dup-1", prompt_of(20, 8), 900, ignore_eos=True))
    await call.read()
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await collect(h.stub, gen_request("dup-1", prompt_of(20, 9), 4))
    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "already in flight" in err.value.details()
    call.cancel()
    await wait_idle(h.stub)


async def test_duplicate_request_id_waits_for_the_first_copy_to_go(h: Harness) -> None:
    """A failed-over client's retry that reaches the worker before the dead router's stream
    end did is admitted once the first copy is gone, not refused."""
    first = h.stub.Generate(gen_request("dup-2", prompt_of(20, 8), 900, ignore_eos=True))
    await first.read()
    retry = asyncio.create_task(collect(h.stub, gen_request("dup-2", prompt_of(20, 9), 4)))
    await asyncio.sleep(0.3)
    assert not retry.done()  # waiting, not refused
    first.cancel()
    msgs = await asyncio.wait_for(retry, 10)
    assert msgs[-1].finished.usage.completion_tokens == 4
    await wait_idle(h.stub)


# ---- validation -----------------------------------------------------------------------------
BAD_REQUESTS = [
    pytest.param(gen_request("bad", [], 4), "the prompt has no tokens", id="empty-prompt"),
    pytest.param(gen_request("bad", [5, VOCAB_SIZE], 4), f"token id {VOCAB_SIZE}", id="oov-token"),
    pytest.param(gen_request("bad", [5, 6], 0), "max_tokens must be > 0", id="max-tokens-0"),
    pytest.param(
        gen_request("bad", [5] * 1000, 100),
        f"prompt (1000 tokens) + max_tokens (100) = 1100 exceeds the model's context of "
        f"{MAX_MODEL_LEN} tokens",
        id="too-long",
    ),
    pytest.param(gen_request("bad", [5], 4, temperature=2.5), "temperature", id="temperature"),
    pytest.param(gen_request("bad", [5], 4, top_p=0.0), "top_p must be in (0, 1]", id="top-p"),
    pytest.param(gen_request("bad", [5], 4, top_k=-2), "top_k must be", id="top-k"),
    pytest.param(gen_request("", [5], 4), "request_id is empty", id="no-request-id"),
]


@pytest.mark.parametrize(("req", "message"), BAD_REQUESTS)
async def test_bad_requests_are_invalid_argument(h: Harness, req, message: str) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await collect(h.stub, req)
    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert message in err.value.details()


# ---- load -----------------------------------------------------------------------------------
async def test_get_load_stays_responsive_during_generation(h: Harness) -> None:
    latencies: list[float] = []
    done = asyncio.Event()

    async def poll() -> None:
        while not done.is_set():
            t = time.monotonic()
            await h.stub.GetLoad(worker_pb2.GetLoadRequest(), timeout=5)
            latencies.append(time.monotonic() - t)
            await asyncio.sleep(0.01)

    poller = asyncio.create_task(poll())
    try:
        await collect(h.stub, gen_request("busy-1", prompt_of(300, 10), 400, ignore_eos=True))
    finally:
        done.set()
        await poller
    latencies.sort()
    p50, worst = latencies[len(latencies) // 2], latencies[-1]
    print(f"GetLoad during generation: n={len(latencies)} p50={p50 * 1e3:.1f} ms "
          f"max={worst * 1e3:.1f} ms")  # fmt: skip
    assert len(latencies) >= 10
    assert p50 < 0.05


async def test_watch_load_pushes_changes(h: Harness) -> None:
    pushes: list[worker_pb2.WorkerLoad] = []
    watch = h.stub.WatchLoad(worker_pb2.WatchLoadRequest(min_interval_s=0.05))
    pushes.append(await watch.read())  # the current state, at once
    gen = asyncio.create_task(
        collect(h.stub, gen_request("watch-1", prompt_of(20, 11), 300, ignore_eos=True))
    )

    async def until(predicate) -> None:
        while not predicate(pushes[-1]):
            pushes.append(await watch.read())

    await asyncio.wait_for(until(lambda m: m.running_requests == 1), 10)
    assert pushes[-1].in_flight_requests == 1
    assert pushes[-1].worker_id == "test-worker"
    await gen
    await asyncio.wait_for(until(lambda m: m.running_requests == m.in_flight_requests == 0), 10)
    watch.cancel()
    assert all(a != b for a, b in itertools.pairwise(pushes))  # only changes


# ---- tracing --------------------------------------------------------------------------------
async def test_domain_spans(h: Harness) -> None:
    h.spans.clear()
    await collect(h.stub, gen_request("trace-1", prompt_of(40, 12), 8, ignore_eos=True))
    await asyncio.sleep(0.05)
    spans = {s.name: s for s in h.spans.get_finished_spans() if s.name.startswith("engine.")}
    assert set(spans) >= {"engine.generate", "engine.prefill", "engine.queue", "engine.decode"}
    top = spans["engine.generate"]
    assert top.attributes["request_id"] == "trace-1"
    assert top.attributes["prompt_tokens"] == 40
    assert top.attributes["completion_tokens"] == 8
    assert top.attributes["cached_tokens"] == 0
    pre, q, dec = spans["engine.prefill"], spans["engine.queue"], spans["engine.decode"]
    for child in (pre, dec):  # the two phases, laid end to end inside the request
        assert child.parent is not None and child.parent.span_id == top.context.span_id
        assert top.start_time <= child.start_time <= child.end_time <= top.end_time
    assert pre.start_time == top.start_time and pre.end_time == dec.start_time
    assert q.parent is not None and q.parent.span_id == pre.context.span_id
    assert pre.start_time == q.start_time <= q.end_time <= pre.end_time
    assert pre.attributes["prompt_tokens"] == 40 and pre.attributes["cached_tokens"] == 0
    assert dec.attributes["completion_tokens"] == 8
    assert dec.attributes["finish_reason"] == "length"
    server = [s for s in h.spans.get_finished_spans() if s.name.endswith("Worker/Generate")]
    assert server and top.parent is not None
    assert top.parent.span_id in {s.context.span_id for s in server}


async def test_drain_and_etcd_registration(h: Harness, etcd, etcd_client) -> None:
    """A second server on the same engine, registered in etcd: SIGTERM-style stop marks it
    draining, refuses new work, lets the in-flight request finish, then leaves etcd."""
    from services.worker.server import start_worker

    config = replace(
        h.config,
        worker_id="drain-worker",
        cluster="worker-test",
        etcd_endpoints=tuple(etcd.endpoints),
        drain_grace_s=20.0,
    )
    worker = await start_worker(config, h.worker.engine)
    key = worker_key("worker-test", Role.BOTH, "drain-worker")
    stored = await etcd_client.get(key.encode())
    rec = WorkerRecord.from_json(stored.value)
    assert rec.state is WorkerState.SERVING and rec.address == worker.address
    assert (rec.max_model_len, rec.block_size, rec.vocab_size) == (MAX_MODEL_LEN, 32, VOCAB_SIZE)

    async with grpc.aio.insecure_channel(worker.address) as channel:
        stub = worker_pb2_grpc.WorkerStub(channel)
        call = stub.Generate(gen_request("drain-1", prompt_of(20, 13), 150, ignore_eos=True))
        await call.read()
        stopping = asyncio.create_task(worker.stop(close_engine=False))
        deadline = time.monotonic() + 5
        while True:
            stored = await etcd_client.get(key.encode())
            if stored and WorkerRecord.from_json(stored.value).state is WorkerState.DRAINING:
                break
            assert time.monotonic() < deadline, "record never marked draining"
            await asyncio.sleep(0.02)
        health = health_pb2_grpc.HealthStub(channel)
        resp = await health.Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
        assert resp.status == health_pb2.HealthCheckResponse.NOT_SERVING
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await collect(stub, gen_request("drain-2", [5, 6], 2))
        assert err.value.code() is grpc.StatusCode.UNAVAILABLE
        assert "draining" in err.value.details()
        last = await call.read()
        while not last.HasField("finished"):
            last = await call.read()
        assert last.finished.reason == common_pb2.FINISH_REASON_LENGTH
        await asyncio.wait_for(stopping, 20)
    assert await etcd_client.get(key.encode()) is None


async def test_main_process_ready_line_and_sigterm(tiny_model: Path, etcd, etcd_client) -> None:
    """The entry point as a process: ready line on stdout, registered, SIGTERM exits 0."""
    cmd = [
        sys.executable, "-m", "services.worker.main",
        "--model", str(tiny_model), "--dtype", "float32", "--max-model-len", "512",
        "--kv-cache-bytes", "32MiB", "--worker-id", "proc-worker", "--cluster", "worker-proc",
        "--etcd", ",".join(etcd.endpoints), "--drain-grace-s", "5",
    ]  # fmt: skip
    proc = await asyncio.create_subprocess_exec(
        *cmd,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.DEVNULL,
        cwd=REPO,
        start_new_session=True,
    )
    try:
        assert proc.stdout is not None
        line = (await asyncio.wait_for(proc.stdout.readline(), 120)).decode()
        assert line.startswith("KVMESH_WORKER_READY "), line
        fields = dict(p.split("=", 1) for p in line.split()[1:])
        assert fields["worker_id"] == "proc-worker"
        key = worker_key("worker-proc", Role.BOTH, "proc-worker")
        stored = await etcd_client.get(key.encode())
        assert json.loads(stored.value)["address"] == fields["address"]
        async with grpc.aio.insecure_channel(fields["address"]) as channel:
            msgs = await collect(worker_pb2_grpc.WorkerStub(channel), gen_request("p-1", [5, 6], 3))
        assert msgs[-1].finished.usage.completion_tokens == 3
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 60) == 0
        assert await etcd_client.get(key.encode()) is None
    finally:
        if proc.returncode is None:  # the whole group: its engine core too (holds the pipe)
            os.killpg(proc.pid, signal.SIGKILL)
            await proc.wait()
