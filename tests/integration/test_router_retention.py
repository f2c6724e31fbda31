"""Session retention through the router: a real etcd, a real kvmanager on node-a and simulated
workers (the fixture of test_router_kvmanager_tiers.py). A session's turn ends with the router
pinning the turn's chain (prompt and output, vLLM-exact hashes) on the serving worker's node
kvmanager; the next turn of the session is judged a hit; a kvmanager gone costs the request
nothing."""

from __future__ import annotations

import time

import pytest

from kvmesh.client import RouterClient, make_request
from kvmesh.kv.hashing import HashConfig, block_hashes
from services.kvmanager.core.plan import BlockId
from services.kvmanager.core.retention import SessionKey
from services.router.core.sessions import retained_ids
from tests.integration.test_router_kvmanager_tiers import (
    BLOCK,
    BLOCK_BYTES,
    KEY,
    PROMPT,
    Mesh,
    mesh,  # noqa: F401 (the fixture)
    put_prompt_blocks,
)
from tests.support import eventually

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


def sample(m: Mesh, name: str, **labels: str) -> float:
    got = m.router.metrics.registry.get_sample_value(name, {"model": "sim", **labels})
    return got or 0.0


async def test_a_session_turn_pins_its_chain_on_the_node_kvmanager(mesh: Mesh):  # noqa: F811
    await put_prompt_blocks(mesh.kvm)  # what a node-a worker's connector saved
    await eventually(lambda: (m := mesh.match().get("a1")) is not None and m.blocks == 20, 15.0)
    key = SessionKey("", "agent-1")
    retention = mesh.kvm.store.retention
    async with RouterClient(mesh.router.address) as client:
        await client.wait_for_models()
        prompt = [*PROMPT, 7, 8, 9]
        done = await client.complete(
            make_request(prompt, max_tokens=2 * BLOCK, ignore_eos=True, session_id="agent-1")
        )
        assert done.usage.worker_id in ("a1", "a2")
        await eventually(lambda: len(retention.blocks_of(key)) > 0, 10.0)
        ids = retained_ids(prompt, list(done.token_ids))
        want = block_hashes(ids, HashConfig(block_size=BLOCK))
        assert len(want) == len(ids) // BLOCK > 20  # prompt and output blocks
        # The node's budget (a quarter of its 64-block disk tier) keeps the leading 16.
        fit = retention.budget_bytes // BLOCK_BYTES
        assert fit == 16
        assert retention.blocks_of(key) == tuple(BlockId(KEY, h) for h in want[:fit])
        assert sample(mesh, "kvmesh_router_retention_pins_total", outcome="ok") == 1

        # The next turn extends the previous one: the session's prefix is found (a hit). Its
        # arrival cued the node to bring the retained blocks to RAM (there already: a no-op),
        # and it asks for a shorter retention (an Anthropic cache_control ttl: "5m").
        nxt = [*ids, done.token_ids[-1], 4, 5, 6]
        second = make_request(nxt, max_tokens=4, session_id="agent-1")
        second.retention_ttl_s = 300.0
        await client.complete(second)
        await eventually(
            lambda: sample(mesh, "kvmesh_router_retention_pins_total", outcome="ok") == 2, 10.0
        )
        assert sample(mesh, "kvmesh_router_retention_turns_total", outcome="hit") == 1
        assert sample(mesh, "kvmesh_router_retention_turns_total", outcome="miss") == 0
        assert mesh.kvm.store.stats.retention_kept == 1
        expiry = retention.next_expiry_s()
        assert expiry is not None and 290.0 < expiry - time.monotonic() <= 300.0
        await eventually(
            lambda: sample(mesh, "kvmesh_router_retention_prefetches_total", outcome="ok") == 1,
            10.0,
        )
        assert mesh.kvm.store.stats.prefetch_requests == 1
        promoted = mesh.kvm.store.stats.prefetch_blocks  # those the node had put on disk
        assert sample(mesh, "kvmesh_router_retention_prefetched_blocks_total") == promoted

        # A request without a session pins nothing.
        await client.complete(make_request([*PROMPT, 1], max_tokens=2))
        assert len(retention) == 1

        # Its last turn ends the session: its retention is released on the node.
        last = make_request(nxt, max_tokens=2, session_id="agent-1")
        last.end_session = True
        await client.complete(last)
        await eventually(lambda: len(retention) == 0, 10.0)
        await eventually(  # the router counts it once the kvmanager's answer is back
            lambda: sample(mesh, "kvmesh_router_retention_pins_total", outcome="released") == 1,
            10.0,
        )

        # The kvmanager gone: the session's turns are served all the same.
        await mesh.stop_kvm()
        again = await client.complete(make_request(nxt, max_tokens=2, session_id="agent-1"))
        assert again.usage.completion_tokens == 2
        await eventually(
            lambda: (
                sample(mesh, "kvmesh_router_retention_pins_total", outcome="failed")
                + sample(mesh, "kvmesh_router_retention_pins_total", outcome="no_kvmanager")
                == 1
            ),
            10.0,
        )
