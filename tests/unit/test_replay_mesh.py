"""The replay's model of the mesh under the simulated workers (benchmarks/replay/mesh.py): node
tiers with LRU, where a routed request's blocks come from and what that costs, and the driver's
per-tier accounting with TTFT counted from the arrival."""

from __future__ import annotations

from dataclasses import replace

import pytest

from benchmarks.replay.driver import replay
from benchmarks.replay.mesh import Link, MeshConfig, NodeStore, apply_fetch, plan_fetch
from benchmarks.replay.policies import RoundRobin
from benchmarks.replay.traces import ReplayRequest
from kvmesh.kv.events import BlockHash, BlockRemoved, BlockStored, Tier

from .test_replay_driver import CFG, HAND

H = tuple(BlockHash(b) for b in range(100, 120))


def test_cpu_tier_demotes_least_recently_used_to_disk_then_drops():
    events: list = []
    s = NodeStore(cpu_blocks=3, disk_blocks=2, block_size=4, sink=events.extend)
    s.save(H[:3])
    s.touch(H[:1])  # H0 now most recent: H1 is the least recently used
    s.save(H[3:5])
    assert list(s.cpu) == [H[0], H[3], H[4]] and list(s.disk) == [H[1], H[2]]
    s.save(H[5:6])  # demotes H0; the disk tier drops H1
    assert list(s.disk) == [H[2], H[0]]
    assert BlockRemoved((H[1],), Tier.DISK) in events
    assert BlockStored((H[0],), None, Tier.DISK, 4) in events
    s.save(H[2:3])  # back from disk to cpu
    assert H[2] in s.cpu and H[2] not in s.disk
    assert s.run(H, 0, 10) == (0, 1)  # H0 on disk, H1 gone
    assert s.run(H, 2, 10) == (3, 1)  # H2, H4, H5 on cpu; H3 demoted to disk


@pytest.mark.parametrize(
    ("gpu", "peer_holds", "want"),
    [
        (0, 8, (4, 0, 4, 2)),  # local cpu 0..3, then peer node 2: 4..7
        (2, 8, (2, 0, 4, 2)),  # gpu 0..1, local cpu 2..3, peer 4..7
        (0, 6, (4, 0, 0, -1)),  # the peer's gain (2) is under the 4-block bar
        (4, 4, (0, 0, 0, -1)),  # nobody holds more than the engine
    ],
)
def test_plan_fetch_local_tiers_then_the_best_peer(gpu, peer_holds, want):
    cfg = MeshConfig(
        workers_per_node=1,
        cpu_blocks=100,
        cpu=Link(1.0, 0.5),
        peer=Link(2.0, 0.25),
        peer_min_gain_blocks=4,
    )
    stores = [NodeStore(100, 0, 1) for _ in range(3)]
    stores[0].save(H[:4])
    stores[2].save(H[:peer_holds])
    stores[1].save(H[:3])  # a worse peer
    plan = plan_fetch(cfg, stores, 0, H, gpu, 10, block_size=1)
    assert (plan.cpu_blocks, plan.disk_blocks, plan.peer_blocks, plan.peer_node) == want
    _, _, peer, _ = want
    # Before the engine sees it: the peer's leg beyond the CPU tier's (the node CPU tier ->
    # engine leg is the engine's load at admission, for cpu and peer blocks alike).
    want_s = 0.25 + (2.0 - 1.0) * peer if peer else 0.0
    assert plan.fetch_s == pytest.approx(want_s)
    apply_fetch(stores, 0, H, plan)
    assert stores[0].prefix(H, 10) == max(4, plan.blocks)  # peer blocks copied in


def test_replay_serves_from_a_peer_and_counts_the_fetch_in_ttft():
    mesh = MeshConfig(workers_per_node=1, cpu_blocks=64, peer=Link(1e-4), peer_min_gain_blocks=1)
    tiers: list = []
    rep = replay(
        HAND,
        RoundRobin(),
        workers=2,
        config=CFG,
        mesh=mesh,
        on_tier_events=lambda node, ev: tiers.append((node, ev)),
    )
    # GPU-only figures as without tiers: the third request hits worker 0's own cache.
    assert (rep.cached_tokens, rep.reusable_tokens, rep.reusable_captured_tokens) == (12, 24, 12)
    # The second request (worker 1) fetched its 3 blocks from node 0 instead of recomputing.
    assert rep.cached_all_tokens == 24 and rep.reusable_all_tokens == 24
    assert rep.capture_rate_all == 1.0 and rep.hit_rate_all == pytest.approx(24 / 52)
    assert dict(rep.tier_tokens) == {"gpu": 12, "cpu": 0, "disk": 0, "peer": 12}
    # TTFTs: 13 ms, 1.2 ms fetch + 1 ms, 5 ms, 9 ms.
    assert rep.ttft_mean_s == pytest.approx((0.013 + 0.0022 + 0.005 + 0.009) / 4)
    assert rep.nodes == 2 and {n for n, _ in tiers} == {0, 1}
    no_tiers = replay(HAND, RoundRobin(), workers=2, config=CFG)
    assert no_tiers.cached_all_tokens == no_tiers.cached_tokens == 12


def test_the_router_core_follows_the_node_stores_and_routes_with_precise_cost():
    from benchmarks.replay.router_policy import RouterPolicy

    mesh = MeshConfig(workers_per_node=1, cpu_blocks=64, peer=Link(1e-4), peer_min_gain_blocks=1)
    policy = RouterPolicy("precise-cost", 2, workers_per_node=1)
    rep = replay(
        HAND,
        policy,
        workers=2,
        config=CFG,
        mesh=mesh,
        on_kv_events=policy.on_kv_events,
        on_tier_events=policy.on_tier_events,
    )
    assert rep.requests == 4 and rep.capture_rate_all == 1.0
    stats = policy.index.stats()
    assert stats.stores == 2 and stats.links == 2
    held = [policy.index.view(sid).cpu_blocks for sid in policy.index.stores()]
    assert sum(held) >= 4  # blocks 1-4 written through to some node's CPU tier


def test_a_prefix_evicted_while_queued_is_loaded_from_the_node_at_admission():
    # One worker of 12 blocks. The last request finds its 3 blocks on the engine when it arrives,
    # but waits behind a big one whose admission evicts them: with the node's CPU tier under the
    # engine (written through), they are loaded from there when it is admitted, not recomputed.
    def r(t: float, blocks: tuple[int, ...], tokens: int, out: int = 1) -> ReplayRequest:
        return ReplayRequest(t, "", tuple(BlockHash(b) for b in blocks), tokens, out)

    cfg = replace(CFG, capacity_blocks=12, step_s=0.01)
    reqs = [
        r(0.0, (1, 2, 3), 13),
        r(0.1, (20, 21, 22), 13, 10),  # running while the next two arrive
        r(0.15, (30, 31, 32, 33, 34, 35), 25, 14),  # waits for room, then evicts 1-3
        r(0.2, (1, 2, 3, 4), 17),  # 1-3 on the engine now; queued behind the one above
    ]
    alone = replay(reqs, RoundRobin(), workers=1, config=cfg)
    assert (alone.reusable_tokens, alone.cached_tokens) == (12, 0)  # evicted: recomputed
    mesh = MeshConfig(workers_per_node=1, cpu_blocks=64)
    rep = replay(reqs, RoundRobin(), workers=1, config=cfg, mesh=mesh)
    assert (rep.reusable_all_tokens, rep.cached_all_tokens, rep.cached_tokens) == (12, 12, 0)
    assert dict(rep.tier_tokens) == {"gpu": 0, "cpu": 12, "disk": 0, "peer": 0}


def test_the_in_flight_term_fits_its_step_rates_to_the_simulated_engines_decode_timing(tmp_path):
    """precise-cost with ``in_flight: true`` over simulated workers that report their decode
    timing: its step-rate samples come from that timing, and the replay reports the rates its
    decisions used."""
    from benchmarks.replay.router_policy import RouterPolicy
    from services.router.core.scheduler.profile import BUILTIN_PROFILES

    text = BUILTIN_PROFILES["precise-cost"]
    text = text.replace("name: precise-cost", "name: cost-in-flight").replace(
        "  - type: ttft-cost\n    weight: 1.0\n",
        "  - type: ttft-cost\n    weight: 1.0\n    params: {in_flight: true}\n",
    )
    assert "in_flight: true" in text
    path = tmp_path / "cost-in-flight.yaml"
    path.write_text(text)
    cfg = replace(CFG, capacity_blocks=4096, step_s=1e-3, decode_s_per_seq=1e-4)
    stream = [
        ReplayRequest(0.05 * i, f"s{i % 6}", tuple(BlockHash(i % 6 * 100 + b) for b in range(8)),
                      33, 300)
        for i in range(80)
    ]  # fmt: skip
    policy = RouterPolicy(str(path), 4)
    rep = replay(stream, policy, workers=4, config=cfg, on_kv_events=policy.on_kv_events)
    assert rep.requests == 80
    rates = policy.step_rates()
    assert rates is not None and rates["decisions"] == 80
    assert rates["timed_samples"] > 0 and rates["samples"] == rates["timed_samples"]
    assert RouterPolicy("precise-cost", 2).step_rates() is None  # the term is off there
