"""The disaggregation benchmark's pure parts: workloads, mesh setups (roles spread over nodes,
placements side by side), the hand-off transfer (free within a node), per-token clocks,
quantiles, metric parsing, and tiny end-to-end simulations (no timings)."""

from __future__ import annotations

import itertools
import math

import pytest

from benchmarks.disagg.cli import setups
from benchmarks.disagg.handoff import prefill_seconds_sum, summarize
from benchmarks.disagg.sim import MeshSetup, TokenClock, simulate, transfer_s, weighted_quantile
from benchmarks.disagg.workloads import ChatConfig, block_hashes, chat_requests
from benchmarks.replay.traces import ReplayRequest
from kvmesh.discovery.keys import Role


def test_chat_requests_are_seeded_ordered_and_share_the_system_prompt():
    cfg = ChatConfig(seed=3, requests=50, block_size=32, system_prompt_tokens=64)
    a, b = list(chat_requests(cfg)), list(chat_requests(cfg))
    assert a == b
    assert all(x.arrival_s <= y.arrival_s for x, y in itertools.pairwise(a))
    assert all(len(r.block_hashes) == r.input_tokens // 32 for r in a)
    assert len({r.block_hashes[:2] for r in a}) == 1  # the 2 system-prompt blocks
    assert len({r.block_hashes[2] for r in a if len(r.block_hashes) > 2}) > 1


@pytest.mark.parametrize(
    ("shared", "own", "equal_blocks"),
    [(64, 64, 2), (80, 64, 2), (0, 64, 0)],
    ids=["aligned", "shared-tail-not-a-full-block", "nothing-shared"],
)
def test_block_hashes_share_only_whole_shared_blocks(shared, own, equal_blocks):
    x, y = block_hashes(shared, own, 1, 32), block_hashes(shared, own, 2, 32)
    same = sum(1 for p, q in zip(x, y, strict=True) if p == q)
    assert same == equal_blocks


@pytest.mark.parametrize(
    ("mode", "roles", "enabled", "threshold"),
    [
        ("aggregated", [Role.BOTH] * 4, False, None),
        ("always", [Role.PREFILL, Role.DECODE, Role.DECODE, Role.DECODE], True, 1),
        ("selective", [Role.PREFILL, Role.DECODE, Role.DECODE, Role.DECODE], True, 500),
    ],
    ids=["aggregated", "always", "selective"],
)
def test_mesh_setups(mode, roles, enabled, threshold):
    s = MeshSetup(mode, workers=4, prefill_workers=1, threshold_tokens=500)
    assert s.roles() == roles
    c = s.disagg_config()
    assert c.enabled is enabled
    if threshold is not None:
        assert c.threshold_tokens == threshold


def test_setups_and_bad_setups():
    got = setups(8, 4, [1024, 4096], "precise-prefix")
    assert [(s.mode, s.threshold_tokens) for s in got][2:] == [
        ("selective", 1024),
        ("selective", 4096),
    ]
    assert [s.mode for s in got][:2] == ["aggregated", "always"]
    with pytest.raises(ValueError, match="unknown mode 'sometimes'"):
        MeshSetup("sometimes")
    with pytest.raises(ValueError, match="need 1 <= prefill_workers < workers"):
        MeshSetup("always", workers=4, prefill_workers=4)
    with pytest.raises(ValueError, match="unknown placement 'sideways'"):
        MeshSetup("always", placement="sideways")
    with pytest.raises(ValueError, match="workers_per_node must be >= 1"):
        MeshSetup("always", workers_per_node=0)


def test_setups_run_each_placement_side_by_side():
    got = setups(8, 4, [4096], "precise-prefix", ("independent", "joint"), 2)
    assert [s.label for s in got] == [
        "aggregated",
        "always independent",
        "always joint",
        "selective 4096 independent",
        "selective 4096 joint",
    ]
    joint = got[2].disagg_config()
    assert joint.placement.mode.value == "joint"
    assert got[1].disagg_config().placement.mode.value == "independent"


@pytest.mark.parametrize(
    ("workers", "prefill", "per_node", "roles", "nodes"),
    [
        (8, 4, 2, "PDPDPDPD", [0, 0, 1, 1, 2, 2, 3, 3]),
        (6, 2, 3, "PDDPDD", [0, 0, 0, 1, 1, 1]),
        (4, 1, 2, "PDDD", [0, 0, 1, 1]),
    ],
    ids=["one-each-per-node", "one-prefill-per-node-of-3", "fewer-prefill-than-nodes"],
)
def test_prefill_workers_spread_over_the_nodes(workers, prefill, per_node, roles, nodes):
    s = MeshSetup("always", workers, prefill, workers_per_node=per_node)
    assert "".join("P" if r is Role.PREFILL else "D" for r in s.roles()) == roles
    assert s.nodes() == nodes


@pytest.mark.parametrize(
    ("blocks", "bps", "want"),
    [(0, 1e9, 0.0), (10, math.inf, 0.0), (10, 32 * 100 * 10 / 2, 2.0)],
    ids=["none", "infinite", "ten-blocks"],
)
def test_transfer_seconds(blocks, bps, want):
    assert transfer_s(blocks, 32, 100, bps) == pytest.approx(want)


@pytest.mark.parametrize(
    ("pairs", "q", "want"),
    [
        ([], 0.5, 0.0),
        ([(1.0, 1), (2.0, 1)], 0.5, 1.0),
        ([(5.0, 1), (1.0, 99)], 0.99, 1.0),
        ([(5.0, 2), (1.0, 98)], 0.99, 5.0),
    ],
    ids=["empty", "median", "p99-below-the-outlier", "p99-at-the-outlier"],
)
def test_weighted_quantile(pairs, q, want):
    assert weighted_quantile(pairs, q) == want


def test_token_clock_spreads_a_coalesced_run_over_its_tokens():
    c = TokenClock()
    c("r", 1, 1.0)  # first token: TTFT, no gap
    c("r", 4, 1.4)  # four decode steps in one event: four gaps of 0.1
    c("r", 1, 2.4)  # one step slowed by a prefill chunk
    assert c.first == {"r": 1.0}
    assert c.gaps == [(pytest.approx(0.1), 4), (pytest.approx(1.0), 1)]


def test_prefill_seconds_sum_reads_the_histogram():
    text = (
        "# HELP kvmesh_router_prefill_seconds x\n"
        'kvmesh_router_prefill_seconds_bucket{le="0.1",model="tiny"} 1.0\n'
        'kvmesh_router_prefill_seconds_sum{model="tiny"} 0.25\n'
        'kvmesh_router_prefill_seconds_sum{model="other"} 0.5\n'
        'kvmesh_router_prefill_seconds_count{model="tiny"} 1.0\n'
    )
    assert prefill_seconds_sum(text) == 0.75
    assert prefill_seconds_sum("") == 0.0
    assert summarize([{"a": 1.0}, {"a": 3.0}, {"a": 2.0}]) == {"a": 2.0}


def _long_and_short() -> list[ReplayRequest]:
    long = block_hashes(0, 3_200, 1, 32)
    short = block_hashes(0, 200, 2, 32)
    return [
        ReplayRequest(0.0, "a", long, 3_200, 50),
        ReplayRequest(0.01, "b", short, 200, 50),
    ]


@pytest.mark.parametrize(
    ("mode", "disaggregated"),
    [("aggregated", 0), ("always", 2), ("selective", 1)],
    ids=["aggregated", "always", "selective"],
)
def test_simulate_counts_and_hands_over(mode, disaggregated):
    setup = MeshSetup(mode, workers=2, prefill_workers=1, threshold_tokens=1_000)
    r = simulate(_long_and_short(), setup, transfer_bytes_per_s=1e12, workload="t")
    assert r.requests == 2 and r.disaggregated == disaggregated
    assert r.output_tokens == 100  # every token streamed, prefill's dropped token not counted
    assert r.ttft_p99_s > 0 and r.itl_p50_ms > 0
    # the long prompt's handed-over blocks count as cached on the decode worker
    assert (r.handoff_gb > 0) == (disaggregated > 0)


@pytest.mark.parametrize(
    ("per_node", "crosses"), [(2, False), (1, True)], ids=["one-node", "two-nodes"]
)
@pytest.mark.parametrize("placement", ["independent", "joint"])
def test_a_hand_off_crosses_the_network_only_between_nodes(per_node, crosses, placement):
    setup = MeshSetup(
        "always", workers=2, prefill_workers=1, placement=placement, workers_per_node=per_node
    )
    slow = simulate(_long_and_short(), setup, transfer_bytes_per_s=1e6, workload="t")
    assert slow.disaggregated == 2 and slow.handoff_gb > 0
    assert slow.same_node_splits == (0 if crosses else 2)
    assert slow.cross_node_gb == (slow.handoff_gb if crosses else 0.0)
    assert slow.cross_node_mb_per_split == pytest.approx(slow.cross_node_gb * 1e3 / 2)
    # 1 MB/s: ~100 blocks of 4 MiB take minutes between nodes, nothing within one
    fast = simulate(_long_and_short(), setup, transfer_bytes_per_s=1e12, workload="t")
    assert (slow.ttft_p99_s > fast.ttft_p99_s + 60) is crosses
