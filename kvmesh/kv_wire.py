"""The KV event wire format, both directions: kvmesh.kv.events values <-> kvmesh.v1 messages,
and the initial metadata of ``Worker.WatchKvEvents``. The worker encodes with it and the router
decodes with it, so the two sides cannot drift apart."""

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
from kvmesh.v1 import worker_pb2

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
