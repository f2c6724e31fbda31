"""Mid-stream failover on simulated engines (services/worker/sim) behind the real worker gRPC
service, a real etcd and a real router: a worker process SIGKILLed while it streams a request's
tokens, and the client's stream going on on another worker, with no token missing or repeated
and the usage counted as if uninterrupted (docs/failover.md). The simulated output continues a
prompt that ends with the start of it, so "no gap, no repeat" is exactly the uninterrupted
output."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvmesh.client import RouterClient, make_request
from services.router.config import RouterConfig
from services.router.main import start_router
from services.worker.main import parse_args, simulated_engine
from services.worker.server import start_worker
from services.worker.sim.engine import SimEngineConfig, fake_token_ids

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

REPO = Path(__file__).resolve().parents[2]
PROMPT = [3, *range(10, 140)]  # 131 tokens: 8 full blocks of 16
VOCAB = SimEngineConfig().vocab_size  # what `kvmesh worker --engine simulated` runs
MAX_TOKENS = 120  # ~60 ms a token at --sim-speedup 0.1: the stream lasts ~7 s


def worker_argv(cluster: str, endpoints: str, worker_id: str) -> list[str]:
    return [
        "--engine", "simulated", "--sim-speedup", "0.1", "--served-model-name", "sim",
        "--worker-id", worker_id, "--cluster", cluster, "--etcd", endpoints,
        "--metrics-port", "-1", "--drain-grace-s", "1",
    ]  # fmt: skip


async def until(predicate: Callable[[], object], timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)


def counter(url: str, name: str) -> float:
    with urllib.request.urlopen(url, timeout=5) as resp:
        text = resp.read().decode()
    return sum(
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == name
    )


@pytest.fixture
async def mesh(etcd):
    """A router and one simulated worker in a process of its own (``victim``, to SIGKILL); the
    test starts the worker that takes over (in-process) once the victim streams."""
    cluster = f"resume{os.getpid()}{abs(hash(time.monotonic())) % 10**5}"
    endpoints = ",".join(etcd.endpoints)
    router = await start_router(
        RouterConfig(
            cluster=cluster,
            etcd_endpoints=tuple(etcd.endpoints),
            policy="precise-prefix",
            drain_grace_s=1.0,
            metrics_refresh_s=0.1,
            http_port=-1,
        )
    )
    victim = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "services.worker.main",
        *worker_argv(cluster, endpoints, "victim"),
        stdout=asyncio.subprocess.PIPE,
        cwd=REPO,
    )
    started = []

    async def start_other() -> None:
        config = parse_args(worker_argv(cluster, endpoints, "other"))
        started.append(await start_worker(config, simulated_engine(config)))
        await until(lambda: len(router.workers.candidates("sim")) == 2)

    try:
        assert victim.stdout is not None
        line = (await asyncio.wait_for(victim.stdout.readline(), 60)).decode()
        assert line.startswith("KVMESH_WORKER_READY"), line
        async with RouterClient(router.address) as client:
            await client.wait_for_models()
            yield router, client, victim, start_other
    finally:
        if victim.returncode is None:
            victim.kill()
        await victim.wait()
        await router.stop()
        for w in started:
            await w.stop()


async def test_a_worker_killed_mid_stream_is_resumed_elsewhere(mesh):
    router, client, victim, start_other = mesh
    request = make_request(PROMPT, max_tokens=MAX_TOKENS, ignore_eos=True, request_id="kill-1")
    chunks = []
    stream = aiter(client.stream(request, timeout_s=60))
    while sum(len(c.token_ids) for c in chunks) < 10:
        chunks.append(await anext(stream))
    await start_other()  # meanwhile the victim streams on
    victim.send_signal(signal.SIGKILL)
    async for chunk in stream:
        chunks.append(chunk)

    tokens = [t for c in chunks for t in c.token_ids]
    assert tokens == fake_token_ids("kill-1", MAX_TOKENS, VOCAB)  # no gap, no repeat
    assert "".join(c.text for c in chunks) == "".join(f" t{t}" for t in tokens)
    final = chunks[-1].finished
    assert final.reason == 2  # FINISH_REASON_LENGTH: max_tokens, counted over both workers
    u = final.usage
    assert u.worker_id == "other"
    assert (u.prompt_tokens, u.completion_tokens) == (len(PROMPT), MAX_TOKENS)
    assert u.resumes == 1
    # The new worker prefilled the prompt and the replayed tokens: simulated workers share no
    # KV (no kvmanager here), so it found none of them cached.
    replayed = sum(1 for c in chunks if c.token_ids)  # at least one token per chunk
    assert len(PROMPT) + 10 <= u.resume_recomputed_tokens < len(PROMPT) + MAX_TOKENS, replayed
    assert router.metrics_server is not None
    url = router.metrics_server.url
    assert await asyncio.to_thread(counter, url, "kvmesh_router_resumes_total") == 1
    recomputed = await asyncio.to_thread(
        counter, url, "kvmesh_router_resume_recomputed_tokens_total"
    )
    assert recomputed == u.resume_recomputed_tokens


async def test_with_no_worker_to_resume_on_the_client_gets_a_retryable_unavailable(mesh):
    _router, client, victim, _start_other = mesh
    request = make_request(PROMPT, max_tokens=MAX_TOKENS, ignore_eos=True, request_id="kill-2")
    got = 0
    with pytest.raises(grpc.aio.AioRpcError) as info:
        async for chunk in client.stream(request, timeout_s=60):
            got += len(chunk.token_ids)
            if got >= 5 and victim.returncode is None:
                victim.send_signal(signal.SIGKILL)  # no other worker to resume on
    assert info.value.code() is grpc.StatusCode.UNAVAILABLE
    details = info.value.details() or ""
    assert "worker victim failed after" in details and "retry the request" in details
    assert "no other serving worker to try" in details
