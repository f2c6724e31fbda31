"""KV block events, as workers publish them to routers. Pure values (protobuf stays at the edge).

A worker numbers its event batches 1, 2, 3, ... per *epoch* (one engine instance: a restarted
engine starts a new epoch). A subscriber applies batches in order; a batch whose ``seq`` is not
``last + 1`` within the same epoch is a gap, and the subscriber must resync (resubscribe, which
starts with a snapshot). A snapshot batch replaces everything the subscriber held for that worker.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import NewType

BlockHash = NewType("BlockHash", int)
"""A block's hash as vLLM publishes it in KV events: an unsigned 64-bit integer."""


class Tier(StrEnum):
    """Where a block's KV lives, fastest first. The engine's own memory is ``gpu`` (on a CPU
    machine, vLLM's CPU KV cache plays that role); ``cpu`` and ``disk`` are kvmanager tiers."""

    GPU = "gpu"
    CPU = "cpu"
    DISK = "disk"


@dataclass(frozen=True, slots=True)
class BlockStored:
    block_hashes: tuple[BlockHash, ...]  # consecutive blocks of one prefix chain
    parent_hash: BlockHash | None  # the block before the first one; None: chain root
    tier: Tier = Tier.GPU
    block_size: int = 0  # tokens per block


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    block_hashes: tuple[BlockHash, ...]
    tier: Tier = Tier.GPU


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    tier: Tier | None = None  # None: every tier


KvEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True, slots=True)
class KvEventBatch:
    """One step's events from one worker."""

    worker_id: str
    epoch: str  # identifies the engine instance; changes when the engine restarts
    seq: int  # 1, 2, 3, ... within an epoch
    events: tuple[KvEvent, ...]
    snapshot: bool = False  # True: ``events`` are BlockStored of everything held; replace state
