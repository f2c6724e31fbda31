"""Session retention: the pure budget and refcount logic (``core/retention.py``) and how the tier
index keeps retained blocks under pressure (``core/tiers.py``): unretained copies go first, a
retained RAM copy is demoted to disk rather than dropped, a retained disk copy stays."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvmesh.errors import InvalidArgument
from kvmesh.kv.events import BlockHash, Tier
from kvmesh.kv.layout import KvLayout
from services.kvmanager.core.config import RetentionConfig, StoreConfig
from services.kvmanager.core.plan import BlockId, DeleteFromDisk, DropFromMemory, Grant, WriteToDisk
from services.kvmanager.core.retention import Retention, SessionKey
from services.kvmanager.core.tiers import TierIndex

A = KvLayout("a", 1, 1, 1, 1, "float16")  # 4-byte blocks
CPU, DISK = Tier.CPU, Tier.DISK


def bid(h: int) -> BlockId:
    return BlockId(A.key, BlockHash(h))


def hashes(*hs: int) -> list[BlockHash]:
    return [BlockHash(h) for h in hs]


def s(name: str, tenant: str = "") -> SessionKey:
    return SessionKey(tenant, name)


class Marks:
    def __init__(self) -> None:
        self.retained: set[BlockId] = set()

    def retention(self, budget: int, tenant_budget: int = 0) -> Retention:
        return Retention(budget, tenant_budget, 600.0, self.retained.add, self.retained.discard)


# ---- Retention (pure) -------------------------------------------------------------------------


def test_pin_renew_replaces_blocks_and_keeps_shared_ones() -> None:
    m = Marks()
    r = m.retention(100)
    got = r.pin(s("x"), A.key, 4, hashes(1, 2), ttl_s=10, now_s=0)
    assert (got.retained_blocks, got.renewed, got.truncated) == (2, False, False)
    got = r.pin(s("x"), A.key, 4, hashes(1, 2, 3), ttl_s=10, now_s=5)
    assert got.renewed and got.previous == (bid(1), bid(2))
    assert m.retained == {bid(1), bid(2), bid(3)} and r.bytes == 12
    r.check_invariants()


def test_ttl_expiry_and_renewal() -> None:
    m = Marks()
    r = m.retention(100)
    r.pin(s("x"), A.key, 4, hashes(1), ttl_s=10, now_s=0)
    r.pin(s("y"), A.key, 4, hashes(2), ttl_s=10, now_s=0)
    r.pin(s("x"), A.key, 4, hashes(1), ttl_s=10, now_s=8)  # renewed: lives to 18
    assert r.expire(12) == [s("y")]
    assert m.retained == {bid(1)}
    assert r.expire(18) == [s("x")] and not m.retained and r.bytes == 0
    assert r.stats.expired == 2


def test_sub_agents_share_the_prefix_counted_once() -> None:
    m = Marks()
    r = m.retention(100)
    r.pin(s("main"), A.key, 4, hashes(1, 2, 3), ttl_s=10, now_s=0)
    r.pin(s("sub"), A.key, 4, hashes(1, 2, 9), ttl_s=10, now_s=0)
    assert r.bytes == 16  # 1, 2, 3, 9
    assert r.end(s("main"))
    assert m.retained == {bid(1), bid(2), bid(9)}
    assert not r.end(s("main"))
    r.check_invariants()


def test_node_budget_releases_least_recently_active_first() -> None:
    m = Marks()
    r = m.retention(16)  # 4 blocks
    r.pin(s("a"), A.key, 4, hashes(1, 2), ttl_s=10, now_s=0)
    r.pin(s("b"), A.key, 4, hashes(3), ttl_s=10, now_s=1)
    r.pin(s("a"), A.key, 4, hashes(1, 2), ttl_s=10, now_s=2)  # a is now the most recent
    got = r.pin(s("c"), A.key, 4, hashes(5, 6), ttl_s=10, now_s=3)
    assert got.released == (s("b"),)
    assert r.blocks_of(s("a")) and not r.blocks_of(s("b"))
    r.check_invariants()


def test_tenant_budget_releases_only_that_tenants_sessions() -> None:
    m = Marks()
    r = m.retention(100, tenant_budget=8)
    r.pin(s("a1", "t1"), A.key, 4, hashes(1, 2), ttl_s=10, now_s=0)
    r.pin(s("b1", "t2"), A.key, 4, hashes(11, 12), ttl_s=10, now_s=1)
    got = r.pin(s("a2", "t1"), A.key, 4, hashes(3), ttl_s=10, now_s=2)
    assert got.released == (s("a1", "t1"),)
    assert r.tenant_bytes("t1") == 4 and r.tenant_bytes("t2") == 8
    r.check_invariants()


def test_a_session_larger_than_the_budget_keeps_its_leading_blocks() -> None:
    m = Marks()
    r = m.retention(12)
    got = r.pin(s("big"), A.key, 4, hashes(1, 2, 3, 4, 5), ttl_s=10, now_s=0)
    assert got.truncated and got.retained_blocks == 3
    assert m.retained == {bid(1), bid(2), bid(3)}


@pytest.mark.parametrize(
    ("key", "ttl", "size"),
    [(s(""), 10.0, 4), (s("x"), 0.0, 4), (s("x"), -1.0, 4), (s("x"), 10.0, 0)],
    ids=["no-session", "zero-ttl", "negative-ttl", "zero-block-bytes"],
)
def test_bad_pins_are_invalid(key: SessionKey, ttl: float, size: int) -> None:
    with pytest.raises(InvalidArgument):
        Retention(100).pin(key, A.key, size, hashes(1), ttl_s=ttl, now_s=0)


def test_ttl_is_capped() -> None:
    r = Retention(100, max_ttl_s=5)
    r.pin(s("x"), A.key, 4, hashes(1), ttl_s=1000, now_s=0)
    assert r.next_expiry_s() == 5


_ops = st.lists(
    st.tuples(
        st.sampled_from(["pin", "end", "expire"]),
        st.integers(0, 5),  # session
        st.integers(0, 2),  # tenant
        st.lists(st.integers(0, 12), max_size=8),  # hashes
        st.floats(0.5, 20),
    ),
    max_size=40,
)


@settings(max_examples=200, deadline=None)
@given(_ops, st.integers(0, 40), st.sampled_from([0, 8, 20]))
def test_budgets_and_refcounts_hold_over_random_sessions(ops, budget, tenant_budget) -> None:  # type: ignore[no-untyped-def]
    m = Marks()
    r = m.retention(budget, tenant_budget)
    now = 0.0
    for op, sess, tenant, hs, t in ops:
        now += 1
        key = s(f"s{sess}", f"t{tenant}")
        if op == "pin":
            r.pin(key, A.key, 4, hashes(*hs), ttl_s=t, now_s=now)
        elif op == "end":
            r.end(key)
        else:
            r.expire(now)
        r.check_invariants()
        assert m.retained == {b for k in [*r._sessions] for b in r.blocks_of(k)}
    r.clear()
    assert not m.retained and r.bytes == 0


# ---- the tier index keeps retained blocks -----------------------------------------------------


def store(index: TierIndex, h: int) -> None:
    assert index.request(A, BlockHash(h), CPU) is Grant.GRANTED
    index.write_done(bid(h), CPU, ok=True)


def put_under_pressure(index: TierIndex, h: int) -> None:
    """A put that makes room; disk writes and deletes it asks for are carried out at once."""
    got = index.request(A, BlockHash(h), CPU)
    for _ in range(10):
        for a in index.take_actions():
            if isinstance(a, WriteToDisk):
                index.write_done(a.block, DISK, ok=True)
            elif isinstance(a, DeleteFromDisk):
                index.deleted(a.block)
            elif hasattr(a, "tier") and a.block == bid(h):
                got = Grant.GRANTED
    assert got is Grant.GRANTED, got
    index.write_done(bid(h), CPU, ok=True)


def test_ram_only_retained_blocks_are_not_evicted() -> None:
    index = TierIndex(cpu_bytes=16)  # 4 blocks
    for h in (1, 2, 3, 4):
        store(index, h)
    index.retain(bid(1))
    index.retain(bid(2))
    for h in (5, 6, 7, 8):
        put_under_pressure(index, h)
    assert index.tier_of(bid(1)) is CPU and index.tier_of(bid(2)) is CPU
    assert index.tier_of(bid(3)) is None
    index.check_invariants()
    index.release(bid(1))
    put_under_pressure(index, 9)
    assert index.tier_of(bid(1)) is None and index.tier_of(bid(2)) is CPU
    index.check_invariants()


def test_retained_ram_copies_go_to_disk_and_stay_there() -> None:
    index = TierIndex(cpu_bytes=8, disk_bytes=16)  # 2 RAM blocks, 4 disk blocks
    store(index, 1)
    store(index, 2)
    index.retain(bid(1))
    index.retain(bid(2))
    for h in range(3, 12):
        put_under_pressure(index, h)
        index.take_events()
    # RAM holds retained blocks only: the oldest was written back to disk, and stays there
    # while unretained disk copies come and go.
    assert index.tier_of(bid(1)) is DISK and index.tier_of(bid(2)) is CPU
    assert index.retained_usage()[DISK] == (1, 4)
    index.check_invariants()
    index.release(bid(1))
    index.release(bid(2))
    for h in range(12, 20):
        put_under_pressure(index, h)
    assert index.tier_of(bid(1)) is None


def test_a_block_retained_before_it_lands_is_kept() -> None:
    index = TierIndex(cpu_bytes=8)
    index.retain(bid(7))
    store(index, 7)
    for h in (1, 2, 3):
        put_under_pressure(index, h)
    assert index.tier_of(bid(7)) is CPU
    assert not any(
        isinstance(a, DropFromMemory) and a.block == bid(7) for a in index.take_actions()
    )
    assert index.known_layout(A.key) == A


@pytest.mark.parametrize(
    ("retention", "store", "budget"),
    [
        (RetentionConfig(), StoreConfig(cpu_bytes=400), 100),
        (RetentionConfig(), StoreConfig(cpu_bytes=400, disk_bytes=4000, disk_dir=Path("/x")), 1000),
        (RetentionConfig(bytes=0), StoreConfig(cpu_bytes=400), 0),
        (RetentionConfig(bytes=200), StoreConfig(cpu_bytes=400), 200),
    ],
    ids=["default-ram", "default-disk", "off", "half"],
)
def test_retention_budget_of_the_store(
    retention: RetentionConfig, store: StoreConfig, budget: int
) -> None:
    assert retention.budget_bytes(store) == budget


def test_a_retention_budget_over_half_its_tier_is_refused() -> None:
    with pytest.raises(InvalidArgument, match="over half"):
        RetentionConfig(bytes=201).budget_bytes(StoreConfig(cpu_bytes=400))
