"""The KV index's node stores: a kvmanager's blocks of one layout, linked to the workers of its
node, count as those workers' lower tiers (each block once, on its best tier: gpu > cpu > disk)."""

from __future__ import annotations

import pytest

from kvmesh.discovery.keys import WorkerId
from kvmesh.kv.events import BlockHash, BlockRemoved, BlockStored, KvEvent, KvEventBatch, Tier
from services.router.core.index import (
    ApplyResult,
    KvIndex,
    PrefixMatch,
    StoreId,
    ViewState,
    store_id,
)

A, B, C = WorkerId("a"), WorkerId("b"), WorkerId("c")
N1, N2 = store_id("kvm-1", "00112233aabbccdd"), store_id("kvm-2", "00112233aabbccdd")
GPU, CPU, DISK = Tier.GPU, Tier.CPU, Tier.DISK


def h(*xs: int) -> tuple[BlockHash, ...]:
    return tuple(BlockHash(x) for x in xs)


def stored(*xs: int, tier: Tier = GPU) -> BlockStored:
    return BlockStored(h(*xs), None, tier, 32)


def snap(holder: str, *events: KvEvent, seq: int = 1, epoch: str = "e1") -> KvEventBatch:
    return KvEventBatch(holder, epoch, seq, events, snapshot=True)


def put_store(ix: KvIndex, store: StoreId, *events: KvEvent) -> None:
    kvm = store.split("/")[0]  # the kvmanager's stream names the kvmanager, not the layout
    assert ix.apply_store(store, snap(kvm, *events)) is ApplyResult.SNAPSHOT_APPLIED


def tiers(m: PrefixMatch | None) -> tuple[int, int, int, int] | None:
    return m and (m.blocks, m.gpu_blocks, m.cpu_blocks, m.disk_blocks)


# ---- one worker, its own blocks and its node store's ------------------------------------------
MERGE_CASES = [
    pytest.param([], [stored(1, 2, 3, tier=CPU)], (3, 0, 3, 0), id="store-cpu-only"),
    pytest.param([], [stored(1, 2, tier=DISK)], (2, 0, 0, 2), id="store-disk-only"),
    pytest.param([stored(1, 2)], [stored(1, 2, 3, tier=CPU)], (3, 2, 1, 0), id="gpu-beats-cpu"),
    pytest.param([stored(1, 3)], [stored(2, tier=DISK)], (3, 2, 0, 1), id="store-fills-a-hole"),
    pytest.param(
        [], [stored(1, 2, tier=DISK), stored(1, tier=CPU)], (2, 0, 1, 1), id="cpu-beats-disk"
    ),
    pytest.param(
        [stored(1, tier=DISK)], [stored(1, tier=CPU)], (1, 0, 1, 0), id="own-disk-store-cpu"
    ),
    pytest.param([stored(1, 2, 3)], [stored(1, 2, 3, tier=DISK)], (3, 3, 0, 0), id="all-on-gpu"),
    pytest.param([], [stored(1, 3, tier=CPU)], (1, 0, 1, 0), id="hole-in-store-ends-match"),
    pytest.param([stored(1)], [stored(2, 3, tier=CPU)], (3, 1, 2, 0), id="gpu-then-cpu"),
    pytest.param([stored(2)], [stored(3, tier=CPU)], None, id="first-block-nowhere"),
]


@pytest.mark.parametrize(("own", "node", "want"), MERGE_CASES)
def test_worker_match_merges_its_node_store(own, node, want):
    ix = KvIndex()
    ix.apply(snap("a", *own))
    ix.apply(snap("b", *own))  # the same blocks, but no store: only its own count
    put_store(ix, N1, *node)
    ix.link(A, N1)
    got = ix.match(h(1, 2, 3, 4))
    assert tiers(got.get(A)) == want
    if want is not None:
        assert got[A].exact and sum(want[1:]) == want[0]
    alone = KvIndex()
    alone.apply(snap("b", *own))
    assert got.get(B) == alone.match(h(1, 2, 3, 4)).get(B)
    ix.check_invariants()


def test_a_store_backs_the_workers_of_its_node_only():
    ix = KvIndex()
    for w in "abc":
        ix.apply(snap(w))
    ix.apply(KvEventBatch("b", "e1", 2, (stored(1),)))
    put_store(ix, N1, stored(1, 2, 3, tier=CPU))
    put_store(ix, N2, stored(1, tier=DISK))
    ix.link(A, N1)
    ix.link(B, N1)
    ix.link(C, N2)
    got = ix.match(h(1, 2, 3))
    assert list(got) == [A, B, C]  # longest first, ties by id
    assert tiers(got[A]) == (3, 0, 3, 0)
    assert tiers(got[B]) == (3, 1, 2, 0)
    assert tiers(got[C]) == (1, 0, 0, 1)
    assert {w: tiers(m) for w, m in ix.match(h(1, 2, 3), [C, A]).items()} == {
        A: (3, 0, 3, 0),
        C: (1, 0, 0, 1),
    }


def test_stores_are_never_matched_and_views_keep_their_own_blocks():
    ix = KvIndex()
    ix.apply(snap("a", stored(1)))
    put_store(ix, N1, stored(1, 2, tier=CPU), stored(2, tier=DISK))
    ix.link(A, N1)
    assert list(ix.match(h(1, 2))) == [A]
    assert ix.match(h(1, 2), [N1]) == {}  # type: ignore[list-item]
    assert ix.workers() == (A,) and ix.stores() == (N1,)
    v = ix.view(N1)
    assert (v.state, v.gpu_blocks, v.cpu_blocks, v.disk_blocks) == (ViewState.EXACT, 0, 2, 1)
    assert (ix.view(A).gpu_blocks, ix.view(A).cpu_blocks) == (1, 0)
    st = ix.stats()
    assert (st.workers, st.stores, st.links, st.blocks, st.entries) == (1, 1, 1, 2, 4)


def test_a_worker_without_a_view_matches_nothing_through_its_store():
    ix = KvIndex()
    put_store(ix, N1, stored(1, tier=CPU))
    ix.link(A, N1)
    assert ix.match(h(1)) == {}
    ix.apply(snap("a"))
    assert tiers(ix.match(h(1))[A]) == (1, 0, 1, 0)


# ---- the store or the link changing --------------------------------------------------------
def test_dropped_store_takes_its_blocks_with_it_and_may_come_back():
    ix = KvIndex()
    ix.apply(snap("a", stored(1)))
    put_store(ix, N1, stored(1, 2, tier=CPU))
    ix.link(A, N1)
    assert ix.drop_store(N1) is True and ix.drop_store(N1) is False
    assert tiers(ix.match(h(1, 2))[A]) == (1, 1, 0, 0)
    assert ix.linked(A) == N1  # the link is kept: a kvmanager back under its id counts again
    ix.sweep()
    ix.check_invariants()
    ix.apply(snap("b", stored(7)))  # may take the store's old slot: inherits nothing
    assert ix.match(h(2)) == {} and tiers(ix.match(h(7))[B]) == (1, 1, 0, 0)
    put_store(ix, N1, stored(1, 2, 3, tier=DISK))
    assert tiers(ix.match(h(1, 2, 3))[A]) == (3, 1, 0, 2)
    ix.check_invariants()


RELINK_CASES = [
    pytest.param(N2, (2, 1, 0, 1), id="layout-changed"),
    pytest.param(None, (1, 1, 0, 0), id="kvmanager-gone"),
]


@pytest.mark.parametrize(("new", "want"), RELINK_CASES)
def test_relinking_replaces_the_lower_tiers(new, want):
    ix = KvIndex()
    ix.apply(snap("a", stored(1)))
    put_store(ix, N1, stored(1, 2, 3, tier=CPU))
    put_store(ix, N2, stored(2, tier=DISK))
    ix.link(A, N1)
    assert tiers(ix.match(h(1, 2, 3))[A]) == (3, 1, 2, 0)
    ix.link(A, new)
    assert tiers(ix.match(h(1, 2, 3))[A]) == want
    assert ix.linked(A) == new


def test_dropping_a_worker_forgets_its_link():
    ix = KvIndex()
    ix.apply(snap("a"))
    put_store(ix, N1, stored(1, tier=CPU))
    ix.link(A, N1)
    assert ix.drop_worker(A) and ix.linked(A) is None and ix.stats().links == 0
    ix.apply(snap("a"))
    assert ix.match(h(1)) == {}


def test_store_events_apply_in_order_and_removals_count():
    ix = KvIndex()
    ix.apply(snap("a"))
    put_store(ix, N1, stored(1, 2, tier=CPU))
    ix.link(A, N1)
    demote = (stored(2, tier=DISK), BlockRemoved(h(2), CPU))
    assert ix.apply_store(N1, KvEventBatch("kvm-1", "e1", 2, demote)) is ApplyResult.APPLIED
    assert tiers(ix.match(h(1, 2))[A]) == (2, 0, 1, 1)
    gap = KvEventBatch("kvm-1", "e1", 4, (stored(3, tier=CPU),))
    assert ix.apply_store(N1, gap) is ApplyResult.GAP
    assert ix.match(h(1, 2, 3))[A].exact is False  # the store's view is degraded
    assert tiers(ix.match(h(1, 2, 3))[A]) == (2, 0, 1, 1)  # the gap was not applied
    ix.check_invariants()


# ---- exactness ---------------------------------------------------------------------------------
EXACT_CASES = [
    pytest.param("none", True, id="both-exact"),
    pytest.param("store-lost", False, id="store-stream-lost"),
    pytest.param("worker-lost", False, id="worker-stream-lost"),
    pytest.param("store-lost-then-live", True, id="store-resumed"),
]


@pytest.mark.parametrize(("what", "exact"), EXACT_CASES)
def test_match_is_exact_only_when_worker_and_store_are(what: str, exact: bool):
    ix = KvIndex()
    ix.apply(snap("a", stored(1)))
    ix.apply(snap("b", stored(1)))
    put_store(ix, N1, stored(1, 2, tier=CPU))
    ix.link(A, N1)
    if what.startswith("store-lost"):
        ix.mark_degraded(N1)
        assert ix.view(N1).state is ViewState.DEGRADED
    if what == "worker-lost":
        ix.mark_degraded(A)
    if what.endswith("then-live"):
        ix.mark_live(N1)
    got = ix.match(h(1, 2))
    assert got[A].exact is exact
    assert got[B].exact  # not linked: untouched


def test_many_workers_share_one_store_projection():
    """A store backing many workers, mixed with their own tiers, agrees with a per-worker sum."""
    ix = KvIndex()
    n = 40
    for i in range(n):
        ix.apply(snap(f"w{i}", stored(*range(1, 1 + i % 7))))
        ix.link(WorkerId(f"w{i}"), N1 if i % 2 else N2)
    put_store(ix, N1, stored(*range(1, 11), tier=CPU))
    put_store(ix, N2, stored(*range(1, 5), tier=DISK))
    got = ix.match(h(*range(1, 12)))
    for i in range(n):
        own = i % 7
        lower = 10 if i % 2 else 4
        m = got[WorkerId(f"w{i}")]
        want = (max(own, lower), own, max(lower - own, 0), 0)
        if not i % 2:
            want = (want[0], own, 0, max(lower - own, 0))
        assert tiers(m) == want, i


# ---- long prompts: match looks blocks up a chunk at a time (64, then 1,024 blocks) -------------
@pytest.mark.parametrize(
    ("a_gpu", "n1_cpu", "b_end"),
    [
        pytest.param(64, 65, 63, id="ends-at-the-first-chunk"),
        pytest.param(1087, 1088, 1089, id="ends-around-the-second-chunk"),
        pytest.param(2000, 3000, 3000, id="whole-prompt"),
        pytest.param(0, 1500, 1, id="store-only-worker"),
    ],
)
def test_long_prompt_matches_block_by_block_count(a_gpu: int, n1_cpu: int, b_end: int) -> None:
    ix = KvIndex()
    prompt = list(range(1, 3001))
    ix.apply(snap("a", *([stored(*prompt[:a_gpu])] if a_gpu else [])))
    ix.apply(snap("b", stored(*prompt[:b_end])))
    ix.apply(snap("c"))
    put_store(ix, N1, stored(*prompt[:n1_cpu], tier=CPU), stored(*prompt[:10], tier=DISK))
    ix.link(A, N1)
    ix.link(C, N1)
    got = ix.match(h(*prompt))
    a = max(a_gpu, n1_cpu)
    assert tiers(got.get(A)) == (a, a_gpu, a - a_gpu, 0)
    assert tiers(got.get(B)) == (b_end, b_end, 0, 0)
    assert tiers(got.get(C)) == (n1_cpu, 0, n1_cpu, 0)
    assert [m.blocks for m in got.values()] == sorted(
        (m.blocks for m in got.values()), reverse=True
    )
