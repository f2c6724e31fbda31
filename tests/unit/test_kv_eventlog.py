"""The worker-side KV event log: numbering, snapshots, resume."""

from __future__ import annotations

from kvmesh.kv.eventlog import KvEventLog
from kvmesh.kv.events import AllBlocksCleared, BlockHash, BlockRemoved, BlockStored, Tier


def h(*xs: int) -> tuple[BlockHash, ...]:
    return tuple(BlockHash(x) for x in xs)


def test_batches_are_numbered_and_empty_steps_skipped():
    log = KvEventLog("w", "e1")
    assert log.append([]) is None
    b1 = log.append([BlockStored(h(1, 2), None, block_size=32)])
    b2 = log.append([BlockRemoved(h(2))])
    assert (b1.seq, b2.seq, log.seq) == (1, 2, 2)
    assert b1.worker_id == "w" and b1.epoch == "e1" and not b1.snapshot


def test_snapshot_lists_what_is_held_parents_first():
    log = KvEventLog("w", "e1")
    log.append([BlockStored(h(1, 2, 3), None, block_size=32)])
    log.append([BlockStored(h(4), BlockHash(3), block_size=32), BlockRemoved(h(2))])
    log.append([BlockStored(h(9), None, tier=Tier.CPU, block_size=32)])
    snap = log.snapshot()
    assert snap.snapshot and snap.seq == 3
    assert [(e.block_hashes, e.parent_hash, e.tier) for e in snap.events] == [
        (h(1), None, Tier.GPU),
        (h(3, 4), 2, Tier.GPU),  # a run of chained blocks travels as one event
        (h(9), None, Tier.CPU),
    ]
    log.append([AllBlocksCleared(Tier.GPU)])
    assert [e.block_hashes for e in log.snapshot().events] == [h(9)]
    log.append([AllBlocksCleared()])
    assert log.snapshot().events == ()


def test_resume_from_buffer_or_ask_for_a_snapshot():
    log = KvEventLog("w", "e1", buffer_batches=3)
    for i in range(5):
        log.append([BlockStored(h(i), None)])
    assert [b.seq for b in log.since("e1", 4)] == [4, 5]
    assert log.since("e1", 6) == []  # up to date
    assert log.since("e1", 2) is None  # fell out of the buffer
    assert log.since("e1", 7) is None  # from the future
    assert log.since("e0", 4) is None  # another engine instance
    assert log.since("e1", 0) is None
