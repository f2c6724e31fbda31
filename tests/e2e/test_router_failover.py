"""Router failover from the client on real vLLM workers (the tiny model; docs/failover.md):
two router processes on one etcd and the same two workers. A greedy request streams through
router A; A is SIGKILLed mid-stream; the client (kvmesh.client.RouterClient, given both
routers) resumes the request through router B with the tokens it has, and what it gets is
exactly the uninterrupted output. The time from the kill to the next token is measured. A
request sent while A is dead goes to B."""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvmesh.client import RouterClient, make_request
from kvmesh.launcher import Child, Mesh, MeshSpec, stop_child
from kvmesh.v1 import router_pb2

pytestmark = pytest.mark.e2e

MAX_TOKENS = 1200  # a few hundred tokens a second here: the stream lasts seconds
KILL_AFTER = 40
STEP_S = 60.0
TAKE_OVER_S = 1.0  # the target: the client has its next token within this after the kill


def prompt(seed: int, n: int = 300) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(5, 1000) for _ in range(n)]


@pytest.fixture(scope="module")
def two_routers(
    tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Mesh, Child]]:
    spec = MeshSpec(
        model_path=tiny_model,
        served_model_name="tiny",
        workers=2,
        max_model_len=2048,
        kv_cache_bytes=64 << 20,
        kvmanager_cpu_bytes=256 << 20,
        log_dir=tmp_path_factory.mktemp("router-failover"),
    )
    with Mesh(spec) as mesh:
        b = mesh.start_router("router-b")
        try:
            mesh.wait_ready(b, 60.0)
            yield mesh, b
        finally:
            stop_child(b, grace_s=15.0)


def greedy(p: list[int], request_id: str) -> router_pb2.GenerateRequest:
    return make_request(
        p, max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, request_id=request_id
    )


async def test_a_router_killed_mid_stream_the_client_finishes_through_the_other(
    two_routers: tuple[Mesh, Child],
):
    mesh, b = two_routers
    a_address, b_address = mesh.router_address, b.ready["address"]
    p = prompt(1500)
    async with RouterClient(b_address) as only_b:
        await only_b.wait_for_models()
        uninterrupted = await only_b.complete(greedy(p, "rf-uninterrupted"), timeout_s=STEP_S)
    assert len(uninterrupted.token_ids) == MAX_TOKENS

    async with RouterClient([a_address, b_address]) as client:
        chunks: list[router_pb2.GenerateResponse] = []
        stream = client.stream(greedy(p, "rf-resumed"), timeout_s=2 * STEP_S)
        while sum(len(c.token_ids) for c in chunks) < KILL_AFTER:
            chunks.append(await asyncio.wait_for(anext(stream), STEP_S))
        assert mesh.router is not None
        with contextlib.suppress(ProcessLookupError):
            os.killpg(mesh.router.proc.pid, signal.SIGKILL)
        killed = time.monotonic()
        take_over_s: float | None = None
        async for chunk in stream:
            if take_over_s is None and chunk.token_ids:
                take_over_s = time.monotonic() - killed
            chunks.append(chunk)
        await asyncio.to_thread(mesh.router.proc.wait, 10)
        print(f"router take-over: the next token {take_over_s!r} s after the SIGKILL")

        tokens = [t for c in chunks for t in c.token_ids]
        assert tokens == uninterrupted.token_ids  # no gap, no repeat, the same greedy output
        assert "".join(c.text for c in chunks) == uninterrupted.text
        final = chunks[-1].finished
        assert final.usage.resumes >= 1
        assert (final.usage.prompt_tokens, final.usage.completion_tokens) == (len(p), MAX_TOKENS)
        assert take_over_s is not None and take_over_s < TAKE_OVER_S, take_over_s

        # A is dead: the next request goes to B at once, and is served whole.
        c = await client.complete(greedy(p[:100], "rf-after"), timeout_s=STEP_S)
        assert (c.routers, c.failovers, len(c.token_ids)) == ([b_address], 0, MAX_TOKENS)

    # A client that still lists A first: the request fails over before its first token.
    async with RouterClient(f"{a_address},{b_address}") as fresh:
        c = await fresh.complete(greedy(p[:50], "rf-fresh"), timeout_s=STEP_S)
    assert (c.routers, c.failovers, c.resumed) == ([a_address, b_address], 1, 0)
    assert len(c.token_ids) == MAX_TOKENS
