"""Session prefetch: which of a retained session's blocks to bring from disk into RAM before its
next turn reads them (docs/agents.md#prefetch). Pure, synchronous and deterministic: the store
asks where each block is and carries the plan out.

The session's chain is read in order: a turn loads a prefix, so the plan stops at the chain's
first block held nowhere (what follows it is of no use to the next turn) and promotes the disk
blocks of the leading run, first ones first, while the run's RAM footprint (its blocks in RAM
already plus those promoted) stays within ``max_bytes``: a prefetch makes room in RAM by pushing
other blocks out, so it is bounded to leave the tier room to turn over.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import StrEnum

from kvmesh.errors import InvalidArgument
from kvmesh.kv.events import Tier

from .plan import BlockId

# The share of the RAM tier one session's prefetched run may fill.
MAX_RAM_SHARE = 0.5


class Promotion(StrEnum):
    """What one block's promotion came to."""

    PROMOTED = "promoted"  # read from disk into RAM now
    IN_CPU = "in_cpu"  # in RAM already (or being written there)
    NO_ROOM = "no_room"  # RAM refused it (pinned full) or it was leaving: left on disk
    MISSING = "missing"  # held nowhere (gone meanwhile, or its file was bad)


@dataclass(frozen=True, slots=True)
class PrefetchPlan:
    promote: tuple[BlockId, ...]  # disk blocks to bring into RAM, in chain order
    in_cpu: int  # blocks of the leading run in RAM already
    on_disk: int  # disk blocks of the leading run not promoted (past max_bytes)
    missing: int  # blocks from the chain's first one held nowhere to its end


def plan_prefetch(
    chain: Sequence[BlockId],
    tier_of: Callable[[BlockId], Tier | None],
    block_bytes: int,
    max_bytes: int,
) -> PrefetchPlan:
    """The plan for ``chain`` (the session's retained blocks, in order); ``tier_of``: the
    fastest tier holding a readable copy of a block (None: none)."""
    if block_bytes < 1:
        raise InvalidArgument(f"block_bytes must be >= 1, got {block_bytes}")
    if max_bytes < 0:
        raise InvalidArgument(f"max_bytes must be >= 0, got {max_bytes}")
    promote: list[BlockId] = []
    in_cpu = on_disk = 0
    for i, block in enumerate(chain):
        tier = tier_of(block)
        if tier is None:
            return PrefetchPlan(tuple(promote), in_cpu, on_disk, len(chain) - i)
        if tier is Tier.CPU:
            in_cpu += 1
        elif (in_cpu + len(promote) + 1) * block_bytes <= max_bytes and not on_disk:
            promote.append(block)
        else:
            on_disk += 1
    return PrefetchPlan(tuple(promote), in_cpu, on_disk, 0)


def ram_cap_bytes(cpu_budget_bytes: int) -> int:
    """How much of the RAM tier one session's prefetched run may fill."""
    return int(cpu_budget_bytes * MAX_RAM_SHARE)


@dataclass(frozen=True, slots=True)
class PrefetchResult:
    """Where a session's retained chain stands after a prefetch (by its deadline)."""

    retained: int  # the chain's blocks
    in_cpu: int  # in RAM already, or put there meanwhile by another reader
    promoted: int  # brought from disk into RAM by this prefetch
    on_disk: int  # left on disk: past max_bytes, no room, or still under way
    missing: int  # held nowhere: from the chain's first gap on, or gone meanwhile
    done: bool  # every block the plan meant to bring into RAM is there


def outcome(plan: PrefetchPlan, ended: Sequence[Promotion]) -> PrefetchResult:
    """The result of ``plan`` given the promotions that ended by the deadline (the others are
    still under way: on disk for now)."""
    counts = {p: 0 for p in Promotion}
    for got in ended:
        counts[got] += 1
    under_way = len(plan.promote) - len(ended)
    if under_way < 0:
        raise InvalidArgument(f"{len(ended)} promotions ended of {len(plan.promote)} planned")
    return PrefetchResult(
        retained=len(plan.promote) + plan.in_cpu + plan.on_disk + plan.missing,
        in_cpu=plan.in_cpu + counts[Promotion.IN_CPU],
        promoted=counts[Promotion.PROMOTED],
        on_disk=plan.on_disk + counts[Promotion.NO_ROOM] + under_way,
        missing=plan.missing + counts[Promotion.MISSING],
        done=under_way == 0 and counts[Promotion.NO_ROOM] + counts[Promotion.MISSING] == 0,
    )
