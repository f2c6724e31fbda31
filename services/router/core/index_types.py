"""Values of the router's KV block index (``index.py``): its config, what ``apply`` says about a
batch, a worker's view and a prompt's per-worker prefix match. Pure values, no transport."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import NewType

from kvmesh.discovery.keys import WorkerId
from kvmesh.kv.events import Tier

StoreId = NewType("StoreId", str)
"""A node store: one kvmanager's blocks of one KV layout (its own numbered event stream)."""

HolderId = WorkerId | StoreId  # whatever the index keeps a view of


def store_id(kvmanager_id: str, layout_key: str) -> StoreId:
    """The index id of a kvmanager's blocks of one layout. It has a '/', which worker ids (etcd
    key segments) cannot have, so the two never collide."""
    return StoreId(f"{kvmanager_id}/{layout_key}")


def store_parts(store: StoreId) -> tuple[str, str]:
    """(kvmanager id, layout key) of a store id (the inverse of ``store_id``)."""
    kvmanager_id, _, layout_key = store.rpartition("/")
    return kvmanager_id, layout_key


@dataclass(frozen=True, slots=True)
class IndexConfig:
    max_blocks: int = 4_000_000  # distinct block hashes kept (~80 B each: docs/kv-index.md)
    evict_fraction: float = 0.05  # share of max_blocks dropped at once when it is exceeded
    sweep_keys_per_apply: int = 4096  # keys the sweep of retired slots visits per apply() call
    intern_values: int = 65_536  # distinct holder sets shared between blocks (memory saver)

    def __post_init__(self) -> None:
        if self.max_blocks < 1:
            raise ValueError(f"max_blocks must be >= 1, got {self.max_blocks}")
        if not 0.0 < self.evict_fraction <= 1.0:
            raise ValueError(f"evict_fraction must be in (0, 1], got {self.evict_fraction}")
        if self.sweep_keys_per_apply < 1:
            raise ValueError(f"sweep_keys_per_apply must be >= 1, got {self.sweep_keys_per_apply}")
        if self.intern_values < 0:
            raise ValueError(f"intern_values must be >= 0, got {self.intern_values}")


class ApplyResult(StrEnum):
    """What ``KvIndex.apply`` did with one batch."""

    APPLIED = "applied"  # next seq of the epoch: applied
    SNAPSHOT_APPLIED = "snapshot_applied"  # replaced the worker's blocks; view EXACT
    GAP = "gap"  # seq skipped ahead: NOT applied, view DEGRADED (resync or replay the missing seqs)
    NEW_EPOCH = "new_epoch"  # engine restarted (or unknown worker): old blocks dropped, batch
    # applied best effort, view DEGRADED until a snapshot
    STALE = "stale"  # seq already applied (duplicate or replay): ignored

    @property
    def needs_resync(self) -> bool:
        """The subscriber should resubscribe (and so get a snapshot)."""
        return self in (ApplyResult.GAP, ApplyResult.NEW_EPOCH)


class ViewState(StrEnum):
    EXACT = "exact"  # the index holds exactly what the worker held as of its last seq
    DEGRADED = "degraded"  # a gap, restart or lost stream: blocks may be missing or stale
    UNKNOWN = "unknown"  # the index knows nothing of this worker


@dataclass(frozen=True, slots=True)
class WorkerKvView:
    """What the index knows of one worker (or node store): its own blocks, not its store's."""

    worker_id: HolderId
    state: ViewState
    epoch: str | None  # None: unknown worker
    seq: int  # last batch applied (0: none)
    gpu_blocks: int = 0
    cpu_blocks: int = 0
    disk_blocks: int = 0

    def on(self, tier: Tier) -> int:
        """Blocks held on one tier (a block on two tiers counts on both)."""
        return _pick(tier, self.gpu_blocks, self.cpu_blocks, self.disk_blocks)


@dataclass(frozen=True, slots=True)
class PrefixMatch:
    """How much of a prompt's block chain one worker holds.

    ``blocks`` is the contiguous matched prefix: block i counts only if the worker holds blocks
    0..i (on any tier, its own or its node store's). Each matched block is counted once, on its
    best tier (gpu > cpu > disk), so ``gpu_blocks + cpu_blocks + disk_blocks == blocks``."""

    worker_id: WorkerId
    blocks: int
    gpu_blocks: int
    cpu_blocks: int
    disk_blocks: int
    exact: bool  # the worker's view (and its store's) is EXACT (False: a hint)

    def on(self, tier: Tier) -> int:
        return _pick(tier, self.gpu_blocks, self.cpu_blocks, self.disk_blocks)


@dataclass(frozen=True, slots=True)
class StoreMatch:
    """How much of a prompt's block chain one node store (a kvmanager's blocks of one layout)
    holds itself: the contiguous prefix from the first block, on any of its tiers."""

    store: StoreId
    blocks: int
    exact: bool  # the store's view is EXACT (False: a hint)


@dataclass(frozen=True, slots=True)
class IndexStats:
    workers: int  # workers with a view (EXACT or DEGRADED)
    blocks: int  # distinct block hashes in the index (incl. ones awaiting the sweep)
    entries: int  # (worker, tier, block) holdings
    evicted_blocks: int  # dropped by the max_blocks bound since start
    sweep_pending: int  # keys the current sweep still has to visit (0: idle)
    estimated_bytes: int  # the index's own memory (dict, keys, shared values), estimated
    stores: int = 0  # node stores with a view
    links: int = 0  # workers whose lower tiers are a node store's


def _pick(tier: Tier, gpu: int, cpu: int, disk: int) -> int:
    if tier is Tier.GPU:
        return gpu
    if tier is Tier.CPU:
        return cpu
    return disk
