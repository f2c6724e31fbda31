"""Precise prefix-cache routing on real vLLM workers: conversations with long distinct prefixes
come back to the worker that holds them (its KV events told the router), round-robin does not;
the router's index survives a router restart (snapshot) and a worker restart (new epoch).

The module runs on a mesh of its own (the session mesh's spec; its router uses the default
profile, precise-sticky): it restarts the router and a worker, which no other module should
see, and it finds the mesh as it started whatever ran before. Its conversations are distinct
(one seed range per test), so no test finds another's blocks cached.
"""

from __future__ import annotations

import asyncio
import random
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvmesh.client import Completion, RouterClient, make_request
from kvmesh.launcher import Mesh

from .conftest import mesh_spec

pytestmark = pytest.mark.e2e

PREFIX_TOKENS = 640  # 20 blocks of 32
THINK_S = 0.6  # time between turns: the worker's KV events reach the router meanwhile


@pytest.fixture(scope="module")
def mesh(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    """This module's own mesh (overrides the session one here)."""
    with Mesh(mesh_spec(tiny_model, tmp_path_factory.mktemp("prefix-mesh"))) as m:
        yield m


class Conversation:
    def __init__(self, seed: int) -> None:
        rng = random.Random(seed)
        self.session = f"conv-{seed}"
        self.tokens = [rng.randrange(5, 1000) for _ in range(PREFIX_TOKENS)]
        self._rng = rng
        self.turns: list[Completion] = []

    def next_prompt(self) -> list[int]:
        self.tokens += [self._rng.randrange(5, 1000) for _ in range(40)]  # the user's new message
        return list(self.tokens)

    def record(self, c: Completion) -> None:
        self.turns.append(c)
        self.tokens += c.token_ids  # the assistant's answer joins the history


async def run_turns(client: RouterClient, convs: list[Conversation], turns: int) -> None:
    for _ in range(turns):
        for conv in convs:
            req = make_request(
                conv.next_prompt(), max_tokens=8, temperature=0.0, session_id=conv.session
            )
            conv.record(await client.complete(req, timeout_s=60))
        await asyncio.sleep(THINK_S)


def follow_ups_on_holder(convs: list[Conversation], start: int = 1) -> tuple[int, int]:
    """(turns that went to the worker of the previous turn with the history cached, turns)."""
    good = total = 0
    for conv in convs:
        for prev, cur in zip(conv.turns[start - 1 :], conv.turns[start:], strict=False):
            total += 1
            u = cur.usage
            assert u is not None and prev.usage is not None
            if u.worker_id == prev.usage.worker_id and u.cached_prompt_tokens >= PREFIX_TOKENS:
                good += 1
    return good, total


async def test_precise_routing_returns_every_turn_to_its_cache(mesh: Mesh):
    convs = [Conversation(seed) for seed in range(4)]
    async with RouterClient(mesh.router_address) as client:
        await run_turns(client, convs, turns=3)
    good, total = follow_ups_on_holder(convs)
    assert (good, total) == (8, 8), [
        (c.session, [(t.usage.worker_id, t.usage.cached_prompt_tokens) for t in c.turns])
        for c in convs
    ]


async def test_round_robin_does_not(mesh: Mesh):
    rr = mesh.start_router("router-rr", extra_args=("--policy", "round-robin"))
    try:
        mesh.wait_ready(rr, 60)
        convs = [Conversation(seed) for seed in range(10, 13)]  # 3 conversations: odd on purpose
        async with RouterClient(rr.ready["address"]) as client:
            await client.wait_for_models()
            await run_turns(client, convs, turns=3)
        good, total = follow_ups_on_holder(convs)
        assert total == 6 and good < total, "round-robin alternates workers and misses caches"
        # A turn sent to the other worker misses that engine's cache but not the node's: the
        # kvmanager holds what the first worker computed, and the second one loads it.
        moved = [
            cur.usage
            for conv in convs
            for prev, cur in zip(conv.turns, conv.turns[1:], strict=False)
            if cur.usage.worker_id != prev.usage.worker_id
        ]
        assert moved and all(u.cached_prompt_tokens >= PREFIX_TOKENS for u in moved), moved
    finally:
        from kvmesh.launcher import stop_child

        stop_child(rr, grace_s=10)


async def test_router_restart_rebuilds_the_index_from_snapshots(mesh: Mesh):
    convs = [Conversation(seed) for seed in range(20, 24)]
    async with RouterClient(mesh.router_address) as client:
        await run_turns(client, convs, turns=1)
    mark = router_log_size(mesh)
    await asyncio.to_thread(mesh.restart_router)
    # The new router subscribes to each worker's KV events and applies its snapshot.
    await wait_kv_live(mesh, [w.name for w in mesh.workers], since=mark)
    async with RouterClient(mesh.router_address) as client:
        await run_turns(client, convs, turns=2)  # every request must succeed
    good, total = follow_ups_on_holder(convs)
    assert (good, total) == (8, 8), "turns after the restart still find their caches"


async def test_worker_restart_drops_its_stale_entries(mesh: Mesh):
    restarted = mesh.workers[1].name
    convs: list[Conversation] = []
    async with RouterClient(mesh.router_address) as client:
        # Cold first turns go to either worker (ties break at random): start conversations until
        # at least one lives on the worker we restart and one elsewhere.
        for seed in range(30, 50):
            conv = Conversation(seed)
            await run_turns(client, [conv], turns=1)
            convs.append(conv)
            homes = {c.turns[0].usage.worker_id for c in convs}
            if len(convs) >= 3 and restarted in homes and len(homes) == 2:
                break
    mark = router_log_size(mesh)
    await asyncio.to_thread(mesh.restart_worker, 1)
    await wait_kv_live(mesh, [restarted], since=mark)  # the new engine's epoch, from a snapshot
    async with RouterClient(mesh.router_address) as client:
        await client.wait_for_models()
        await run_turns(client, convs, turns=2)
    predicted = predicted_cached_blocks(mesh)
    predicted_gpu = predicted_cached_blocks(mesh, gpu_only=True)
    moved = 0
    for conv in convs:
        before, after, again = conv.turns
        if before.usage.worker_id == restarted:
            moved += 1
            # The router must not believe the restarted engine still holds this history in its
            # own memory (those entries went with the old epoch) ...
            assert predicted_gpu[after.request_id] == 0
            # ... but it knows the node's kvmanager does (the worker's lower tier), and indeed
            # the history is not recomputed: the new engine loads it from the kvmanager.
            assert predicted[after.request_id] * 32 >= PREFIX_TOKENS
            assert after.usage.cached_prompt_tokens >= PREFIX_TOKENS
        # Whatever happened, the next turn finds the history where the last one left it.
        assert again.usage.worker_id == after.usage.worker_id
        assert again.usage.cached_prompt_tokens >= PREFIX_TOKENS
        assert predicted[again.request_id] * 32 >= PREFIX_TOKENS
    assert moved, "some conversation must have lived on the restarted worker"


def router_log_size(mesh: Mesh) -> int:
    assert mesh.router is not None
    return mesh.router.log_path.stat().st_size


async def wait_kv_live(mesh: Mesh, workers: list[str], since: int, timeout_s: float = 60.0) -> None:
    """Until the router logs that each worker's KV event stream is live (snapshot applied)."""
    assert mesh.router is not None
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        with mesh.router.log_path.open("rb") as f:
            f.seek(since)
            text = f.read().decode(errors="replace")
        if all(f"KV events of {w} live" in text for w in workers):
            return
        assert loop.time() < deadline, f"KV events of {workers} not live in {timeout_s} s"
        await asyncio.sleep(0.2)


def predicted_cached_blocks(mesh: Mesh, gpu_only: bool = False) -> dict[str, int]:
    """Request id -> the cached prefix (blocks) the router's index predicted on any tier (or
    in the engine's own memory only), from its log."""
    assert mesh.router is not None
    pattern = re.compile(
        r"request (\S+) -> worker \S+ .* predicted_cached_blocks=(-?\d+) of \d+ \(gpu (-?\d+)\)"
    )
    out = {}
    for line in mesh.router.log_path.read_text(errors="replace").splitlines():
        m = pattern.search(line)
        if m:
            out[m.group(1)] = int(m.group(3 if gpu_only else 2))
    return out
