"""The whole mesh on real parts: etcd, two vLLM workers on the tiny model, a router, all as
separate processes on loopback; the client speaks gRPC to the router like any other client."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from kvmesh.client import RouterClient, make_request
from kvmesh.launcher import Mesh, child_env
from kvmesh.v1 import common_pb2, router_pb2, worker_pb2, worker_pb2_grpc

from .conftest import MAX_MODEL_LEN

pytestmark = pytest.mark.e2e

PROMPTS = [
    list(range(5, 45)),  # 40 tokens
    [7, 300, 12, 999, 4, 18, 500, 250] * 9,  # 72 tokens (two full blocks + some)
    list(range(900, 1000, 3)),
]


async def worker_load(address: str) -> worker_pb2.WorkerLoad:
    async with grpc.aio.insecure_channel(address) as ch:
        return await worker_pb2_grpc.WorkerStub(ch).GetLoad(worker_pb2.GetLoadRequest(), timeout=5)


async def wait_idle(mesh: Mesh, timeout_s: float = 15.0) -> list[worker_pb2.WorkerLoad]:
    """Polls every worker until the engine runs nothing and the service holds nothing."""
    deadline = time.monotonic() + timeout_s
    while True:
        loads = [await worker_load(w.ready["address"]) for w in mesh.workers]
        if all(
            ld.running_requests == 0 and ld.waiting_requests == 0 and ld.in_flight_requests == 0
            for ld in loads
        ):
            return loads
        if time.monotonic() > deadline:
            pytest.fail(f"workers still busy after {timeout_s} s: {loads}")
        await asyncio.sleep(0.1)


async def test_list_models(mesh: Mesh):
    async with RouterClient(mesh.router_address) as client:
        resp = await client.wait_for_models()
    assert [(m.name, m.workers, m.max_model_len, m.block_size) for m in resp.models] == [
        ("tiny", 2, MAX_MODEL_LEN, 32)
    ]


async def test_greedy_output_equals_the_engines_own(mesh: Mesh, tiny_model: Path):
    max_tokens = 24
    ref = await asyncio.to_thread(
        subprocess.run,
        [
            sys.executable,
            str(Path(__file__).with_name("reference_engine.py")),
            str(tiny_model),
            str(MAX_MODEL_LEN),
            str(max_tokens),
        ],
        input=json.dumps(PROMPTS),
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **child_env()},
        check=True,
    )
    line = next(ln for ln in ref.stdout.splitlines() if ln.startswith("REFERENCE "))
    expected = json.loads(line.removeprefix("REFERENCE "))
    async with RouterClient(mesh.router_address) as client:
        got = []
        workers = set()
        for _ in range(2):  # twice: the second pass is served from the prefix cache
            for p in PROMPTS:
                c = await client.complete(
                    make_request(p, max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
                )
                got.append(c.token_ids)
                workers.add(c.usage.worker_id)
    assert got == expected + expected
    assert len(workers) == 2, "least-loaded routing should have used both workers"


async def test_streaming_streams(mesh: Mesh):
    async with RouterClient(mesh.router_address) as client:
        arrivals = []
        start = time.monotonic()
        async for chunk in client.stream(
            make_request(PROMPTS[0], max_tokens=64, temperature=0.0, ignore_eos=True)
        ):
            arrivals.append(
                (time.monotonic() - start, len(chunk.token_ids), chunk.HasField("finished"))
            )
    tokens = sum(n for _, n, _ in arrivals)
    assert tokens == 64
    assert arrivals[0][1] < 64, "the first chunk must not hold the whole answer"
    assert len([a for a in arrivals if a[1]]) > 4, "tokens should arrive in many chunks"
    assert arrivals[-1][2], "the last chunk carries finished"
    assert arrivals[0][0] < arrivals[-1][0]


async def test_usage_and_prefix_cache_hits(mesh: Mesh):
    prompt = [11, 12, 13, 14] * 40  # 160 tokens: five full blocks
    async with RouterClient(mesh.router_address) as client:
        first = await client.complete(make_request(prompt, max_tokens=4, temperature=0.0))
        # Send the repeat straight to the same worker's cache: the router may pick either worker,
        # so repeat until the same worker serves it (least-loaded alternates on ties).
        for _ in range(6):
            again = await client.complete(make_request(prompt, max_tokens=4, temperature=0.0))
            if again.usage.worker_id == first.usage.worker_id:
                break
    u = first.usage
    assert (u.prompt_tokens, u.completion_tokens) == (160, 4)
    assert u.worker_id in {w.name for w in mesh.workers}
    assert u.time_to_first_token_s > 0
    assert first.finish_reason == "FINISH_REASON_LENGTH"
    assert again.usage.worker_id == first.usage.worker_id
    assert again.usage.cached_prompt_tokens >= 128  # whole blocks only; the last token recomputes


async def test_text_and_chat_inputs(mesh: Mesh):
    async with RouterClient(mesh.router_address) as client:
        text = await client.complete(make_request("hello world, this is kvmesh", max_tokens=5))
        chat = await client.complete(
            make_request(
                [
                    {"role": "system", "content": "You are terse."},
                    {"role": "user", "content": "List the files."},
                    {"role": "assistant", "content": "Calling ls."},
                    {"role": "tool", "content": "a.py b.py", "tool_call_id": "call_1"},
                ],
                max_tokens=5,
            )
        )
    assert text.usage.prompt_tokens > 3 and len(text.token_ids) == text.usage.completion_tokens
    assert chat.usage.prompt_tokens > text.usage.prompt_tokens
    assert 1 <= len(chat.token_ids) == chat.usage.completion_tokens <= 5


async def test_client_cancel_aborts_in_the_engine(mesh: Mesh):
    async with RouterClient(mesh.router_address) as client:
        call = client.stream(make_request(PROMPTS[1], max_tokens=1500, ignore_eos=True))
        got = 0
        async for chunk in call:
            got += len(chunk.token_ids)
            if got >= 3:
                break
        call.cancel()  # type: ignore[attr-defined]
    loads = await wait_idle(mesh)
    assert all(ld.running_requests == 0 for ld in loads)


async def test_deadline_exceeded_aborts_in_the_engine(mesh: Mesh):
    async with RouterClient(mesh.router_address) as client:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await client.complete(
                make_request(PROMPTS[2], max_tokens=1500, ignore_eos=True), timeout_s=1.0
            )
    assert err.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
    await wait_idle(mesh)


async def test_abort_rpc(mesh: Mesh):
    async with RouterClient(mesh.router_address) as client:
        call = client.stream(
            make_request(PROMPTS[0], max_tokens=1500, ignore_eos=True, request_id="to-abort")
        )
        it = call.__aiter__()
        await it.__anext__()
        await client.stub.Abort(common_pb2.AbortRequest(request_id="to-abort"), timeout=5)
        last = None
        async for chunk in it:
            last = chunk
        assert last is not None and last.finished.reason == common_pb2.FINISH_REASON_ABORT
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await client.stub.Abort(common_pb2.AbortRequest(request_id="to-abort"), timeout=5)
        assert err.value.code() is grpc.StatusCode.NOT_FOUND
    await wait_idle(mesh)


BIG = "x" * (17 * 1024 * 1024)

BAD_INPUTS = [
    pytest.param(
        make_request("", max_tokens=4),
        grpc.StatusCode.INVALID_ARGUMENT,
        "text is empty",
        id="empty-text",
    ),
    pytest.param(
        make_request([], max_tokens=4),
        grpc.StatusCode.INVALID_ARGUMENT,
        "the prompt has no tokens",
        id="empty-token-ids",
    ),
    pytest.param(
        router_pb2.GenerateRequest(sampling=common_pb2.SamplingParams(max_tokens=4)),
        grpc.StatusCode.INVALID_ARGUMENT,
        "no input: set one of text, chat or token_ids",
        id="no-input",
    ),
    pytest.param(
        make_request([1] * MAX_MODEL_LEN, max_tokens=4),
        grpc.StatusCode.INVALID_ARGUMENT,
        "context is 2048 tokens",
        id="prompt-too-long",
    ),
    pytest.param(
        make_request([1] * 100, max_tokens=0),
        grpc.StatusCode.INVALID_ARGUMENT,
        "max_tokens must be > 0",
        id="max-tokens-0",
    ),
    pytest.param(
        make_request([1] * 100, max_tokens=MAX_MODEL_LEN),
        grpc.StatusCode.INVALID_ARGUMENT,
        "lower max_tokens",
        id="max-tokens-beyond-context",
    ),
    pytest.param(
        make_request([1] * 10, max_tokens=4, temperature=3.0),
        grpc.StatusCode.INVALID_ARGUMENT,
        "temperature must be in [0, 2]",
        id="temperature",
    ),
    pytest.param(
        make_request([1] * 10, max_tokens=4, top_p=0.0),
        grpc.StatusCode.INVALID_ARGUMENT,
        "top_p must be in (0, 1]",
        id="top-p",
    ),
    pytest.param(
        make_request([1, 5000], max_tokens=4),
        grpc.StatusCode.INVALID_ARGUMENT,
        "token id 5000 is outside",
        id="token-outside-vocab",
    ),
    pytest.param(
        make_request([1] * 10, max_tokens=4, model="gpt-9"),
        grpc.StatusCode.NOT_FOUND,
        "model 'gpt-9' is not served",
        id="unknown-model",
    ),
    pytest.param(
        make_request([{"role": "wizard", "content": "hi"}], max_tokens=4),
        grpc.StatusCode.INVALID_ARGUMENT,
        "role is 'wizard'",
        id="chat-bad-role",
    ),
    pytest.param(
        make_request([{"role": "tool", "content": "42"}], max_tokens=4),
        grpc.StatusCode.INVALID_ARGUMENT,
        "tool_call_id",
        id="chat-tool-without-id",
    ),
    pytest.param(
        make_request(BIG, max_tokens=4),
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        "",
        id="oversized-message",
    ),
]


@pytest.mark.parametrize(("request_", "code", "message"), BAD_INPUTS)
async def test_bad_input_gets_a_clear_error(
    mesh: Mesh, request_: router_pb2.GenerateRequest, code, message
):
    async with RouterClient(mesh.router_address) as client:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await client.complete(request_, timeout_s=30)
        assert err.value.code() is code, err.value.details()
        assert message in (err.value.details() or "")
        # ...and the mesh keeps serving.
        ok = await client.complete(make_request([3] * 8, max_tokens=2))
        assert ok.usage.completion_tokens == 2


async def test_health_and_reflection(mesh: Mesh):
    for address, service in [(mesh.router_address, "kvmesh.v1.Router")] + [
        (w.ready["address"], "kvmesh.v1.Worker") for w in mesh.workers
    ]:
        async with grpc.aio.insecure_channel(address) as ch:
            resp = await health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=5
            )
            assert resp.status == health_pb2.HealthCheckResponse.SERVING
            stream = reflection_pb2_grpc.ServerReflectionStub(ch).ServerReflectionInfo(
                iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5
            )
            services = [s.name async for r in stream for s in r.list_services_response.service]
            assert service in services and "grpc.health.v1.Health" in services


async def test_one_trace_across_router_and_worker(mesh: Mesh):
    trace_id = f"{0x6B766D657368:032x}"  # "kvmesh"
    metadata = (("traceparent", f"00-{trace_id}-00f067aa0ba902b7-01"),)
    async with RouterClient(mesh.router_address) as client:
        async for _ in client.stub.Generate(
            make_request([2] * 20, max_tokens=3), metadata=metadata, timeout=30
        ):
            pass
    deadline = time.monotonic() + 20  # the console exporter flushes in batches
    while True:
        router_spans = spans_with_trace(mesh.router.log_path, trace_id)
        worker_spans = [s for w in mesh.workers for s in spans_with_trace(w.log_path, trace_id)]
        names = {s["name"] for s in router_spans + worker_spans}
        if ({"tokenize", "route"} <= names and worker_spans) or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.5)
    assert {"tokenize", "route"} <= {s["name"] for s in router_spans}
    assert worker_spans, "the worker's spans must join the router's trace"
    span_ids = {s["context"]["span_id"] for s in router_spans}
    worker_server = [s for s in worker_spans if s.get("parent_id") in span_ids]
    assert worker_server, "a worker span must have a router span as its parent"


def spans_with_trace(log_path: Path, trace_id: str) -> list[dict]:
    """Console-exporter spans (pretty JSON objects) in a log file that belong to a trace."""
    text = log_path.read_text(errors="replace")
    spans, depth, start = [], 0, None
    for i, ch in enumerate(text):
        if ch == "{":
            if depth == 0:
                start = i
            depth += 1
        elif ch == "}" and depth:
            depth -= 1
            if depth == 0 and start is not None:
                try:
                    obj = json.loads(text[start : i + 1])
                except ValueError:
                    continue
                if (
                    isinstance(obj, dict)
                    and obj.get("context", {}).get("trace_id") == f"0x{trace_id}"
                ):
                    spans.append(obj)
    return spans


async def test_etcd_restart_while_serving(mesh: Mesh):
    assert mesh.etcd is not None
    async with RouterClient(mesh.router_address) as client:
        mesh.etcd.stop()
        try:
            during = await client.complete(make_request([4] * 30, max_tokens=3))
            assert during.usage.completion_tokens == 3, "the last known workers keep serving"
        finally:
            mesh.etcd.restart()
        await asyncio.sleep(1.0)
        after = await client.complete(make_request([4] * 30, max_tokens=3))
        assert after.usage.completion_tokens == 3
        models = await client.wait_for_models()
        assert models.models[0].workers == 2
