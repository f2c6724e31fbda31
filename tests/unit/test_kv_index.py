"""The router's KV block index: prefix matching, tiers, batch ordering, bounds, properties."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvmesh.discovery.keys import WorkerId
from kvmesh.kv.events import (
    AllBlocksCleared,
    BlockHash,
    BlockRemoved,
    BlockStored,
    KvEvent,
    KvEventBatch,
    Tier,
)
from services.router.core.index import (
    ApplyResult,
    IndexConfig,
    KvIndex,
    PrefixMatch,
    StoreId,
    ViewState,
)

A, B, C = WorkerId("a"), WorkerId("b"), WorkerId("c")
GPU, CPU, DISK = Tier.GPU, Tier.CPU, Tier.DISK


def h(*xs: int) -> tuple[BlockHash, ...]:
    return tuple(BlockHash(x) for x in xs)


def stored(*xs: int, tier: Tier = GPU) -> BlockStored:
    return BlockStored(h(*xs), None, tier, 32)


def removed(*xs: int, tier: Tier = GPU) -> BlockRemoved:
    return BlockRemoved(h(*xs), tier)


def snap(worker: str, *events: KvEvent, seq: int = 1, epoch: str = "e1") -> KvEventBatch:
    return KvEventBatch(worker, epoch, seq, events, snapshot=True)


def batch(worker: str, seq: int, *events: KvEvent, epoch: str = "e1") -> KvEventBatch:
    return KvEventBatch(worker, epoch, seq, events)


def index_with(held: dict[str, Sequence[KvEvent]], **cfg: int) -> KvIndex:
    ix = KvIndex(IndexConfig(**cfg))  # type: ignore[arg-type]
    for wid, events in held.items():
        assert ix.apply(snap(wid, *events)) is ApplyResult.SNAPSHOT_APPLIED
    return ix


def blocks(ix: KvIndex, query: Sequence[int], workers: Iterable[WorkerId] | None = None):
    return {w: m.blocks for w, m in ix.match(h(*query), workers).items()}


# ---- contiguous prefix semantics -----------------------------------------------------------
PREFIX_CASES = [
    pytest.param({"a": [stored(1, 2, 3)]}, [1, 2, 3], {A: 3}, id="full-hit"),
    pytest.param({"a": [stored(1, 2, 3)]}, [1, 2, 3, 4, 5], {A: 3}, id="prompt-longer"),
    pytest.param({"a": [stored(1, 2, 3, 4)]}, [1, 2], {A: 2}, id="prompt-shorter"),
    pytest.param({"a": [stored(1, 3, 4)]}, [1, 2, 3, 4], {A: 1}, id="hole-breaks-prefix"),
    pytest.param({"a": [stored(2, 3)]}, [1, 2, 3], {}, id="first-block-missing-omitted"),
    pytest.param({"a": [stored(1, 2)]}, [], {}, id="empty-prompt"),
    pytest.param(
        {"a": [stored(1, 2, 3)], "b": [stored(1, 2)], "c": [stored(1)]},
        [1, 2, 3],
        {A: 3, B: 2, C: 1},
        id="three-lengths",
    ),
    pytest.param(
        {"a": [stored(1, 2, 9)], "b": [stored(1, 2, 3)]}, [1, 2, 3], {B: 3, A: 2}, id="diverge"
    ),
    pytest.param(
        {"a": [stored(1), stored(2, tier=CPU), stored(3, tier=DISK)]},
        [1, 2, 3],
        {A: 3},
        id="prefix-across-tiers",
    ),
    pytest.param({"a": [stored(5, 5, 5)]}, [5, 5, 5, 6], {A: 3}, id="repeated-hash"),
]


@pytest.mark.parametrize(("held", "query", "want"), PREFIX_CASES)
def test_contiguous_prefix(held, query, want):
    ix = index_with(held)
    got = ix.match(h(*query))
    assert {w: m.blocks for w, m in got.items()} == want
    assert list(got) == sorted(want, key=lambda w: (-want[w], w))  # longest first


def test_match_filters_workers_and_ignores_unknown_ids():
    ix = index_with({"a": [stored(1, 2)], "b": [stored(1, 2, 3)]})
    assert blocks(ix, [1, 2, 3], [A]) == {A: 2}
    assert blocks(ix, [1, 2, 3], [WorkerId("zz"), A, A]) == {A: 2}
    assert blocks(ix, [1, 2, 3], []) == {}
    assert blocks(ix, [1, 2, 3]) == {B: 3, A: 2}


# ---- tiers ----------------------------------------------------------------------------------
TIER_CASES = [
    pytest.param([stored(1, 2)], (2, 0, 0), id="gpu"),
    pytest.param([stored(1, 2, tier=CPU)], (0, 2, 0), id="cpu"),
    pytest.param([stored(1, 2, tier=DISK)], (0, 0, 2), id="disk"),
    pytest.param([stored(1, 2), stored(1, 2, tier=CPU)], (2, 0, 0), id="gpu-and-cpu-counts-gpu"),
    pytest.param([stored(1, 2, tier=DISK), stored(1, tier=CPU)], (0, 1, 1), id="cpu-beats-disk"),
    pytest.param(
        [stored(1, 2, 3, tier=DISK), stored(2, tier=CPU), stored(3)], (1, 1, 1), id="one-each"
    ),
    pytest.param([stored(1, 2, 3), stored(1, 2, 3, tier=CPU), removed(2)], (2, 1, 0), id="demoted"),
]


@pytest.mark.parametrize(("events", "want"), TIER_CASES)
def test_best_tier_per_matched_block(events, want):
    ix = index_with({"a": events, "b": [stored(1, 2, 3, tier=DISK)]})
    m = ix.match(h(1, 2, 3))[A]
    assert (m.gpu_blocks, m.cpu_blocks, m.disk_blocks) == want
    assert m.blocks == sum(want) and m.exact
    assert m.on(GPU) == want[0] and m.on(CPU) == want[1] and m.on(DISK) == want[2]
    assert ix.match(h(1, 2, 3))[B] == PrefixMatch(B, 3, 0, 0, 3, True)


def test_tier_counts_with_workers_dropping_out_along_the_prompt():
    ix = index_with(
        {
            "a": [stored(1, 2, 3, 4), stored(3, 4, tier=CPU)],
            "b": [stored(1, 2, 3, tier=CPU), stored(1, tier=DISK)],
            "c": [stored(1, tier=DISK), stored(2)],
        }
    )
    got = ix.match(h(1, 2, 3, 4))
    assert got[A] == PrefixMatch(A, 4, 4, 0, 0, True)
    assert got[B] == PrefixMatch(B, 3, 0, 3, 0, True)
    assert got[C] == PrefixMatch(C, 2, 1, 0, 1, True)


def test_view_counts_blocks_per_tier():
    ix = index_with({"a": [stored(1, 2, 3), stored(2, 3, tier=CPU), stored(9, tier=DISK)]})
    v = ix.view(A)
    assert (v.state, v.epoch, v.seq) == (ViewState.EXACT, "e1", 1)
    assert (v.gpu_blocks, v.cpu_blocks, v.disk_blocks) == (3, 2, 1)
    assert v.on(CPU) == 2
    u = ix.view(B)
    assert (u.state, u.epoch, u.seq, u.gpu_blocks) == (ViewState.UNKNOWN, None, 0, 0)


# ---- batch ordering -------------------------------------------------------------------------
AR = ApplyResult
ORDER_CASES = [
    pytest.param(
        [snap("a", stored(1)), batch("a", 2, stored(2)), batch("a", 3, stored(3))],
        [AR.SNAPSHOT_APPLIED, AR.APPLIED, AR.APPLIED],
        ViewState.EXACT,
        3,
        {A: 3},
        id="in-order",
    ),
    pytest.param(
        [snap("a", stored(1)), batch("a", 3, stored(2))],
        [AR.SNAPSHOT_APPLIED, AR.GAP],
        ViewState.DEGRADED,
        1,
        {A: 1},
        id="gap-not-applied",
    ),
    pytest.param(
        [
            snap("a", stored(1)),
            batch("a", 3, stored(2)),
            batch("a", 4, stored(2)),
            snap("a", stored(1, 2, 3), seq=4),
        ],
        [AR.SNAPSHOT_APPLIED, AR.GAP, AR.GAP, AR.SNAPSHOT_APPLIED],
        ViewState.EXACT,
        4,
        {A: 3},
        id="gap-then-snapshot-resyncs",
    ),
    pytest.param(
        [
            snap("a", stored(1)),
            batch("a", 3, stored(3)),
            batch("a", 2, stored(2)),
            batch("a", 3, stored(3)),
        ],
        [AR.SNAPSHOT_APPLIED, AR.GAP, AR.APPLIED, AR.APPLIED],
        ViewState.EXACT,
        3,
        {A: 3},
        id="gap-then-replay-of-missing-seqs",
    ),
    pytest.param(
        [
            snap("a", stored(1)),
            batch("a", 2, stored(2)),
            batch("a", 2, removed(1)),
            batch("a", 1, removed(1)),
        ],
        [AR.SNAPSHOT_APPLIED, AR.APPLIED, AR.STALE, AR.STALE],
        ViewState.EXACT,
        2,
        {A: 2},
        id="stale-duplicates-ignored",
    ),
    pytest.param(
        [snap("a", stored(1, 2), seq=5), snap("a", stored(7), seq=3)],
        [AR.SNAPSHOT_APPLIED, AR.STALE],
        ViewState.EXACT,
        5,
        {A: 2},
        id="older-snapshot-ignored",
    ),
    pytest.param(
        [
            snap("a", stored(1, 2), seq=5),
            batch("a", 1, stored(1), epoch="e2"),
            batch("a", 2, stored(2), epoch="e2"),
        ],
        [AR.SNAPSHOT_APPLIED, AR.NEW_EPOCH, AR.APPLIED],
        ViewState.DEGRADED,
        2,
        {A: 2},
        id="new-epoch-drops-then-best-effort",
    ),
    pytest.param(
        [snap("a", stored(1, 2), seq=5), batch("a", 7, stored(5), epoch="e2")],
        [AR.SNAPSHOT_APPLIED, AR.NEW_EPOCH],
        ViewState.DEGRADED,
        7,
        {},
        id="new-epoch-old-blocks-gone",
    ),
    pytest.param(
        [batch("a", 1, stored(1, 2)), snap("a", stored(1, 2, 3), seq=1)],
        [AR.NEW_EPOCH, AR.SNAPSHOT_APPLIED],
        ViewState.EXACT,
        1,
        {A: 3},
        id="unknown-worker-then-snapshot",
    ),
    pytest.param(
        [snap("a", stored(1, 2), seq=5), snap("a", stored(1), seq=2, epoch="e2")],
        [AR.SNAPSHOT_APPLIED, AR.SNAPSHOT_APPLIED],
        ViewState.EXACT,
        2,
        {A: 1},
        id="snapshot-of-new-epoch",
    ),
]


@pytest.mark.parametrize(("batches", "results", "state", "seq", "want"), ORDER_CASES)
def test_batch_ordering(batches, results, state, seq, want):
    ix = KvIndex()
    assert [ix.apply(b) for b in batches] == results
    v = ix.view(A)
    assert (v.state, v.seq) == (state, seq)
    assert blocks(ix, [1, 2, 3]) == want
    ix.check_invariants()


def test_needs_resync():
    assert {r for r in ApplyResult if r.needs_resync} == {AR.GAP, AR.NEW_EPOCH}


def test_mark_degraded_then_resumed_stream_is_exact_again():
    ix = index_with({"a": [stored(1)]})
    ix.mark_degraded(A)
    ix.mark_degraded(B)  # unknown: no-op
    assert ix.view(A).state is ViewState.DEGRADED and ix.view(B).state is ViewState.UNKNOWN
    assert ix.match(h(1))[A].exact is False
    assert ix.apply(batch("a", 2, stored(2))) is AR.APPLIED
    assert ix.view(A).state is ViewState.EXACT and ix.match(h(1, 2))[A] == PrefixMatch(
        A, 2, 2, 0, 0, True
    )


# ---- workers leaving, clears ----------------------------------------------------------------
def test_drop_worker_and_slot_reuse_leaks_nothing():
    ix = index_with({"a": [stored(1, 2, 3), stored(4, tier=CPU)], "b": [stored(1)]})
    assert ix.drop_worker(A) is True and ix.drop_worker(A) is False
    assert blocks(ix, [1, 2, 3]) == {B: 1}
    assert ix.view(A).state is ViewState.UNKNOWN and ix.workers() == (B,)
    ix.check_invariants()
    assert ix.sweep() == 0
    assert ix.stats().blocks == 1  # only b's block is left
    ix.apply(snap("c", stored(9)))  # takes a's old slot: must not inherit its blocks
    assert blocks(ix, [1, 2, 3]) == {B: 1} and blocks(ix, [4]) == {} and blocks(ix, [9]) == {C: 1}
    ix.check_invariants()


CLEAR_CASES = [
    pytest.param(GPU, {1: (0, 1, 0), 2: (0, 0, 1), 3: None}, (0, 1, 1), id="gpu"),
    pytest.param(CPU, {1: (1, 0, 0), 2: (1, 0, 0), 3: (1, 0, 0)}, (3, 0, 1), id="cpu"),
    pytest.param(DISK, {1: (1, 0, 0), 2: (1, 0, 0), 3: (1, 0, 0)}, (3, 1, 0), id="disk"),
    pytest.param(None, {1: None, 2: None, 3: None}, (0, 0, 0), id="all-tiers"),
]


@pytest.mark.parametrize(("tier", "per_block", "counts"), CLEAR_CASES)
def test_all_blocks_cleared(tier, per_block, counts):
    ix = index_with(
        {"a": [stored(1, 2, 3), stored(1, tier=CPU), stored(2, tier=DISK)], "b": [stored(1, 2, 3)]}
    )
    assert ix.apply(batch("a", 2, AllBlocksCleared(tier))) is AR.APPLIED
    for blk, want in per_block.items():
        m = ix.match(h(blk), [A]).get(A)
        assert (m and (m.gpu_blocks, m.cpu_blocks, m.disk_blocks)) == want, blk
    v = ix.view(A)
    assert (v.gpu_blocks, v.cpu_blocks, v.disk_blocks) == counts
    assert blocks(ix, [1, 2, 3], [B]) == {B: 3}  # other workers untouched
    ix.check_invariants()
    # Blocks stored after the clear, in the same batch or later, count.
    ix.apply(batch("a", 3, AllBlocksCleared(tier), stored(7, tier=tier or GPU)))
    assert blocks(ix, [7]) == {A: 1}
    ix.check_invariants()


# ---- memory bound ---------------------------------------------------------------------------
def test_max_blocks_drops_least_recently_stored():
    ix = KvIndex(IndexConfig(max_blocks=10, evict_fraction=0.2))
    ix.apply(snap("a", stored(*range(1, 9))))  # 8 blocks: 1..8
    ix.apply(snap("b", stored(1)))  # b stores block 1: it becomes the most recent
    ix.apply(batch("a", 2, stored(11, 12, 13)))  # 11 blocks > 10: drop 3 (down to 8)
    st = ix.stats()
    assert st.blocks == 8 and st.evicted_blocks == 3
    assert blocks(ix, [1]) == {A: 1, B: 1}  # refreshed by b, kept
    assert blocks(ix, [2]) == blocks(ix, [3]) == blocks(ix, [4]) == {}
    assert blocks(ix, [5, 6, 7, 8]) == {A: 4} and blocks(ix, [13]) == {A: 1}
    assert ix.view(A).gpu_blocks == 8 and ix.view(B).gpu_blocks == 1
    ix.check_invariants()


def test_max_blocks_holds_during_one_long_event():
    ix = KvIndex(IndexConfig(max_blocks=100, evict_fraction=0.1))
    ix.apply(snap("a", stored(*range(1, 1001))))
    st = ix.stats()
    assert st.blocks <= 100 and st.evicted_blocks == 1000 - st.blocks
    assert blocks(ix, [1000]) == {A: 1} and blocks(ix, [1]) == {}
    ix.check_invariants()


def test_stats():
    ix = index_with({"a": [stored(1, 2), stored(2, tier=CPU)], "b": [stored(1)]})
    st = ix.stats()
    assert (st.workers, st.blocks, st.entries, st.evicted_blocks, st.sweep_pending) == (
        2,
        2,
        4,
        0,
        0,
    )
    assert st.estimated_bytes > 0


@pytest.mark.parametrize(
    "kwargs",
    [
        pytest.param({"max_blocks": 0}, id="max_blocks"),
        pytest.param({"evict_fraction": 0.0}, id="evict_fraction-zero"),
        pytest.param({"evict_fraction": 1.5}, id="evict_fraction-big"),
        pytest.param({"sweep_keys_per_apply": 0}, id="sweep"),
        pytest.param({"intern_values": -1}, id="intern"),
    ],
)
def test_config_rejects_bad_values(kwargs):
    with pytest.raises(ValueError, match=f"^{next(iter(kwargs))} must be"):
        IndexConfig(**kwargs)


# ---- properties against a naive model -------------------------------------------------------
TIERS = (GPU, CPU, DISK)
WORKERS = ("a", "b", "c", "d")
STORES = ("n1/k", "n2/k")  # node stores: a kvmanager's blocks of one layout
HOLDERS = WORKERS + STORES
hashes_st = st.lists(st.integers(0, 11).map(BlockHash), min_size=1, max_size=6)
event_st = st.one_of(
    st.builds(lambda hs, t: BlockStored(tuple(hs), None, t), hashes_st, st.sampled_from(TIERS)),
    st.builds(lambda hs, t: BlockRemoved(tuple(hs), t), hashes_st, st.sampled_from(TIERS)),
    st.builds(AllBlocksCleared, st.sampled_from((*TIERS, None))),
)
events_st = st.lists(event_st, min_size=1, max_size=3).map(tuple)
op_st = st.one_of(
    st.tuples(st.just("batch"), st.sampled_from(HOLDERS), events_st),
    st.tuples(st.just("snapshot"), st.sampled_from(HOLDERS), events_st),
    st.tuples(st.just("new_epoch"), st.sampled_from(HOLDERS), events_st),
    st.tuples(st.just("drop"), st.sampled_from(HOLDERS), st.just(())),
    st.tuples(st.just("sweep"), st.sampled_from(WORKERS), st.just(())),
    st.tuples(st.just("link"), st.sampled_from(WORKERS), st.sampled_from((*STORES, None))),
)
query_st = st.lists(st.integers(0, 11).map(BlockHash), max_size=8)


@dataclass
class Model:
    """The obvious implementation: per holder (worker or store), per tier, a set of hashes; a
    worker's tiers in a match are its own united with its linked store's."""

    held: dict[str, dict[Tier, set[int]]] = field(default_factory=dict)
    epoch: dict[str, int] = field(default_factory=dict)
    seq: dict[str, int] = field(default_factory=dict)
    links: dict[str, str] = field(default_factory=dict)
    synced: dict[str, bool] = field(default_factory=dict)  # view EXACT (a snapshot applied)

    def exact(self, wid: str) -> bool:
        store = self.links.get(wid, "")
        return self.synced[wid] and (store not in self.held or self.synced[store])

    def tiers_of(self, wid: str) -> dict[Tier, set[int]] | None:
        own = self.held.get(wid)
        store = self.held.get(self.links.get(wid, ""))
        if own is None or store is None:
            return own
        return {t: own[t] | store[t] for t in TIERS}

    def apply(self, wid: str, events: Iterable[KvEvent]) -> None:
        tiers = self.held.setdefault(wid, {t: set() for t in TIERS})
        for ev in events:
            if isinstance(ev, BlockStored):
                tiers[ev.tier].update(ev.block_hashes)
            elif isinstance(ev, BlockRemoved):
                tiers[ev.tier].difference_update(ev.block_hashes)
            else:
                for t in TIERS if ev.tier is None else (ev.tier,):
                    tiers[t].clear()

    def match(self, query: Sequence[int], workers: Iterable[str]) -> dict[str, tuple[int, ...]]:
        out = {}
        for wid in workers:
            tiers = self.tiers_of(wid)
            if tiers is None:
                continue
            per_tier = [0, 0, 0]
            n = 0
            for blk in query:
                best = next((i for i, t in enumerate(TIERS) if blk in tiers[t]), None)
                if best is None:
                    break
                per_tier[best] += 1
                n += 1
            if n:
                out[wid] = (n, *per_tier)
        return out


def apply_to(ix: KvIndex, hid: str, b: KvEventBatch) -> ApplyResult:
    if hid in STORES:  # a kvmanager's stream: worker_id is the kvmanager's, not the store's
        kvm = KvEventBatch(hid.split("/")[0], b.epoch, b.seq, b.events, b.snapshot)
        return ix.apply_store(StoreId(hid), kvm)
    return ix.apply(b)


def run_ops(ix: KvIndex, model: Model, ops) -> None:
    for kind, wid, events in ops:
        if kind == "link":
            ix.link(WorkerId(wid), None if events is None else StoreId(events))
            if events is None:
                model.links.pop(wid, None)
            else:
                model.links[wid] = events
            continue
        if kind == "drop":
            if wid in STORES:
                ix.drop_store(StoreId(wid))
            else:
                ix.drop_worker(WorkerId(wid))
                model.links.pop(wid, None)
            model.held.pop(wid, None)
            model.epoch.pop(wid, None)
            continue
        if kind == "sweep":
            ix.sweep(3)
            continue
        if kind == "batch" and wid in model.epoch:
            model.seq[wid] += 1
            b = KvEventBatch(wid, f"e{model.epoch[wid]}", model.seq[wid], events)
            assert apply_to(ix, wid, b) is ApplyResult.APPLIED
        else:  # snapshot, or a new epoch (also what a first non-snapshot batch is)
            model.epoch[wid] = model.epoch.get(wid, 0) + 1
            model.seq[wid] = 1
            model.held.pop(wid, None)
            stored_only = tuple(e for e in events if isinstance(e, BlockStored))
            is_snap = kind == "snapshot"
            model.synced[wid] = is_snap
            b = KvEventBatch(
                wid, f"e{model.epoch[wid]}", 1, stored_only if is_snap else events, is_snap
            )
            want = ApplyResult.SNAPSHOT_APPLIED if is_snap else ApplyResult.NEW_EPOCH
            assert apply_to(ix, wid, b) is want
            events = b.events
        model.apply(wid, events)


def as_tuples(got: dict[WorkerId, PrefixMatch]) -> dict[str, tuple[int, ...]]:
    return {w: (m.blocks, m.gpu_blocks, m.cpu_blocks, m.disk_blocks) for w, m in got.items()}


links_st = st.dictionaries(st.sampled_from(WORKERS), st.sampled_from(STORES)).map(
    lambda d: [("link", w, s) for w, s in d.items()]
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    links=links_st,
    ops=st.lists(op_st, max_size=25),
    queries=st.lists(query_st, min_size=1, max_size=5),
    subset=st.sets(st.sampled_from(WORKERS)),
)
def test_property_agrees_with_naive_model(links, ops, queries, subset):
    ix = KvIndex(IndexConfig(sweep_keys_per_apply=2))
    model = Model()
    run_ops(ix, model, links + ops)
    ix.check_invariants()
    for q in queries:
        assert as_tuples(ix.match(q)) == model.match(q, WORKERS)
        assert as_tuples(ix.match(q, map(WorkerId, subset))) == model.match(q, subset)
        assert as_tuples(ix.match(q, map(WorkerId, STORES))) == {}  # stores never match
        assert {w: m.exact for w, m in ix.match(q).items()} == {
            w: model.exact(w) for w in model.match(q, WORKERS)
        }
    assert ix.workers() == tuple(w for w in WORKERS if w in model.held)
    assert ix.stores() == tuple(s for s in STORES if s in model.held)
    for wid in HOLDERS:  # no negative counts; no entries for holders that hold nothing
        v = ix.view(WorkerId(wid))
        tiers = model.held.get(wid)
        assert (v.gpu_blocks, v.cpu_blocks, v.disk_blocks) == (
            tuple(len(tiers[t]) for t in TIERS) if tiers else (0, 0, 0)
        )
    ix.sweep()
    ix.check_invariants()
    held_anywhere = {x for tiers in model.held.values() for s in tiers.values() for x in s}
    assert ix.stats().blocks == len(held_anywhere)
    assert ix.stats().entries == sum(len(s) for t in model.held.values() for s in t.values())


@settings(max_examples=200, deadline=None)
@given(
    links=links_st,
    ops=st.lists(op_st, max_size=25),
    queries=st.lists(query_st, min_size=1, max_size=5),
)
def test_property_bounded_index_never_overclaims(links, ops, queries):
    ix = KvIndex(IndexConfig(max_blocks=5, evict_fraction=0.4, sweep_keys_per_apply=1))
    model = Model()
    run_ops(ix, model, links + ops)
    ix.check_invariants()
    assert ix.stats().blocks <= 5
    for q in queries:
        want = model.match(q, WORKERS)
        for wid, (n, *_tiers) in as_tuples(ix.match(q)).items():
            assert wid in want and n <= want[wid][0]  # an evicted block only shortens a match
    for wid in HOLDERS:
        v = ix.view(WorkerId(wid))
        tiers = model.held.get(wid)
        for i, t in enumerate(TIERS):
            assert 0 <= v.on(t) <= (len(tiers[t]) if tiers else 0), (wid, i)


def test_mark_live_restores_a_synced_view_only():
    index = KvIndex()
    index.apply(KvEventBatch("a", "e", 3, (), snapshot=True))
    index.mark_degraded(WorkerId("a"))
    assert index.view(WorkerId("a")).state is ViewState.DEGRADED
    index.mark_live(WorkerId("a"))
    assert index.view(WorkerId("a")).state is ViewState.EXACT
    index.apply(KvEventBatch("b", "e", 1, ()))  # never had a snapshot
    index.mark_live(WorkerId("b"))
    assert index.view(WorkerId("b")).state is ViewState.DEGRADED
