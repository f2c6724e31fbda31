"""Mid-stream failover on simulated engines (services/worker/sim) behind the real worker gRPC
service, a real etcd and a real router: a worker process SIGKILLed while it streams a request's
tokens, and the client's stream going on on another worker, with no token missing or repeated
and the usage counted as if uninterrupted (docs/failover.md); with no worker left, or past
--max-resumes, a retryable UNAVAILABLE; a stop string that spans the seam ending the stream.
The simulated output continues a prompt that ends with the start of it, so "no gap, no repeat"
is exactly the uninterrupted output."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import os
import signal
import sys
import time
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client.parser import text_string_to_metric_families

from kvmesh import errors
from kvmesh.client import RouterClient, make_request
from kvmesh.kv.hashing import HashConfig, block_hashes
from kvmesh.v1 import common_pb2
from services.router.config import RouterConfig
from services.router.main import start_router
from services.worker.config import WorkerConfig
from services.worker.core import GenerateRequest, OutputDelta
from services.worker.main import parse_args, simulated_engine
from services.worker.server import start_worker
from services.worker.sim.engine import SimEngineConfig, SimulatedEngine, fake_token_ids
from services.worker.sim.model import SimWorkerConfig
from tests.support import eventually, span_exporter

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
        await eventually(lambda: len(router.workers.candidates("sim")) == 2, 15.0)

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

    async def read_and_kill() -> None:
        nonlocal got
        async for chunk in client.stream(request, timeout_s=60):
            got += len(chunk.token_ids)
            if got >= 5 and victim.returncode is None:
                victim.send_signal(signal.SIGKILL)  # no other worker to resume on

    with pytest.raises(grpc.aio.AioRpcError) as info:
        await read_and_kill()
    assert info.value.code() is grpc.StatusCode.UNAVAILABLE
    details = info.value.details() or ""
    assert "worker victim failed after" in details and "retry the request" in details
    assert "no other serving worker to try" in details


class DiesAfter(SimulatedEngine):
    """The simulator, dying (UNAVAILABLE) once it has streamed ``die_after`` tokens of a
    request, one token a message (0: it does not die)."""

    def __init__(self, die_after: int = 0) -> None:
        super().__init__(
            SimEngineConfig(
                worker=SimWorkerConfig(capacity_blocks=1024, block_size=16),
                model="sim",
                max_model_len=4096,
                vocab_size=1000,
                speedup=20.0,
            ),
            hasher=functools.partial(block_hashes, cfg=HashConfig(block_size=16)),
        )
        self.die_after = die_after
        self.seen: list[GenerateRequest] = []

    async def generate(self, request: GenerateRequest) -> AsyncIterator[OutputDelta]:
        self.seen.append(request)
        sent = 0
        async for delta in super().generate(request):
            for i, t in enumerate(delta.token_ids):
                last = i == len(delta.token_ids) - 1
                yield dataclasses.replace(
                    delta,
                    token_ids=(t,),
                    text=f" t{t}",
                    finish=delta.finish if last else None,
                )
                sent += 1
                if sent == self.die_after:
                    raise errors.Unavailable("simulated worker died mid-stream")


@pytest.fixture(scope="module")
def spans() -> InMemorySpanExporter:
    """An in-memory exporter on the process's tracer provider (set once per process)."""
    return span_exporter("kvmesh-resume-test")


@pytest.fixture
async def pair(etcd, spans, request):
    """A router and two in-process simulated workers, each dying at its 6th token of a request
    (the resumed attempt of a request ends before its 6th)."""
    cluster = f"seam{os.getpid()}{abs(hash(time.monotonic())) % 10**5}"
    engines = {"w1": DiesAfter(die_after=6), "w2": DiesAfter(die_after=6)}
    workers = [
        await start_worker(
            WorkerConfig(
                worker_id=wid,
                cluster=cluster,
                etcd_endpoints=tuple(etcd.endpoints),
                drain_grace_s=1.0,
            ),
            engine,
        )
        for wid, engine in engines.items()
    ]
    router = await start_router(
        RouterConfig(
            cluster=cluster,
            etcd_endpoints=tuple(etcd.endpoints),
            drain_grace_s=1.0,
            metrics_port=-1,
            http_port=-1,
            max_resumes=getattr(request, "param", 2),
        )
    )
    try:
        async with RouterClient(router.address) as client:
            await eventually(lambda: len(router.workers.candidates("sim")) == 2, 15.0)
            yield client, engines, spans
    finally:
        await router.stop()
        for w in workers:
            await w.stop()


async def test_a_stop_string_across_the_seam_ends_the_resumed_stream(pair):
    client, engines, spans = pair
    out = fake_token_ids("seam-1", 12, 1000)
    # " t<6th> t<7th>": the dying worker's last token, then the resumed worker's first
    stop = f" t{out[5]} t{out[6]}"
    request = make_request(PROMPT, max_tokens=12, ignore_eos=True, request_id="seam-1", stop=[stop])
    chunks = [chunk async for chunk in client.stream(request, timeout_s=30)]
    assert all(e.seen for e in engines.values())  # the first picked died, the other resumed
    final = chunks[-1].finished
    assert final.reason == common_pb2.FINISH_REASON_STOP
    assert final.stop_reason == stop
    tokens = [t for c in chunks for t in c.token_ids]
    assert tokens == out[:7]  # the resumed worker's first token completed the stop string
    # the text up to the seam was sent before the stop string could be seen; nothing after
    assert "".join(c.text for c in chunks) == "".join(f" t{t}" for t in out[:6])
    assert (final.usage.resumes, final.usage.completion_tokens) == (1, 7)
    # The request's span says it was resumed, from which worker, after how many tokens.
    (span,) = [
        s
        for s in spans.get_finished_spans()
        if s.attributes is not None
        and s.attributes.get("request_id") == "seam-1"
        and any(e.name == "resume" for e in s.events)
    ]
    (event,) = [e for e in span.events if e.name == "resume"]
    assert event.attributes is not None
    failed = event.attributes["failed_worker_id"]
    assert failed in engines and failed != final.usage.worker_id
    assert (event.attributes["resume"], event.attributes["replayed_tokens"]) == (1, 6)
    assert event.attributes["max_tokens_left"] == 6
    assert span.attributes is not None and span.attributes["resumes"] == 1


@pytest.mark.parametrize("pair", [1], indirect=True, ids=["max-resumes-1"])
async def test_past_max_resumes_the_stream_ends_with_a_retryable_error(pair):
    client, _engines, _spans = pair
    request = make_request(PROMPT, max_tokens=30, ignore_eos=True, request_id="twice")
    got: list[int] = []

    async def read() -> None:
        async for chunk in client.stream(request, timeout_s=30):
            got.extend(chunk.token_ids)

    with pytest.raises(grpc.aio.AioRpcError) as info:
        await read()
    assert got == fake_token_ids("twice", 12, 1000)  # 6 from each, then it gave up
    assert info.value.code() is grpc.StatusCode.UNAVAILABLE
    details = info.value.details() or ""
    assert "failed after 12 streamed token(s)" in details and "retry the request" in details
    assert "resumed 1 time(s) already, --max-resumes 1" in details
