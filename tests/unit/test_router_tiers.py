"""The router's tier plan: which kvmanager tier streams to follow and which store backs which
worker (``services/router/core/node_stores.py``), from etcd records."""

from __future__ import annotations

import pytest

from kvmesh.discovery.keys import (
    KvManagerRecord,
    WorkerId,
    WorkerRecord,
    WorkerState,
    kvmanager_id_from_key,
    kvmanager_key,
    kvmanager_records,
)
from services.router.core.index import store_id
from services.router.core.node_stores import (
    KvManagerSet,
    TierChanges,
    TierPlan,
    TierStream,
    diff_plans,
    plan_tiers,
)

L1, L2 = "00112233aabbccdd", "ffeeddccbbaa9988"


def kvms(*recs: tuple[str, str]) -> KvManagerSet:
    """kvmanagers as (id, node), at address <id>:1."""
    s = KvManagerSet()
    s.apply_snapshot(KvManagerRecord(kid, f"{kid}:1", node) for kid, node in recs)
    return s


def worker(wid: str, node: str, layout: str = L1, state=WorkerState.SERVING) -> WorkerRecord:
    return WorkerRecord(
        WorkerId(wid), f"{wid}:1", "m", "/m", node=node, kv_layout=layout, state=state
    )


PLAN_CASES = [
    pytest.param(
        [worker("a", "n1"), worker("b", "n1"), worker("c", "n2")],
        {"a": "k1", "b": "k1", "c": "k2"},
        {L1},
        id="one-store-per-node",
    ),
    pytest.param(
        [worker("a", "n1"), worker("b", "n1", L2)],
        {"a": "k1", "b": "k1"},
        {L1, L2},
        id="two-layouts-two-stores",
    ),
    # k1 and k2 are followed anyway: a worker on n3 has no kvmanager to fetch into today, but
    # every kvmanager's blocks of a layout in use are peers to the workers of other nodes.
    pytest.param([worker("a", "n3")], {}, {L1}, id="node-without-kvmanager"),
    pytest.param([worker("a", "n1", "")], {}, set(), id="no-layout"),
    pytest.param([worker("a", "n1", "not-a-key")], {}, set(), id="malformed-layout"),
    pytest.param([worker("a", "n1", state=WorkerState.DRAINING)], {}, set(), id="draining"),
]


@pytest.mark.parametrize(("workers", "want", "layouts"), PLAN_CASES)
def test_plan_links_serving_workers_to_their_node_store(workers, want, layouts):
    plan = plan_tiers(workers, kvms(("k1", "n1"), ("k2", "n2")))
    by_worker = {w.worker_id: w.kv_layout for w in workers}
    assert plan.links == {WorkerId(w): store_id(k, by_worker[WorkerId(w)]) for w, k in want.items()}
    # Every kvmanager, for every layout in use on any node (peers of other nodes' workers).
    assert set(plan.streams) == {store_id(k, lay) for k in ("k1", "k2") for lay in layouts}
    assert set(plan.links.values()) <= set(plan.streams)
    for sid, s in plan.streams.items():
        assert (s.store, f"{s.kvmanager_id}/{s.layout_key}", s.address) == (
            sid,
            sid,
            f"{s.kvmanager_id}:1",
        )


def test_a_kvmanager_without_workers_of_the_layout_is_still_followed():
    """Node n2's workers left: its kvmanager's blocks stay a peer for n1's workers."""
    plan = plan_tiers([worker("a", "n1")], kvms(("k1", "n1"), ("k2", "n2")))
    assert set(plan.streams) == {store_id("k1", L1), store_id("k2", L1)}
    assert plan.links == {WorkerId("a"): store_id("k1", L1)}


def test_two_kvmanagers_on_one_node_the_smallest_id_serves_it():
    plan = plan_tiers([worker("a", "n1")], kvms(("z", "n1"), ("b", "n1")))
    assert plan.links == {WorkerId("a"): store_id("b", L1)}


def test_kvmanager_set_follows_etcd_and_skips_bad_records():
    """The etcd adapter (tiersync.py) parses entries with kvmesh/discovery/keys.py."""
    s = KvManagerSet()
    good = KvManagerRecord("k1", "h:1", "n1").to_json()
    s.apply_snapshot(
        kvmanager_records(
            "c",
            {
                kvmanager_key("c", "k1"): good,
                kvmanager_key("c", "k2"): "{not json",
                kvmanager_key("c", "k3"): KvManagerRecord("other", "h:3", "n3").to_json(),
                "/kvmesh/other/kvmanagers/k4": KvManagerRecord("k4", "h:4", "n4").to_json(),
            },
        )
    )
    assert len(s) == 1 and s.get("k1") == KvManagerRecord("k1", "h:1", "n1")
    s.apply_put(KvManagerRecord("k5", "h:5", "n5"))
    assert set(s.by_node()) == {"n1", "n5"}
    s.apply_delete("k1")
    s.apply_delete("nope")
    assert kvmanager_id_from_key("c", kvmanager_key("c", "k1")) == "k1"
    assert set(s.by_node()) == {"n5"}


S1, S2 = store_id("k1", L1), store_id("k2", L1)
T1 = TierStream(S1, "k1", L1, "k1:1")
T2 = TierStream(S2, "k2", L1, "k2:1")
A, B = WorkerId("a"), WorkerId("b")

DIFF_CASES = [
    pytest.param(TierPlan(), TierPlan(), TierChanges(), id="nothing"),
    pytest.param(
        TierPlan(),
        TierPlan({S1: T1}, {A: S1}),
        TierChanges(start=(T1,), links=((A, S1),)),
        id="kvmanager-appears",
    ),
    pytest.param(
        TierPlan({S1: T1}, {A: S1, B: S1}),
        TierPlan(),
        TierChanges(stop=(S1,), links=((A, None), (B, None))),
        id="kvmanager-leaves",
    ),
    pytest.param(
        TierPlan({S1: T1}, {A: S1}),
        TierPlan({S2: T2}, {A: S2}),
        TierChanges(start=(T2,), stop=(S1,), links=((A, S2),)),
        id="worker-moves-node",
    ),
    pytest.param(
        TierPlan({S1: T1}, {A: S1}),
        TierPlan({S1: TierStream(S1, "k1", L1, "k1:2")}, {A: S1}),
        TierChanges(start=(TierStream(S1, "k1", L1, "k1:2"),)),
        id="kvmanager-moves-address",
    ),
    pytest.param(
        TierPlan({S1: T1}, {A: S1, B: S1}),
        TierPlan({S1: T1}, {A: S1}),
        TierChanges(links=((B, None),)),
        id="one-worker-leaves",
    ),
]


@pytest.mark.parametrize(("old", "new", "want"), DIFF_CASES)
def test_diff_plans(old, new, want):
    got = diff_plans(old, new)
    assert got == want
    assert bool(got) == bool(want.start or want.stop or want.links)


def test_layout_change_relinks_and_stops_the_unused_store():
    ks = kvms(("k1", "n1"))
    before = plan_tiers([worker("a", "n1", L1)], ks)
    after = plan_tiers([worker("a", "n1", L2)], ks)
    got = diff_plans(before, after)
    new = store_id("k1", L2)
    assert got == TierChanges(
        start=(TierStream(new, "k1", L2, "k1:1"),),
        stop=(store_id("k1", L1),),
        links=((WorkerId("a"), new),),
    )
