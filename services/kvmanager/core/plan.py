"""Values the tier index hands to its adapter: block ids, what a space request got, the actions the
adapter must carry out, and per-layout KV events. Pure values."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import NamedTuple

from kvmesh.kv.events import BlockHash, KvEvent, Tier


class BlockId(NamedTuple):
    """A block in the store: a hash is only meaningful within one KV layout. A tuple, not a
    dataclass: it keys every dict of the index and the store, and a tuple hashes in C (a
    frozen dataclass's generated ``__hash__`` was the top cost of a put)."""

    layout_key: str
    block_hash: BlockHash


class Grant(StrEnum):
    """What ``TierIndex.request`` got."""

    GRANTED = "granted"  # room is reserved now: write the copy, then call write_done()
    QUEUED = "queued"  # room is being made: wait for Granted(block, tier), or cancel()
    PRESENT = "present"  # the tier holds, writes, or waits to write this block already
    BUSY = "busy"  # the tier's copy of this block is being removed right now; try later
    REFUSED = "refused"  # no room even after evicting everything evictable (or no such tier)


class CopyState(StrEnum):
    """Where one copy of a block on one tier stands."""

    WRITING = "writing"  # room granted, bytes on their way; not readable
    READABLE = "readable"
    DEMOTING = "demoting"  # RAM copy being written back to disk; readable until that ends
    LEAVING = "leaving"  # chosen for removal; gone once its last pin is released


@dataclass(frozen=True, slots=True)
class DropFromMemory:
    """Forget the block's RAM bytes now, before the next await (already unaccounted)."""

    block: BlockId


@dataclass(frozen=True, slots=True)
class WriteToDisk:
    """Demotion: write the block's RAM bytes to its file, then ``write_done(block, DISK, ok)``.
    The RAM copy stays put (and counted) until then."""

    block: BlockId


@dataclass(frozen=True, slots=True)
class DeleteFromDisk:
    """Delete the block's file, then ``deleted(block)`` (its bytes count until then)."""

    block: BlockId


@dataclass(frozen=True, slots=True)
class Granted:
    """A QUEUED request got its room: write the copy, then ``write_done(block, tier, ok)``."""

    block: BlockId
    tier: Tier


Action = DropFromMemory | WriteToDisk | DeleteFromDisk | Granted


@dataclass(frozen=True, slots=True)
class LayoutEvent:
    """A KV event of one layout: feed each layout's events to its own KvEventLog (a hash means
    nothing across layouts, and two layouts may well hold the same hash)."""

    layout_key: str
    event: KvEvent


@dataclass(frozen=True, slots=True)
class TierUsage:
    """One tier's accounting, in bytes. ``used_bytes <= budget_bytes`` always."""

    tier: Tier
    budget_bytes: int
    used_bytes: int  # readable copies + copies being written + copies on their way out
    leaving_bytes: int  # part of used_bytes already chosen for removal or demotion
    queued_bytes: int  # requests waiting for room
    blocks: int  # readable copies
    pinned: int  # copies with at least one reader pin
    pinned_bytes: int  # their bytes: a request larger than budget - pinned_bytes is refused
