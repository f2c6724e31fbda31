"""Session prefetch, the pure part (``core/prefetch.py``): which retained blocks a prefetch brings
from disk into RAM (the chain's leading run, first blocks first, within the RAM cap) and what the
call reports once its promotions end; and the plan read off a real ``TierIndex`` whose retained
RAM copies were written back to disk under pressure."""

from __future__ import annotations

import pytest

from kvmesh.errors import InvalidArgument
from kvmesh.kv.events import BlockHash, Tier
from kvmesh.kv.layout import KvLayout
from services.kvmanager.core.plan import BlockId
from services.kvmanager.core.prefetch import (
    PrefetchPlan,
    Promotion,
    outcome,
    plan_prefetch,
    ram_cap_bytes,
)
from services.kvmanager.core.tiers import TierIndex
from tests.unit.test_kvmanager_retention import put_under_pressure

A = KvLayout("a", 1, 1, 1, 1, "float16")  # 4-byte blocks
CPU, DISK = Tier.CPU, Tier.DISK
C, D, N = CPU, DISK, None  # where each block of a chain is


def bid(h: int) -> BlockId:
    return BlockId(A.key, BlockHash(h))


def plan(where: list[Tier | None], max_blocks: int) -> PrefetchPlan:
    chain = [bid(i) for i in range(len(where))]
    return plan_prefetch(chain, lambda b: where[b.block_hash], 4, max_blocks * 4)


@pytest.mark.parametrize(
    ("where", "max_blocks", "promote", "in_cpu", "on_disk", "missing"),
    [
        ([D, D, D], 8, [0, 1, 2], 0, 0, 0),
        ([C, D, C, D], 8, [1, 3], 2, 0, 0),
        ([C, C, C], 8, [], 3, 0, 0),
        # The chain stops at its first block held nowhere: what follows is no prefix.
        ([D, N, D, C], 8, [0], 0, 0, 3),
        ([N, D], 8, [], 0, 0, 2),
        # The cap counts the run's RAM footprint: blocks there already, then those promoted.
        ([C, D, D, D], 3, [1, 2], 1, 1, 0),
        ([D, D, D, D], 0, [], 0, 4, 0),
        # Past the cap, later disk blocks stay on disk even if a RAM block came between.
        ([D, D, C, D], 1, [0], 1, 2, 0),
        ([], 8, [], 0, 0, 0),
    ],
    ids=[
        "all-on-disk",
        "mixed",
        "all-in-ram",
        "gap-ends-chain",
        "first-missing",
        "cap",
        "zero-cap",
        "cap-then-ram",
        "empty",
    ],
)
def test_plan(
    where: list[Tier | None],
    max_blocks: int,
    promote: list[int],
    in_cpu: int,
    on_disk: int,
    missing: int,
) -> None:
    got = plan(where, max_blocks)
    assert got == PrefetchPlan(tuple(bid(i) for i in promote), in_cpu, on_disk, missing)
    assert len(got.promote) + got.in_cpu + got.on_disk + got.missing == len(where)


def test_plan_rejects_bad_sizes() -> None:
    with pytest.raises(InvalidArgument, match="block_bytes"):
        plan_prefetch([bid(1)], lambda _b: DISK, 0, 100)
    with pytest.raises(InvalidArgument, match="max_bytes"):
        plan_prefetch([bid(1)], lambda _b: DISK, 4, -1)


def test_ram_cap_is_half_the_tier() -> None:
    assert ram_cap_bytes(1000) == 500
    assert ram_cap_bytes(0) == 0


P, IN, NR, M = Promotion.PROMOTED, Promotion.IN_CPU, Promotion.NO_ROOM, Promotion.MISSING


@pytest.mark.parametrize(
    ("ended", "promoted", "in_cpu", "on_disk", "missing", "done"),
    [
        ([P, P, P], 3, 1, 1, 2, True),
        # Another reader promoted one meanwhile: it is in RAM all the same.
        ([P, IN, P], 2, 2, 1, 2, True),
        ([P, NR, P], 2, 1, 2, 2, False),
        ([P, M, P], 2, 1, 1, 3, False),
        # The deadline passed with one still under way: on disk for now.
        ([P, P], 2, 1, 2, 2, False),
        ([], 0, 1, 4, 2, False),
    ],
    ids=["all", "other-reader", "no-room", "gone", "deadline", "none-ended"],
)
def test_outcome(
    ended: list[Promotion], promoted: int, in_cpu: int, on_disk: int, missing: int, done: bool
) -> None:
    p = PrefetchPlan((bid(1), bid(2), bid(3)), in_cpu=1, on_disk=1, missing=2)
    got = outcome(p, ended)
    assert (got.retained, got.promoted, got.in_cpu, got.on_disk, got.missing, got.done) == (
        7,
        promoted,
        in_cpu,
        on_disk,
        missing,
        done,
    )


def test_outcome_with_nothing_planned_is_done() -> None:
    got = outcome(PrefetchPlan((), in_cpu=3, on_disk=0, missing=0), [])
    assert got.done and got.retained == 3


def test_outcome_rejects_more_ended_than_planned() -> None:
    with pytest.raises(InvalidArgument):
        outcome(PrefetchPlan((bid(1),), 0, 0, 0), [P, P])


def test_plan_from_a_tier_index_after_retained_blocks_were_demoted() -> None:
    """Two retained sessions' chains in a 4-block RAM tier: the older one's copies were written
    back to disk to make room for the newer one's; the plan promotes exactly those."""
    idx = TierIndex(cpu_bytes=16, disk_bytes=64)
    for h in (1, 2, 3, 4, 5, 6, 7, 8):
        idx.retain(bid(h))
    for h in (1, 2, 3, 4, 5, 6, 7, 8):
        put_under_pressure(idx, h)
    idx.check_invariants()
    older = [bid(h) for h in (1, 2, 3, 4)]
    assert [idx.tier_of(b) for b in older] == [DISK] * 4
    assert [idx.tier_of(bid(h)) for h in (5, 6, 7, 8)] == [CPU] * 4
    got = plan_prefetch(older, idx.tier_of, 4, ram_cap_bytes(16))
    assert got == PrefetchPlan((bid(1), bid(2)), in_cpu=0, on_disk=2, missing=0)
