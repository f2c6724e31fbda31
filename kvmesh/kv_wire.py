"""The KV wire formats, both directions: kvmesh.kv.events values <-> kvmesh.v1 messages and
the initial metadata of ``Worker.WatchKvEvents`` (the worker encodes, the router decodes); KV
layouts (kvmesh.kv.layout) <-> messages (the connector encodes, the kvmanager decodes). One
module for both sides, so they cannot drift apart."""

from __future__ import annotations

from kvmesh.kv.events import (
    AllBlocksCleared,
    BlockHash,
    BlockRemoved,
    BlockStored,
    KvEvent,
    KvEventBatch,
    Tier,
)
from kvmesh.kv.layout import KvLayout
from kvmesh.v1 import kvmanager_pb2, worker_pb2

# WatchKvEvents initial metadata: the log's epoch and last seq when the stream started, and
# whether the stream resumes the asked epoch ("1") or starts with a snapshot ("0").
KV_EPOCH_KEY = "kvmesh-kv-epoch"
KV_SEQ_KEY = "kvmesh-kv-seq"
KV_RESUMED_KEY = "kvmesh-kv-resumed"

TIER_PB = {
    Tier.GPU: worker_pb2.KV_TIER_GPU,
    Tier.CPU: worker_pb2.KV_TIER_CPU,
    Tier.DISK: worker_pb2.KV_TIER_DISK,
}


def kv_event_to_pb(ev: KvEvent) -> worker_pb2.KvEvent:
    if isinstance(ev, BlockStored):
        stored = worker_pb2.BlockStored(
            block_hashes=ev.block_hashes, tier=TIER_PB[ev.tier], block_size=ev.block_size
        )
        if ev.parent_hash is not None:
            stored.parent_hash = ev.parent_hash
        return worker_pb2.KvEvent(stored=stored)
    if isinstance(ev, BlockRemoved):
        removed = worker_pb2.BlockRemoved(block_hashes=ev.block_hashes, tier=TIER_PB[ev.tier])
        return worker_pb2.KvEvent(removed=removed)
    if isinstance(ev, AllBlocksCleared):
        tier = worker_pb2.KV_TIER_UNSPECIFIED if ev.tier is None else TIER_PB[ev.tier]
        return worker_pb2.KvEvent(cleared=worker_pb2.AllBlocksCleared(tier=tier))
    raise TypeError(f"not a KV event: {ev!r}")


def kv_batch_to_pb(b: KvEventBatch) -> worker_pb2.KvEventBatch:
    return worker_pb2.KvEventBatch(
        worker_id=b.worker_id,
        epoch=b.epoch,
        seq=b.seq,
        events=[kv_event_to_pb(ev) for ev in b.events],
        snapshot=b.snapshot,
    )


TIER_OF: dict[int, Tier] = {
    worker_pb2.KV_TIER_GPU: Tier.GPU,
    worker_pb2.KV_TIER_CPU: Tier.CPU,
    worker_pb2.KV_TIER_DISK: Tier.DISK,
}


# ---- protobuf -> values ----------------------------------------------------------------------
def _tier(value: int) -> Tier:
    # Stored/removed always carry a tier; proto3's default (unspecified) reads as the engine's.
    return TIER_OF.get(value, Tier.GPU)


def kv_event_from_pb(msg: worker_pb2.KvEvent) -> KvEvent | None:
    kind = msg.WhichOneof("event")
    if kind == "stored":
        s = msg.stored
        parent = BlockHash(s.parent_hash) if s.HasField("parent_hash") else None
        hashes = tuple(BlockHash(h) for h in s.block_hashes)
        return BlockStored(hashes, parent, _tier(s.tier), s.block_size)
    if kind == "removed":
        r = msg.removed
        return BlockRemoved(tuple(BlockHash(h) for h in r.block_hashes), _tier(r.tier))
    if kind == "cleared":
        return AllBlocksCleared(TIER_OF.get(msg.cleared.tier))
    return None  # an event kind newer than this router: skipped


def kv_batch_from_pb(msg: worker_pb2.KvEventBatch) -> KvEventBatch:
    events = (kv_event_from_pb(e) for e in msg.events)
    return KvEventBatch(
        worker_id=msg.worker_id,
        epoch=msg.epoch,
        seq=msg.seq,
        events=tuple(e for e in events if e is not None),
        snapshot=msg.snapshot,
    )


def layout_from_pb(msg: kvmanager_pb2.KvLayout) -> KvLayout:
    """The core value of a layout message (BadLayout, an INVALID_ARGUMENT, names what is wrong)."""
    return KvLayout(
        model=msg.model,
        block_size=msg.block_size,
        num_layers=msg.num_layers,
        num_kv_heads=msg.num_kv_heads,
        head_size=msg.head_size,
        dtype=msg.dtype,
        tp_rank=msg.tp_rank,
        tp_size=msg.tp_size or 1,
        device=msg.device,
    )


def layout_to_pb(layout: KvLayout) -> kvmanager_pb2.KvLayout:
    return kvmanager_pb2.KvLayout(
        model=layout.model,
        block_size=layout.block_size,
        num_layers=layout.num_layers,
        num_kv_heads=layout.num_kv_heads,
        head_size=layout.head_size,
        dtype=layout.dtype,
        tp_rank=layout.tp_rank,
        tp_size=layout.tp_size,
        device=layout.device,
    )
