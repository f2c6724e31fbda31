"""Peer hints: the KV index's per-store match (``KvIndex.match_stores``) and the choice of a peer
kvmanager for the worker a request was routed to (``services/router/core/peers.py``)."""

from __future__ import annotations

import pytest

from kvmesh.discovery.keys import WorkerId
from kvmesh.errors import InvalidArgument
from kvmesh.kv.events import BlockHash, BlockStored, KvEvent, KvEventBatch, Tier
from services.router.core.index import (
    ApplyResult,
    KvIndex,
    StoreId,
    StoreMatch,
    store_id,
    store_parts,
)
from services.router.core.peers import PeerChoice, PeerHintConfig, PeerHints
from services.router.core.recent_prefills import RecentPrefills
from services.router.core.types import PeerHint, RouteDecision

L1, L2 = "00112233aabbccdd", "ffeeddccbbaa9988"
A, B = WorkerId("a"), WorkerId("b")
KA, KB, KC = store_id("kvm-a", L1), store_id("kvm-b", L1), store_id("kvm-c", L1)
KA2 = store_id("kvm-a", L2)
GPU, CPU, DISK = Tier.GPU, Tier.CPU, Tier.DISK


def h(*xs: int) -> tuple[BlockHash, ...]:
    return tuple(BlockHash(x) for x in xs)


def run(n: int, start: int = 1) -> tuple[int, ...]:
    return tuple(range(start, start + n))


def stored(xs: tuple[int, ...], tier: Tier = GPU) -> BlockStored:
    return BlockStored(h(*xs), None, tier, 32)


def snap(holder: str, *events: KvEvent) -> KvEventBatch:
    return KvEventBatch(holder, "e1", 1, events, snapshot=True)


def put_store(ix: KvIndex, store: StoreId, *events: KvEvent) -> None:
    assert ix.apply_store(store, snap(store_parts(store)[0], *events)) is (
        ApplyResult.SNAPSHOT_APPLIED
    )


PROMPT = h(*run(20))


# ---- KvIndex.match_stores ---------------------------------------------------------------------
def test_match_stores_is_each_stores_own_contiguous_prefix_longest_first():
    ix = KvIndex()
    ix.apply(snap("a", stored(run(20))))  # a worker's gpu blocks never count for a store
    put_store(ix, KA, stored(run(5), CPU))
    put_store(ix, KB, stored(run(8), CPU), stored(run(4, start=9), DISK))  # 12, cpu then disk
    put_store(ix, KC, stored(run(12), DISK), stored((14, 15), CPU))  # hole at 13
    put_store(ix, KA2, stored(run(20), CPU))  # another layout: its own store
    got = ix.match_stores(PROMPT)
    assert list(got.values()) == [
        StoreMatch(KA2, 20, True),
        StoreMatch(KB, 12, True),
        StoreMatch(KC, 12, True),
        StoreMatch(KA, 5, True),
    ]
    assert list(ix.match_stores(PROMPT, [KA, KC, StoreId("nope"), A])) == [KC, KA]
    assert ix.match_stores(PROMPT, []) == {}
    assert ix.match_stores((), None) == {}
    assert ix.match_stores(h(99, 1, 2)) == {}  # the first block nowhere: nothing
    ix.mark_degraded(KB)
    assert ix.match_stores(PROMPT, [KB])[KB] == StoreMatch(KB, 12, False)
    ix.drop_store(KB)
    assert KB not in ix.match_stores(PROMPT)
    ix.check_invariants()


# ---- PeerHints ----------------------------------------------------------------------------------
def mesh(
    own_gpu: int = 0,
    own_store: int = 0,
    peers: dict[StoreId, int] | None = None,
    link: StoreId | None = KB,
) -> KvIndex:
    """Worker b (on node b, linked to ``link``) holds ``own_gpu`` leading blocks on its gpu and
    its store ``own_store`` on cpu; each peer store its count of leading blocks on cpu."""
    ix = KvIndex()
    ix.apply(snap("b", stored(run(own_gpu))) if own_gpu else snap("b"))
    ix.apply(snap("a"))
    put_store(ix, KB, *([stored(run(own_store), CPU)] if own_store else []))
    for sid, n in (peers or {}).items():
        put_store(ix, sid, stored(run(n), CPU))
    ix.link(A, KA)
    ix.link(B, link)
    return ix


HINT_CASES = [
    pytest.param({}, {KA: 20}, PeerHint("kvm-a", 20, 0), id="cold-worker-warm-peer"),
    pytest.param({"own_store": 6}, {KA: 20}, PeerHint("kvm-a", 20, 6), id="peer-holds-more"),
    pytest.param({"own_gpu": 9}, {KA: 20}, PeerHint("kvm-a", 20, 9), id="beyond-own-gpu"),
    pytest.param({"own_gpu": 20}, {KA: 20}, None, id="worker-holds-it-all"),
    pytest.param({"own_store": 17}, {KA: 20}, None, id="gain-below-min"),
    pytest.param({"own_store": 16}, {KA: 20}, PeerHint("kvm-a", 20, 16), id="gain-at-min"),
    pytest.param({}, {KA: 3}, None, id="peer-holds-too-little"),
    pytest.param({}, {KA: 12, KC: 15}, PeerHint("kvm-c", 15, 0), id="longest-peer"),
    pytest.param({}, {KA: 15, KC: 15}, PeerHint("kvm-a", 15, 0), id="tie-smallest-id"),
    pytest.param({}, {KA2: 20}, None, id="other-layout-is-no-peer"),
    pytest.param({"link": None}, {KA: 20}, None, id="worker-without-a-store"),
    pytest.param({"own_store": 20}, {KA: 20}, None, id="own-store-holds-it"),
    pytest.param({}, {}, None, id="no-peer"),
]


@pytest.mark.parametrize(("worker", "peers", "want"), HINT_CASES)
def test_hint_names_the_longest_peer_of_the_workers_layout(worker, peers, want):
    ix = mesh(peers=peers, **worker)
    assert PeerHints(ix).hint(PROMPT, B) == want
    ix.check_invariants()


def test_hint_options_and_edges():
    ix = mesh(peers={KA: 20})
    assert PeerHints(ix, PeerHintConfig(enabled=False)).hint(PROMPT, B) is None
    assert PeerHints(ix, PeerHintConfig(min_gain_blocks=21)).hint(PROMPT, B) is None
    assert PeerHints(ix).hint((), B) is None
    assert PeerHints(ix).hint(PROMPT, WorkerId("unknown")) is None
    assert PeerHints(ix).hint(PROMPT, A) is None  # a's own store is kvm-a: no other peer
    ix.mark_degraded(KA)
    assert PeerHints(ix).hint(PROMPT, B) == PeerHint("kvm-a", 20, 0, exact=False)
    with pytest.raises(InvalidArgument, match="min_gain_blocks"):
        PeerHintConfig(min_gain_blocks=0)


def test_the_workers_own_store_prefix_rides_along_when_the_view_is_exact():
    """``store_blocks``: what the worker's node store itself holds (never its gpu, never a
    peer's), with or without peer hints; unknown when the store's view is not exact."""
    ix = mesh(own_gpu=20, own_store=6, peers={KA: 20})
    assert PeerHints(ix).decide(PROMPT, B).store_blocks == 6
    assert PeerHints(ix, PeerHintConfig(enabled=False)).decide(PROMPT, B).store_blocks == 6
    assert PeerHints(mesh(own_gpu=20, peers={KA: 20})).decide(PROMPT, B).store_blocks == 0
    cold = mesh(own_store=6, peers={KA: 20})  # a hint and the count together
    choice = PeerHints(cold).decide(PROMPT, B)
    assert (choice.hint, choice.store_blocks) == (PeerHint("kvm-a", 20, 6), 6)
    assert PeerHints(ix).decide(PROMPT, A).store_blocks == 20  # a's store is kvm-a
    assert PeerHints(mesh(link=None)).decide(PROMPT, B).store_blocks is None
    ix.mark_degraded(KB)  # a gap in its events: it may hold more than the index says
    assert PeerHints(ix).decide(PROMPT, B).store_blocks is None


def sibling_mesh(own_store: int = 6, sibling_gpu: int = 12) -> KvIndex:
    """``mesh`` plus worker c on b's node store (kvm-b), holding ``sibling_gpu`` blocks on its
    gpu per the index."""
    ix = mesh(own_store=own_store)
    ix.apply(snap("c", stored(run(sibling_gpu))))
    ix.link(WorkerId("c"), KB)
    return ix


def just_computed(ix: KvIndex, blocks: int = 12, config: PeerHintConfig | None = None) -> PeerHints:
    """PeerHints over ``ix`` that saw c's first token for the prompt's first ``blocks``."""
    peers = PeerHints(ix, config, recent=RecentPrefills())
    peers.computed(PROMPT[:blocks], WorkerId("c"))
    return peers


def test_a_sibling_that_just_computed_the_prompt_is_waited_for_in_the_nodes_own_kvmanager():
    """c computed the prompt a moment ago (its first token): the hint names b's own kvmanager
    with c's count and a short wait (the connector's hand-off wait: it looks until the save
    lands), and the store's count is withheld, so the connector looks instead of skipping a
    lookup that would hit."""
    choice = just_computed(sibling_mesh()).decide(PROMPT, B)
    want = PeerHint("kvm-b", 12, 6, max_fetch_s=0.25, wait_s=0.25)
    assert (choice.hint, choice.store_blocks) == (want, None)
    cfg = PeerHintConfig(sibling_wait_s=0.1)
    assert just_computed(sibling_mesh(), config=cfg).decide(PROMPT, B).hint == PeerHint(
        "kvm-b", 12, 6, max_fetch_s=0.1, wait_s=0.1
    )
    # Before its own KV events reached the index, too (the case the note is for).
    assert just_computed(sibling_mesh(sibling_gpu=0)).decide(PROMPT, B).hint == want


def test_a_sibling_ahead_only_in_the_index_makes_the_connector_look_not_wait():
    """Blocks a sibling has held for a while and the store lacks (never saved, or evicted
    since) are not on their way: no wait, but the store's count is withheld all the same."""
    assert PeerHints(sibling_mesh()).decide(PROMPT, B) == PeerChoice(store_blocks=None)


@pytest.mark.parametrize(
    ("config", "own_store", "sibling_gpu", "prompt", "store_blocks"),
    [
        pytest.param({"sibling_wait_s": 0}, 6, 12, PROMPT, None, id="no-wait-count-withheld"),
        pytest.param({"enabled": False}, 6, 12, PROMPT, None, id="hints-off-count-withheld"),
        pytest.param({}, 6, 9, PROMPT, None, id="gain-below-min-count-withheld"),
        pytest.param({}, 6, 6, PROMPT, 6, id="sibling-not-ahead"),
        pytest.param({}, 6, 12, h(*run(6)), 6, id="sibling-has-no-more-of-this-prompt"),
    ],
)
def test_no_sibling_hint(config, own_store, sibling_gpu, prompt, store_blocks):
    ix = sibling_mesh(own_store, sibling_gpu)
    peers = just_computed(ix, sibling_gpu, PeerHintConfig(**config))
    choice = peers.decide(prompt, B)
    assert (choice.hint, choice.store_blocks) == (None, store_blocks)


def test_the_sibling_hint_ends_when_the_save_lands_or_a_peer_holds_more():
    ix = sibling_mesh()
    put_store(ix, KB, stored(run(12), CPU))  # the save landed: nothing to wait for
    assert just_computed(ix).decide(PROMPT, B) == PeerChoice(store_blocks=12)
    ix = sibling_mesh()
    put_store(ix, KA, stored(run(20), CPU))  # another node's store holds more: fetch from it
    assert just_computed(ix).decide(PROMPT, B).hint == PeerHint("kvm-a", 20, 6)
    ix = sibling_mesh()
    ix.link(WorkerId("c"), KA)  # a worker on another node's store is no sibling
    assert just_computed(ix).decide(PROMPT, B) == PeerChoice(store_blocks=6)
    with pytest.raises(InvalidArgument, match="sibling_wait_s"):
        PeerHintConfig(sibling_wait_s=-1)


def test_a_miss_costs_one_lookup_per_walk():
    """No peer holds the first block: the walk stops at once (cheap on every request)."""
    ix = mesh(peers={KA: 20})
    lookups = 0
    d = ix._d

    class Counting(dict):
        def get(self, key, default=None):
            nonlocal lookups
            lookups += 1
            return d.get(key, default)

    ix._d = Counting(d)  # type: ignore[assignment]
    assert PeerHints(ix).hint(h(999, *run(1000)), B) is None
    assert lookups == 1


def test_the_decision_carries_the_hint():
    peer = PeerHint("kvm-a", 20, 6)
    d = RouteDecision(B, "p", "tie-break", peer=peer)
    assert peer.gain_blocks == 14
    assert d.attributes()["peer_kvmanager"] == "kvm-a" and d.attributes()["peer_blocks"] == 20
    assert "peer=kvm-a peer_blocks=20 local_blocks=6" in d.details()
    assert "peer_kvmanager" not in RouteDecision(B, "p", "tie-break").attributes()
