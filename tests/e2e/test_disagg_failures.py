"""Prefill/decode disaggregation on real vLLM workers (the tiny model), with each failure of
docs/disaggregation.md's table injected into real processes. One mesh serves the whole module
(etcd, the node's kvmanager, one prefill and two decode workers, a router); the cases run in
file order, each leaving the mesh a little more broken:

1. a decode worker is dead (SIGKILL) but still registered (its etcd lease is long) and the
   router picks it (session affinity): the other decode worker serves the request, with the
   same hand-off;
2. the node's kvmanager hangs (SIGSTOP) during a disaggregated request: the prefill succeeds,
   its KV never reaches the decode worker, which recomputes (bounded waits) -> vLLM's own
   output, no client error;
3. the kvmanager is dead (SIGKILL) but still registered: the same; restarted on its port,
   hand-offs work again;
4. every decode worker dies mid-stream: with no decode worker to resume on (a decode worker
   dying beside a live one is resumed there: test_resume.py, test_disagg_sim.py), the gRPC
   client gets UNAVAILABLE saying it may retry, the OpenAI HTTP client an SSE error event, both
   within seconds.

The expected outputs come from vLLM's own engine, run once beside the mesh's start-up
(reference_engine.py), not from the mesh under test."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvmesh.client import RouterClient, make_request
from kvmesh.launcher import Child, Mesh, MeshSpec, child_env
from kvmesh.v1 import router_pb2, worker_pb2, worker_pb2_grpc

pytestmark = pytest.mark.e2e

BLOCK = 32
MAX_MODEL_LEN = 4096
PROMPT_TOKENS = 700
HANDED_OVER = (PROMPT_TOKENS - 1) // BLOCK * BLOCK  # every full block but the last token's
MAX_TOKENS = 12  # of the requests compared with the reference
# Tokens of the long streams (prompt + this <= MAX_MODEL_LEN): the tiny model streams a few
# hundred tokens a second here, so they last seconds.
LONG_STREAM = 3000
STEP_S = 60.0  # deadline of any one step; a request that hangs fails the test, not the run


def prompt(seed: int, n: int = PROMPT_TOKENS) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(5, 1000) for _ in range(n)]


DEAD_DECODE = prompt(901)
HUNG_KVM = prompt(902)
DEAD_KVM = prompt(903)
COMPARED = [DEAD_DECODE, HUNG_KVM, DEAD_KVM]


# ---- the reference and the mesh ---------------------------------------------------------------
@dataclass
class Reference:
    """vLLM's own greedy output for COMPARED, computed in a child process started before the
    mesh (so the two start up side by side)."""

    proc: subprocess.Popen[str]
    out: Path
    log: Path
    _got: dict[tuple[int, ...], list[int]] = field(default_factory=dict)

    async def of(self, p: Sequence[int]) -> list[int]:
        if not self._got:
            rc = await asyncio.to_thread(self.proc.wait, 300)
            line = next(
                (ln for ln in self.out.read_text().splitlines() if ln.startswith("REFERENCE ")),
                None,
            )
            assert rc == 0 and line is not None, f"reference engine failed; see {self.log}"
            outs = json.loads(line.removeprefix("REFERENCE "))
            self._got = {tuple(q): o for q, o in zip(COMPARED, outs, strict=True)}
        return self._got[tuple(p)]


@pytest.fixture(scope="module")
def reference(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Reference]:
    d = tmp_path_factory.mktemp("pd-failures-reference")
    script = Path(__file__).with_name("reference_engine.py")
    args = [sys.executable, str(script), str(tiny_model), str(MAX_MODEL_LEN), str(MAX_TOKENS)]
    with open(d / "stdout", "w") as out, open(d / "stderr", "w") as err:
        proc = subprocess.Popen(
            args,
            stdin=subprocess.PIPE,
            stdout=out,
            stderr=err,
            text=True,
            env={**os.environ, **child_env()},
        )
    assert proc.stdin is not None
    proc.stdin.write(json.dumps(COMPARED))
    proc.stdin.close()
    try:
        yield Reference(proc, d / "stdout", d / "stderr")
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def pd_mesh(
    tiny_model: Path, tmp_path_factory: pytest.TempPathFactory, reference: Reference
) -> Iterator[Mesh]:
    spec = MeshSpec(
        model_path=tiny_model,
        served_model_name="tiny",
        workers=0,
        prefill_workers=1,
        decode_workers=2,
        max_model_len=MAX_MODEL_LEN,
        kv_cache_bytes=64 << 20,
        kvmanager_cpu_bytes=256 << 20,
        # A fixed port, so the kvmanager restarts where the workers' connectors look for it.
        kvmanager_args=("--port", str(free_port())),
        # A killed worker stays registered for a minute: the router still picks it.
        worker_args=("--etcd-ttl-s", "60"),
        router_args=("--policy", "precise-sticky", "--disagg-threshold-tokens", "256"),
        log_dir=tmp_path_factory.mktemp("pd-failures"),
    )
    with Mesh(spec) as m:
        try:
            yield m
        finally:
            if m.kvmanager is not None:  # never leave it stopped: the mesh could not stop it
                signal_group(m.kvmanager, signal.SIGCONT)


# ---- failure injection and observation --------------------------------------------------------
def signal_group(child: Child, sig: signal.Signals) -> None:
    """To the child's whole process group (a worker's vLLM engine core runs in it too)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(child.proc.pid, sig)


def kill(child: Child) -> None:
    signal_group(child, signal.SIGKILL)
    child.proc.wait(10)


@contextlib.contextmanager
def stopped(child: Child) -> Iterator[None]:
    """The child hangs (SIGSTOP) inside the block: alive, connected, answering nothing."""
    signal_group(child, signal.SIGSTOP)
    try:
        yield
    finally:
        signal_group(child, signal.SIGCONT)


def decode_workers(mesh: Mesh) -> list[Child]:
    return [w for w in mesh.workers if w.name.startswith("decode-") and w.proc.poll() is None]


async def in_flight(worker: Child) -> int:
    async with grpc.aio.insecure_channel(worker.ready["address"]) as ch:
        load = await worker_pb2_grpc.WorkerStub(ch).GetLoad(worker_pb2.GetLoadRequest(), timeout=5)
    return int(load.in_flight_requests)


def _metric(url: str, name: str, labels: dict[str, str]) -> float:
    with urllib.request.urlopen(url, timeout=5) as resp:
        text = resp.read().decode()
    return sum(
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    )


async def metric(mesh: Mesh, name: str, **labels: str) -> float:
    """A sum over the router's samples of ``name`` with these labels."""
    assert mesh.router is not None
    return await asyncio.to_thread(_metric, mesh.router.ready["metrics"], name, labels)


async def disagg_counts(mesh: Mesh) -> tuple[float, float]:
    """(requests disaggregated, disaggregated requests that fell back to aggregated)."""
    return (
        await metric(mesh, "kvmesh_router_disagg_decisions_total", reason="disaggregated"),
        await metric(mesh, "kvmesh_router_disagg_fallbacks_total"),
    )


async def complete(
    client: RouterClient, p: Sequence[int], max_tokens: int = MAX_TOKENS, session: str = ""
) -> Any:
    req = make_request(p, max_tokens=max_tokens, temperature=0.0, session_id=session)
    return await asyncio.wait_for(client.complete(req, STEP_S), STEP_S + 5)


@dataclass
class Stream:
    """A long greedy stream read in the background; ``going`` is set once tokens flow."""

    tokens: int = 0
    going: asyncio.Event = field(default_factory=asyncio.Event)
    error: Any = None  # the gRPC error, or the SSE error event's ``error`` object
    http_status: int = 0
    ended_at: float = 0.0

    def saw(self, n: int) -> None:
        self.tokens += n
        if self.tokens >= 4:
            self.going.set()


async def grpc_stream(client: RouterClient, p: Sequence[int], s: Stream) -> None:
    req = make_request(p, max_tokens=LONG_STREAM, temperature=0.0, ignore_eos=True)
    try:
        chunks: AsyncIterator[router_pb2.GenerateResponse] = client.stream(req, 2 * STEP_S)
        async for chunk in chunks:
            s.saw(len(chunk.token_ids))
    except grpc.aio.AioRpcError as exc:
        s.error = exc
    finally:
        s.ended_at = time.monotonic()


async def http_stream(base_url: str, p: Sequence[int], s: Stream) -> None:
    """The OpenAI completions endpoint, streaming; reads the server-sent events as they come."""
    body = {
        "model": "tiny",
        "prompt": list(p),
        "max_tokens": LONG_STREAM,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    timeout = aiohttp.ClientTimeout(total=2 * STEP_S)
    try:
        async with (
            aiohttp.ClientSession(timeout=timeout) as session,
            session.post(f"{base_url}/completions", json=body) as resp,
        ):
            s.http_status = resp.status
            async for raw in resp.content:
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line.removeprefix("data: "))
                if "error" in event:
                    s.error = event["error"]
                elif event["choices"] and event["choices"][0]["text"]:
                    s.saw(1)
    finally:
        s.ended_at = time.monotonic()


async def first_serving(workers: Sequence[Child]) -> list[Child]:
    """The workers with a request in flight (polls until one has)."""
    deadline = time.monotonic() + STEP_S
    while True:
        busy = [w for w in workers if await in_flight(w) > 0]
        if busy or time.monotonic() > deadline:
            return busy
        await asyncio.sleep(0.05)


# ---- the cases, least destructive first ----------------------------------------------------------
async def test_a_dead_decode_worker_is_passed_over_before_the_first_token(
    pd_mesh: Mesh, reference: Reference
):
    expected = await reference.of(DEAD_DECODE)
    decodes = decode_workers(pd_mesh)
    assert len(decodes) == 2
    retries = await metric(pd_mesh, "kvmesh_router_retries_total")
    async with RouterClient(pd_mesh.router_address) as client:
        await client.wait_for_models()
        # A session's worker gets the session's next request (the profile's session affinity).
        first = await complete(client, prompt(1, 40), max_tokens=2, session="s1")
        assert first.usage is not None
        (sticky,) = [w for w in decodes if w.name == first.usage.worker_id]
        (other,) = [w for w in decodes if w is not sticky]
        # Dead, but its lease holds it in etcd (and in the router) for a minute.
        kill(sticky)
        before = await disagg_counts(pd_mesh)
        c = await complete(client, DEAD_DECODE, session="s1")
    assert c.token_ids == expected
    assert c.usage is not None and c.usage.worker_id == other.name
    assert await metric(pd_mesh, "kvmesh_router_retries_total") == retries + 1, (
        f"the router did not try {sticky.name} first"
    )
    # The retry kept the hand-off: the other worker loaded the prefill worker's blocks.
    assert c.usage.cached_prompt_tokens == HANDED_OVER
    after = await disagg_counts(pd_mesh)
    assert (after[0] - before[0], after[1] - before[1]) == (1, 0)


async def test_a_hung_kvmanager_costs_the_handoff_not_the_request(
    pd_mesh: Mesh, reference: Reference
):
    assert pd_mesh.kvmanager is not None
    expected = await reference.of(HUNG_KVM)
    before = await disagg_counts(pd_mesh)
    async with RouterClient(pd_mesh.router_address) as client:
        await client.wait_for_models()
        started = time.monotonic()
        with stopped(pd_mesh.kvmanager):
            c = await complete(client, HUNG_KVM)
        took = time.monotonic() - started
    assert c.token_ids == expected, "the decode worker's recompute equals vLLM's own output"
    assert c.usage is not None and c.usage.worker_id.startswith("decode-")
    assert c.usage.cached_prompt_tokens == 0, "nothing reached the decode worker"
    # The router saw nothing wrong: the prefill succeeded, only the transfer failed.
    after = await disagg_counts(pd_mesh)
    assert (after[0] - before[0], after[1] - before[1]) == (1, 0)
    # Bounded: the connectors' lookups (0.5 s) and the hand-off wait (<= 2 s) time out.
    assert took < 20, f"took {took:.1f} s"


async def test_a_dead_kvmanager_costs_the_handoff_not_the_request(
    pd_mesh: Mesh, reference: Reference
):
    assert pd_mesh.kvmanager is not None
    expected = await reference.of(DEAD_KVM)
    before = await disagg_counts(pd_mesh)
    async with RouterClient(pd_mesh.router_address) as client:
        kill(pd_mesh.kvmanager)  # its lease (10 s) keeps it in etcd: the router still hands off
        c = await complete(client, DEAD_KVM)
        after = await disagg_counts(pd_mesh)
        assert c.token_ids == expected
        assert c.usage is not None and c.usage.cached_prompt_tokens == 0
        assert (after[0] - before[0], after[1] - before[1]) == (1, 0), "not a hand-off"
        # Back on its port, the workers' connectors and the router find it again: hand-offs
        # work (the new kvmanager's store is empty, so the first probes may be recomputed).
        pd_mesh.kvmanager = pd_mesh.start_kvmanager()
        pd_mesh.wait_ready(pd_mesh.kvmanager, 60.0)
        deadline = time.monotonic() + STEP_S
        for i in range(1000):
            probe = await complete(client, prompt(1000 + i), max_tokens=2)
            assert probe.usage is not None
            if probe.usage.cached_prompt_tokens == HANDED_OVER:
                break
            assert time.monotonic() < deadline, "no hand-off after the kvmanager restarted"
            await asyncio.sleep(0.5)


async def test_decode_workers_dying_mid_stream_is_a_retryable_error(pd_mesh: Mesh):
    decodes = decode_workers(pd_mesh)
    assert decodes
    on_grpc, on_http = Stream(), Stream()
    async with RouterClient(pd_mesh.router_address) as client:
        tasks = [
            asyncio.create_task(grpc_stream(client, prompt(1100), on_grpc)),
            asyncio.create_task(http_stream(pd_mesh.http_base_url, prompt(1101), on_http)),
        ]
        try:
            await asyncio.wait_for(
                asyncio.gather(on_grpc.going.wait(), on_http.going.wait()), STEP_S
            )
            serving = await first_serving(decodes)
            assert serving
            killed_at = time.monotonic()
            for w in decodes:  # all of them: no decode worker is left to resume on
                kill(w)
            await asyncio.wait_for(asyncio.gather(*tasks), 30)
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
    assert 4 <= on_grpc.tokens < LONG_STREAM and 4 <= on_http.tokens < LONG_STREAM
    err = on_grpc.error
    assert isinstance(err, grpc.aio.AioRpcError), "the gRPC stream ended without an error"
    assert err.code() is grpc.StatusCode.UNAVAILABLE, err
    assert "retry" in (err.details() or ""), err.details()
    # Headers were sent (200): the error is the last event, in the OpenAI error shape.
    assert on_http.http_status == 200
    assert on_http.error is not None, "the HTTP stream ended without an error event"
    assert on_http.error["code"] == "service_unavailable", on_http.error
    assert "retry" in on_http.error["message"], on_http.error
    # Bounded: a dead worker's connection closes; nothing waits for a deadline.
    for s in (on_grpc, on_http):
        assert s.ended_at - killed_at < 10, f"ended {s.ended_at - killed_at:.1f} s after the kill"
