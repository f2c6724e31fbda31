"""The prefill/decode decision (services/router/core/disagg.py): threshold on the decode pick's
uncached prompt, role selection for each stage, and the cases that stay aggregated; joint
placement of the (prefill, decode) pair by cost (services/router/core/placement.py: nodes,
prefix matches and loads as plain values). The error a client gets when the decode worker fails
with no one to take over is the lifecycle's (tests/unit/test_router_lifecycle.py)."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from kvmesh.discovery.keys import Role, WorkerId
from kvmesh.errors import InvalidArgument, Unavailable
from services.router.core.disagg import DisaggConfig, DisaggHandler, Reason
from services.router.core.placement import POLICY, Placement, PlacementConfig, profile_prefix
from services.router.core.routing import make_policy
from services.router.core.scheduler import Matched
from tests.unit.scheduler_fakes import BLOCK, FakeIndex, gpu, request, view

P, D, B = Role.PREFILL, Role.DECODE, Role.BOTH


def handler(
    matches: dict[str, Matched] | None = None,
    threshold: int = 100,
    handoff: set[str] | None = None,
    enabled: bool = True,
    placement: PlacementConfig | None = None,
) -> DisaggHandler:
    policy = make_policy("precise-prefix", index=FakeIndex(matches), rng=random.Random(0))
    return DisaggHandler(
        DisaggConfig(
            enabled=enabled, threshold_tokens=threshold, placement=placement or PlacementConfig()
        ),
        policy,
        can_hand_off=(lambda w: handoff is None or w in handoff),
    )


# prompt of 20 blocks of 16 tokens + 5 = 325 tokens
CASES = [
    # id, workers (id, role, waiting), matches, threshold, handoff,
    #   expected (decode, prefill or None, reason, uncached)
    pytest.param(
        [("p0", P, 0), ("d0", D, 0)],
        {},
        100,
        None,
        ("d0", "p0", Reason.DISAGGREGATED, 325),
        id="cold-long-prompt-disaggregates",
    ),
    pytest.param(
        [("p0", P, 0), ("d0", D, 0)],
        {"d0": gpu(15)},
        100,
        None,
        ("d0", None, Reason.BELOW_THRESHOLD, 85),
        id="decode-holds-most-stays-aggregated",
    ),
    pytest.param(
        [("p0", P, 0), ("d0", D, 0)],
        {"d0": gpu(14)},
        100,
        None,
        ("d0", "p0", Reason.DISAGGREGATED, 101),
        id="threshold-is-inclusive",
    ),
    pytest.param(
        [("b0", B, 0), ("b1", B, 0)],
        {},
        100,
        None,
        ("?", None, Reason.NO_PREFILL_WORKERS, 325),
        id="both-only-mesh-never-disaggregates",
    ),
    pytest.param(
        [("p0", P, 0), ("d0", D, 0)],
        {},
        100,
        set(),
        ("d0", None, Reason.NO_PREFILL_CANDIDATE, 325),
        id="prefill-without-kvmanager",
    ),
    pytest.param(
        [("p0", P, 0), ("p1", P, 0), ("d0", D, 0)],
        {"p1": gpu(10)},
        100,
        None,
        ("d0", "p1", Reason.DISAGGREGATED, 325),
        id="prefill-by-prefix-score",
    ),
    pytest.param(
        [("p0", P, 0), ("d0", D, 6), ("d1", D, 0)],
        {},
        100,
        None,
        ("d1", "p0", Reason.DISAGGREGATED, 325),
        id="decode-by-load",
    ),
    pytest.param(
        [("p0", P, 0), ("d0", D, 0), ("d1", D, 0)],
        {"d1": gpu(3), "p0": gpu(1)},
        100,
        None,
        ("d1", "p0", Reason.DISAGGREGATED, 277),
        id="decode-by-what-it-holds",
    ),
    pytest.param(
        [("p0", P, 0), ("b0", B, 0)],
        {},
        100,
        None,
        ("b0", "p0", Reason.DISAGGREGATED, 325),
        id="both-worker-decodes",
    ),
    pytest.param(
        [("p0", P, 0), ("b0", B, 0), ("d0", D, 9)],
        {"b0": gpu(2)},
        100,
        None,
        ("b0", "p0", Reason.DISAGGREGATED, 293),
        id="prefill-never-the-decode-pick",
    ),
]


@pytest.mark.parametrize("placement", list(Placement))
@pytest.mark.parametrize(("workers", "matches", "threshold", "handoff", "expected"), CASES)
def test_decision(workers, matches, threshold, handoff, expected, placement) -> None:
    """Without node names both placements agree: every hand-off crosses the network."""
    cands = [view(w, role=r, waiting=q) for w, r, q in workers]
    d = handler(matches, threshold, handoff, placement=PlacementConfig(mode=placement)).decide(
        request(20), cands
    )
    want_decode, want_prefill, want_reason, want_uncached = expected
    if want_decode != "?":
        assert d.decode.worker_id == want_decode
    assert (d.prefill.worker_id if d.prefill else None) == want_prefill
    assert d.reason is want_reason
    assert d.uncached_tokens == want_uncached
    assert d.disaggregated is (want_prefill is not None)
    # roles: the decode pick can decode, the prefill pick can prefill
    roles = {WorkerId(w): r for w, r, _ in workers}
    assert roles[d.decode.worker_id] in (D, B)
    if d.prefill is not None:
        assert roles[d.prefill.worker_id] in (P, B)
        assert d.prefill.worker_id != d.decode.worker_id


def test_disabled_serves_aggregated_on_a_decode_worker() -> None:
    d = handler(enabled=False).decide(request(20), [view("p0", role=P), view("d0", role=D)])
    assert (d.decode.worker_id, d.prefill, d.reason) == ("d0", None, Reason.DISABLED)


def test_prefill_only_mesh_is_unavailable_with_a_hint() -> None:
    with pytest.raises(Unavailable, match="--role decode"):
        handler().decide(request(20), [view("p0", role=P)])


def test_pick_decode_excludes_prefill_workers() -> None:
    h = handler({"p0": gpu(20)})
    for _ in range(5):
        assert h.pick_decode(request(20), [view("p0", role=P), view("d0", role=D)]).worker_id == (
            "d0"
        )


def test_uncached_counts_the_node_store_tiers() -> None:
    m = Matched(blocks=20, gpu_blocks=0, cpu_blocks=20)
    d = handler({"d0": m}).decide(request(20), [view("p0", role=P), view("d0", role=D)])
    assert d.reason is Reason.BELOW_THRESHOLD
    assert d.uncached_tokens == 325 - 20 * BLOCK


# ---- joint placement ---------------------------------------------------------------------------
# Costs in round numbers: prefill 1 ms per uncached token, a hand-off across nodes 0.25 ms per
# token (1,000 B/token at 4 MB/s), 0.5 s per request outstanding on a prefill worker. The prompt
# is 20 blocks of 16 tokens + 5 = 325 tokens; a decode worker holding nothing lacks 320.
COST = PlacementConfig(
    mode=Placement.JOINT,
    network_gbps=4e-3,
    kv_bytes_per_token=1000,
    prefill_s_per_token=1e-3,
    queued_request_s=0.5,
    decode_slack=0.0,
)


def on_node(wid: str, node: str, role: Role, *, in_flight: int = 0, kv: float = 0.0):
    v = view(wid, role=role, in_flight=in_flight, kv=kv)
    v.record = replace(v.record, node=node)
    return v


JOINT_CASES = [
    # id, workers (id, role, node, in_flight, kv), matches, decode_slack,
    #   expected (decode, prefill, same node, network s)
    pytest.param(
        [("p0", P, "a", 0, 0.0), ("p1", P, "b", 0, 0.0), ("d0", D, "b", 0, 0.0)],
        {"p0": gpu(10), "p1": gpu(8)},
        0.0,
        # p0: 165 uncached + 320 across = 0.245 s; p1: 197 uncached, free = 0.197 s
        ("d0", "p1", True, 0.0),
        id="same-node-when-its-prefix-is-close",
    ),
    pytest.param(
        [("p0", P, "a", 0, 0.0), ("p1", P, "b", 0, 0.0), ("d0", D, "b", 0, 0.0)],
        {"p0": gpu(20)},
        0.0,
        # p0: 5 uncached + 320 across = 0.085 s; p1: 325 uncached = 0.325 s
        ("d0", "p0", False, 0.08),
        id="across-when-the-other-holds-far-more",
    ),
    pytest.param(
        [("p0", P, "a", 0, 0.0), ("p1", P, "b", 0, 0.0), ("d0", D, "b", 0, 0.0)],
        {"p0": gpu(16), "p1": gpu(12), "d0": Matched(blocks=14, cpu_blocks=14)},
        0.0,
        # d0's node store holds 14 blocks: only 96 tokens to hand over (0.024 s);
        # p0: 69 uncached + 0.024 = 0.093 s; p1: 133 uncached = 0.133 s
        ("d0", "p0", False, 0.024),
        id="decode-node-holds-most-little-to-hand-over",
    ),
    pytest.param(
        [("p0", P, "a", 0, 0.0), ("p1", P, "b", 0, 0.0), ("d0", D, "b", 0, 0.0)],
        {"p0": gpu(16), "p1": gpu(12)},
        0.0,
        # the same without d0's holdings: p0 0.069 + 0.08 = 0.149 s; p1 0.133 s
        ("d0", "p1", True, 0.0),
        id="decode-holds-nothing-same-node-wins",
    ),
    pytest.param(
        [("p0", P, "a", 0, 0.0), ("p1", P, "b", 2, 0.0), ("d0", D, "b", 0, 0.0)],
        {},
        0.0,
        # p1 has 2 requests ahead (1 s): p0 0.325 + 0.08 = 0.405 s beats 1.325 s
        ("d0", "p0", False, 0.08),
        id="busy-same-node-prefill-loses",
    ),
    pytest.param(
        [("p0", P, "a", 1, 0.0), ("p1", P, "c", 0, 0.0), ("d0", D, "b", 0, 0.0)],
        {"p0": gpu(12), "p1": gpu(10)},
        0.0,
        # no prefill worker on d0's node: the profile's prefill pick (p0, by prefix) stays,
        # though p1 would cost less by this model (0.245 s vs 0.713 s): the profile balances
        ("d0", "p0", False, 0.08),
        id="remote-prefill-is-the-profiles-pick",
    ),
    pytest.param(
        [("p0", P, "", 0, 0.0), ("p1", P, "", 0, 0.0), ("d0", D, "", 0, 0.0)],
        {"p0": gpu(10), "p1": gpu(8)},
        0.0,
        ("d0", "p0", False, 0.08),
        id="unnamed-nodes-are-never-shared",
    ),
    pytest.param(
        [
            ("p0", P, "a", 4, 0.0),
            ("d0", D, "a", 0, 0.0),
            ("p1", P, "b", 0, 0.0),
            ("d1", D, "b", 0, 0.1),
        ],
        {},
        0.05,
        # d1 scores 0.01 below d0 (kv usage): within 5%, and (p1, d1) share a node at 0.325 s
        ("d1", "p1", True, 0.0),
        id="decode-slack-pairs-on-one-node",
    ),
    pytest.param(
        [
            ("p0", P, "a", 4, 0.0),
            ("d0", D, "a", 0, 0.0),
            ("p1", P, "b", 0, 0.0),
            ("d1", D, "b", 0, 0.1),
        ],
        {},
        0.0,
        # no slack: the decode pick d0 stays; p1 across (0.405 s) beats busy p0 (2.325 s)
        ("d0", "p1", False, 0.08),
        id="no-slack-keeps-the-decode-pick",
    ),
]


@pytest.mark.parametrize(("workers", "matches", "slack", "expected"), JOINT_CASES)
def test_joint_placement(workers, matches, slack, expected) -> None:
    cands = [on_node(w, n, r, in_flight=f, kv=kv) for w, r, n, f, kv in workers]
    cfg = replace(COST, decode_slack=slack)
    d = handler(matches, placement=cfg).decide(request(20), cands)
    want_decode, want_prefill, want_same, want_network = expected
    assert d.reason is Reason.DISAGGREGATED
    assert (d.decode.worker_id, d.prefill.worker_id if d.prefill else None) == (
        want_decode,
        want_prefill,
    )
    cost = d.placement
    assert cost is not None
    assert (cost.decode, cost.prefill, cost.same_node) == (want_decode, want_prefill, want_same)
    assert cost.network_s == pytest.approx(want_network)
    assert d.prefill is not None
    if d.prefill.policy == POLICY:  # not the profile's prefill pick: one on the decode's node
        assert (d.prefill.reason, want_same) == ("same-node", True)
    m = matches.get(want_decode)
    held = m.blocks * BLOCK if m is not None else 0
    assert d.uncached_tokens == cost.decode_uncached_tokens == 325 - held
    assert cost.handoff_tokens == 320 - held
    # the prefill decision says what the prefill worker holds (the ledger reads it)
    p = matches.get(want_prefill)
    assert d.prefill.explanation is not None
    assert d.prefill.explanation.cached_tokens == (p.blocks * BLOCK if p is not None else 0)


def test_independent_placement_keeps_the_profiles_prefill_pick() -> None:
    cands = [on_node("p0", "a", P), on_node("p1", "b", P), on_node("d0", "b", D)]
    matches = {"p0": gpu(10), "p1": gpu(8)}
    cfg = replace(COST, mode=Placement.INDEPENDENT)
    d = handler(matches, placement=cfg).decide(request(20), cands)
    assert (d.prefill.worker_id if d.prefill else None, d.placement) == ("p0", None)


def test_a_decode_worker_chosen_by_slack_explains_itself() -> None:
    cands = [
        on_node("p0", "a", P, in_flight=4),
        on_node("d0", "a", D),
        on_node("p1", "b", P),
        on_node("d1", "b", D, kv=0.1),
    ]
    d = handler({}, placement=replace(COST, decode_slack=0.05)).decide(request(20), cands)
    e = d.decode.explanation
    assert d.decode.reason == "joint-placement" and e is not None
    assert (e.deciding, e.runner_up, e.cached_tokens) == ("joint-placement", "d0", 0)
    assert e.winner_total < e.runner_up_total  # the profile preferred d0, by a little


def test_joint_placement_without_a_prefix_source_still_weighs_nodes() -> None:
    """A profile with no prefix scorer: nothing is cached anywhere, so the node decides
    (whichever idle prefill worker the profile drew); a ``prefix`` function given to the handler
    replaces the profile's."""
    cands = [on_node("p0", "a", P), on_node("p1", "b", P), on_node("d0", "b", D)]
    cfg = DisaggConfig(threshold_tokens=100, placement=COST)
    for seed in range(4):
        policy = make_policy("least-loaded", rng=random.Random(seed))
        assert profile_prefix(policy) is None
        d = DisaggHandler(cfg, policy).decide(request(20), cands)
        assert d.prefill is not None and d.prefill.worker_id == "p1"
        assert d.placement is not None and d.placement.handoff_tokens == 320
    held = {WorkerId("d0"): Matched(blocks=18, cpu_blocks=18)}
    d = DisaggHandler(cfg, policy, prefix=lambda _r, _c: held).decide(request(20), cands)
    assert d.placement is not None and d.placement.handoff_tokens == 2 * BLOCK
    assert d.uncached_tokens == 325 - 18 * BLOCK


@pytest.mark.parametrize(
    "kw",
    [
        {"mode": "sideways"},
        {"network_gbps": 0.0},
        {"kv_bytes_per_token": 0},
        {"prefill_s_per_token": -1.0},
        {"queued_request_s": -0.5},
        {"decode_slack": 1.5},
    ],
    ids=["mode", "bandwidth", "kv-bytes", "prefill-cost", "queue-cost", "slack"],
)
def test_placement_config_is_checked(kw) -> None:
    with pytest.raises(InvalidArgument):
        PlacementConfig(**kw)
    assert PlacementConfig(mode="independent").mode is Placement.INDEPENDENT  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "kw", [{"threshold_tokens": 0}, {"prefill_timeout_s": 0.0}], ids=["threshold", "timeout"]
)
def test_config_is_checked(kw) -> None:
    with pytest.raises(InvalidArgument):
        DisaggConfig(**kw)


# ---- KV layouts ------------------------------------------------------------------------------
def with_layout(v, layout: str):  # type: ignore[no-untyped-def]
    v.record = replace(v.record, kv_layout=layout)
    return v


PLAIN = "kvmesh-kv1;model=tiny;num_layers=2"
DRAFTED = "kvmesh-kv1;model=tiny;num_layers=3"  # a speculative drafter's KV layers too


@pytest.mark.parametrize("placement", list(Placement))
def test_prefill_only_on_a_worker_of_the_decode_picks_kv_layout(placement) -> None:
    """Blocks of another layout would not load (a decode worker with a draft model needs them
    with the drafter's KV too): the pair shares the layout, whatever else the profile prefers."""
    cfg = replace(COST, mode=placement)
    for p0_layout, p1_layout, want in [
        (PLAIN, DRAFTED, "p1"),  # p0 holds more, but its blocks do not fit d0
        (DRAFTED, PLAIN, "p0"),
        ("", PLAIN, "p0"),  # a worker that does not say its layout is not excluded
    ]:
        cands = [
            with_layout(on_node("p0", "a", P), p0_layout),
            with_layout(on_node("p1", "b", P), p1_layout),
            with_layout(on_node("d0", "a", D), DRAFTED),
        ]
        d = handler({"p0": gpu(12)}, placement=cfg).decide(request(20), cands)
        assert d.prefill is not None and d.prefill.worker_id == want, (p0_layout, p1_layout)
    cands = [with_layout(on_node("p0", "a", P), PLAIN), with_layout(on_node("d0", "a", D), DRAFTED)]
    d = handler({}, placement=cfg).decide(request(20), cands)
    assert (d.prefill, d.reason) == (None, Reason.NO_PREFILL_CANDIDATE)


def test_joint_placement_moves_the_decode_only_to_a_worker_of_the_prefills_layout() -> None:
    """Decode slack may move the decode to another prefill worker's node, but not to a worker
    whose layout that prefill worker's blocks do not fit."""
    cands = [
        with_layout(on_node("p0", "a", P, in_flight=4), PLAIN),
        with_layout(on_node("d0", "a", D), PLAIN),
        with_layout(on_node("p1", "b", P), PLAIN),
        with_layout(on_node("d1", "b", D, kv=0.1), DRAFTED),
    ]
    d = handler({}, placement=replace(COST, decode_slack=0.05)).decide(request(20), cands)
    # without layouts this is decode-slack-pairs-on-one-node: (d1, p1)
    assert d.decode.worker_id == "d0" and d.prefill is not None and d.prefill.worker_id == "p1"
