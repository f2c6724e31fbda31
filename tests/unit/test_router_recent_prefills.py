"""The prompts workers computed moments ago (``services/router/core/recent_prefills.py``), and
the peer hint they give a sibling before the KV index hears of them (``core/peers.py``)."""

from __future__ import annotations

import pytest

from kvmesh.discovery.keys import WorkerId
from kvmesh.errors import InvalidArgument
from kvmesh.kv.events import BlockHash, BlockStored, KvEventBatch, Tier
from services.router.core.index import KvIndex, store_id
from services.router.core.peers import PeerChoice, PeerHints
from services.router.core.recent_prefills import RecentPrefills, RecentPrefillsConfig
from services.router.core.types import PeerHint

A, B, C = WorkerId("a"), WorkerId("b"), WorkerId("c")
L1 = "00112233aabbccdd"
KB = store_id("kvm-b", L1)


def h(*xs: int) -> list[BlockHash]:
    return [BlockHash(x) for x in xs]


PROMPT = h(*range(1, 21))


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_held_is_the_leading_run_a_listed_worker_computed():
    r = RecentPrefills()
    r.computed(PROMPT[:12], A)
    assert r.held(PROMPT, {A}) == 12
    assert r.held(PROMPT, {B}) == 0
    # A shorter prefix of it is known at the kept points only (every 16th block): a lower bound.
    assert r.held(PROMPT[:5], {A, B}) == 1
    long = h(*range(101, 141))
    r.computed(long, B)  # 40 blocks: kept 0, 16, 32 and 39
    assert r.held(long, {B}) == 40
    assert r.held([*long, *h(500, 501)], {B}) == 40  # a longer prompt: its first 40
    assert r.held(long[:20], {B}) == 17
    assert r.held(h(99, *range(2, 21)), {A}) == 0  # another first block: another prompt
    assert r.held([], {A}) == 0
    r.computed(PROMPT[:4], B)  # b computed the first 4 since: they count for b now
    assert r.held(PROMPT, {B}) == 4


def test_entries_expire_after_ttl_and_generations_bound_the_size():
    clock = Clock()
    r = RecentPrefills(RecentPrefillsConfig(ttl_s=2.0, max_blocks=6), clock)
    r.computed(PROMPT, A)
    clock.t += 1.9
    assert r.held(PROMPT, {A}) == 20
    clock.t += 0.2
    assert r.held(PROMPT, {A}) == 0
    for i in range(10):  # 10 prompts of 20 blocks, each kept as 3 (blocks 0, 16, 19): at most
        r.computed(h(*range(1000 * i, 1000 * i + 20)), A)  # two generations of 3 are kept
        assert len(r) <= 6
    assert r.held(h(*range(9000, 9020)), {A}) == 20
    assert r.held(h(*range(0, 20)), {A}) == 0  # the oldest went first
    off = RecentPrefills(RecentPrefillsConfig(ttl_s=0))
    off.computed(PROMPT, A)
    assert off.held(PROMPT, {A}) == 0 and len(off) == 0
    for bad in ({"ttl_s": -1}, {"ttl_s": 61}, {"max_blocks": 0}):
        with pytest.raises(InvalidArgument):
            RecentPrefillsConfig(**bad)  # type: ignore[arg-type]


def test_a_sibling_that_just_computed_the_prompt_is_waited_for_before_the_index_knows():
    """b and c share node store kvm-b; c computed the prompt a moment ago, and neither its KV
    events nor the store's have reached the index: b's request waits for c's save."""
    ix = KvIndex()
    for w in (B, C):
        ix.apply(KvEventBatch(w, "e1", 1, (), snapshot=True))
        ix.link(w, KB)
    ix.apply_store(KB, KvEventBatch("kvm-b", "e1", 1, (), snapshot=True))
    recent = RecentPrefills()
    peers = PeerHints(ix, recent=recent)
    assert peers.decide(PROMPT, B) == PeerChoice(store_blocks=0)  # nothing known: skip lookup
    peers.computed(PROMPT, C)
    choice = peers.decide(PROMPT, B)
    assert choice == PeerChoice(
        PeerHint("kvm-b", 20, 0, max_fetch_s=0.25, wait_s=0.25), store_blocks=None
    )
    assert peers.decide(PROMPT, C).hint is None  # c itself: its own prefix cache
    ix.apply_store(  # the save landed and the store said so: nothing left to wait for
        KB,
        KvEventBatch("kvm-b", "e1", 2, (BlockStored(tuple(PROMPT), None, Tier.CPU, 16),)),
    )
    assert peers.decide(PROMPT, B) == PeerChoice(store_blocks=20)
