"""Router failover from the client (kvmesh/client.py; docs/failover.md): two real routers on
one etcd and a simulated worker behind the real worker gRPC service. Router A, a process of its
own, is SIGKILLed while it streams a request; the client resumes the request through router B
(``GenerateRequest.resume``: the tokens it has), and its stream is exactly the uninterrupted
output (the simulated output is keyed by the request id and goes on after replayed tokens). A
request sent while A is dead goes to B; a resume the request cannot take is INVALID_ARGUMENT."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from pathlib import Path

import grpc
import pytest

from kvmesh.client import RouterClient, make_request
from kvmesh.v1 import router_pb2
from services.router.config import RouterConfig
from services.router.main import start_router
from services.worker.main import parse_args, simulated_engine
from services.worker.server import start_worker
from services.worker.sim.engine import SimEngineConfig, fake_token_ids
from tests.support import eventually

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

REPO = Path(__file__).resolve().parents[2]
PROMPT = [3, *range(10, 140)]
VOCAB = SimEngineConfig().vocab_size
MAX_TOKENS = 120  # ~60 ms a token at --sim-speedup 0.1: the stream lasts ~7 s


@pytest.fixture
async def routers(etcd):
    """Router A (a process, to SIGKILL), router B (in-process), one simulated worker; the
    client knows both routers, A first."""
    cluster = f"cfail{os.getpid()}{abs(hash(time.monotonic())) % 10**5}"
    endpoints = ",".join(etcd.endpoints)
    argv = [
        "--engine", "simulated", "--sim-speedup", "0.1", "--served-model-name", "sim",
        "--worker-id", "w1", "--cluster", cluster, "--etcd", endpoints,
        "--metrics-port", "-1", "--drain-grace-s", "1",
    ]  # fmt: skip
    config = parse_args(argv)
    worker = await start_worker(config, simulated_engine(config))
    a = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "services.router.main",
        "--host", "127.0.0.1", "--port", "0", "--http-port", "-1", "--metrics-port", "-1",
        "--cluster", cluster, "--etcd", endpoints, "--router-id", "router-a",
        stdout=asyncio.subprocess.PIPE,
        cwd=REPO,
    )  # fmt: skip
    b = await start_router(
        RouterConfig(
            cluster=cluster,
            etcd_endpoints=tuple(etcd.endpoints),
            router_id="router-b",
            drain_grace_s=1.0,
            metrics_port=-1,
            http_port=-1,
        )
    )
    try:
        assert a.stdout is not None
        line = (await asyncio.wait_for(a.stdout.readline(), 60)).decode()
        assert line.startswith("KVMESH_ROUTER_READY"), line
        a_address = dict(p.split("=", 1) for p in line.split()[1:] if "=" in p)["address"]
        await eventually(lambda: len(b.workers.candidates("sim")) == 1, 15.0)
        async with RouterClient([a_address, b.address]) as client:
            models = await client.wait_for_models()
            assert models.models and models.models[0].workers == 1
            yield client, a, a_address, b.address
    finally:
        if a.returncode is None:
            a.kill()
        await a.wait()
        await b.stop()
        await worker.stop()


async def test_a_router_killed_mid_stream_the_client_resumes_through_the_other(routers):
    client, a, a_address, b_address = routers
    request = make_request(PROMPT, max_tokens=MAX_TOKENS, ignore_eos=True, request_id="rk-1")
    chunks: list[router_pb2.GenerateResponse] = []
    sent = time.monotonic()
    stats_stream = client.stream(request, timeout_s=60)
    first_s: float | None = None
    while sum(len(c.token_ids) for c in chunks) < 10:
        chunks.append(await anext(stats_stream))
        if first_s is None and chunks[-1].token_ids:
            first_s = time.monotonic() - sent
    a.send_signal(signal.SIGKILL)
    killed = time.monotonic()
    first_after: float | None = None
    async for chunk in stats_stream:
        if first_after is None and chunk.token_ids:
            first_after = time.monotonic() - killed
        chunks.append(chunk)

    tokens = [t for c in chunks for t in c.token_ids]
    assert tokens == fake_token_ids("rk-1", MAX_TOKENS, VOCAB)  # no gap, no repeat
    assert "".join(c.text for c in chunks) == "".join(f" t{t}" for t in tokens)
    assert {c.request_id for c in chunks} == {"rk-1"}
    final = chunks[-1].finished
    assert final.reason == 2  # FINISH_REASON_LENGTH over both routers
    u = final.usage
    assert (u.prompt_tokens, u.completion_tokens, u.resumes) == (len(PROMPT), MAX_TOKENS, 1)
    # the time to first token is the client's own, from the attempt through A (gone)
    assert first_s is not None and 0 < u.time_to_first_token_s <= first_s, (u, first_s)
    assert first_after is not None and first_after < 1.0, first_after
    print(f"take-over: first token {first_after * 1000:.0f} ms after the SIGKILL")

    # A is dead: a new request goes to B (the client put it first) and is served whole.
    c = await client.complete(
        make_request(PROMPT, max_tokens=8, ignore_eos=True, request_id="rk-2"), timeout_s=30
    )
    assert c.token_ids == fake_token_ids("rk-2", 8, VOCAB)
    assert c.routers == [b_address] and c.failovers == 0
    # A fresh client that lists the dead router first fails over before the first token.
    async with RouterClient(f"{a_address},{b_address}") as fresh:
        c = await fresh.complete(
            make_request(PROMPT, max_tokens=8, ignore_eos=True, request_id="rk-3"), timeout_s=30
        )
    assert c.token_ids == fake_token_ids("rk-3", 8, VOCAB)
    assert (c.routers, c.failovers, c.resumed) == ([a_address, b_address], 1, 0)


async def test_a_resume_past_max_tokens_or_of_a_structured_output_is_invalid(routers):
    _client, _a, _a_address, b_address = routers
    async with RouterClient(b_address) as b:
        request = make_request(PROMPT, max_tokens=4, ignore_eos=True)
        request.resume.token_ids.extend([1, 2, 3, 4, 5])
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await b.complete(request, timeout_s=10)
        assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert "resume.token_ids has 5 tokens but sampling.max_tokens is 4" in (
            info.value.details() or ""
        )
        structured = make_request(PROMPT, max_tokens=8)
        structured.sampling.structured_output.json_schema = '{"type": "object"}'
        structured.resume.token_ids.append(1)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await b.complete(structured, timeout_s=10)
        assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert "cannot be resumed" in (info.value.details() or "")
        # Every token was received, only the final message lost: the answer ends at once.
        done = make_request(PROMPT, max_tokens=3, ignore_eos=True, request_id="rk-4")
        done.resume.token_ids.extend(fake_token_ids("rk-4", 3, VOCAB))
        c = await b.complete(done, timeout_s=10)
        assert (c.token_ids, c.finish_reason) == ([], "FINISH_REASON_LENGTH")
        assert c.usage is not None and c.usage.completion_tokens == 3
