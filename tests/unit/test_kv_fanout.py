"""The worker's KV event fan-out: snapshot or resume first, live batches in order to every
subscriber, a slow subscriber cut off without holding anyone back, and the protobuf round trip
between the worker's servicer and the router's subscriber."""

from __future__ import annotations

import asyncio

import pytest

from kvmesh import errors
from kvmesh.kv.eventlog import KvEventLog
from kvmesh.kv.events import (
    AllBlocksCleared,
    BlockHash,
    BlockRemoved,
    BlockStored,
    KvEventBatch,
    Tier,
)
from kvmesh.kv.fanout import KvEventHub
from kvmesh.kv_wire import kv_batch_from_pb, kv_batch_to_pb


def h(*xs: int) -> tuple[BlockHash, ...]:
    return tuple(BlockHash(x) for x in xs)


def stored(*xs: int, parent: int | None = None) -> BlockStored:
    return BlockStored(h(*xs), None if parent is None else BlockHash(parent), Tier.GPU, 32)


def hub(queue_batches: int = 8, buffer_batches: int = 64) -> KvEventHub:
    return KvEventHub(KvEventLog("w", "e1", buffer_batches), queue_batches)


async def test_fresh_subscriber_gets_a_snapshot_then_live_batches():
    hb = hub()
    hb.publish([stored(1, 2)])
    sub = hb.subscribe("", 0)
    assert not sub.resumed
    (snap,) = sub.initial
    assert snap.snapshot and snap.seq == 1 and snap.events == (stored(1, 2),)
    hb.publish([stored(3, parent=2)])
    hb.publish([])  # an empty step makes no batch
    hb.publish([BlockRemoved(h(1))])
    assert [(await sub.next()).seq for _ in range(2)] == [2, 3]
    sub.close()
    assert hb.subscribers == 0


@pytest.mark.parametrize(
    ("epoch", "from_seq", "resumed", "first_seqs"),
    [
        pytest.param("e1", 2, True, [2, 3], id="resume-missed"),
        pytest.param("e1", 4, True, [], id="resume-up-to-date"),
        pytest.param("e0", 2, False, [3], id="unknown-epoch-snapshot"),
        pytest.param("e1", 9, False, [3], id="future-seq-snapshot"),
        pytest.param("", 2, False, [3], id="empty-epoch-snapshot"),
    ],
)
def test_resume_or_snapshot(epoch, from_seq, resumed, first_seqs):
    hb = hub()
    for i in range(3):
        hb.publish([stored(10 + i)])
    sub = hb.subscribe(epoch, from_seq)
    assert sub.resumed is resumed
    assert [b.seq for b in sub.initial] == first_seqs
    assert all(b.snapshot is not resumed for b in sub.initial)


def test_resume_beyond_the_buffer_gets_a_snapshot():
    hb = hub(buffer_batches=2)
    for i in range(5):
        hb.publish([stored(10 + i)])
    sub = hb.subscribe("e1", 2)
    assert not sub.resumed and sub.initial[0].snapshot
    assert [e.block_hashes for e in sub.initial[0].events] == [h(10 + i) for i in range(5)]


async def test_many_subscribers_each_get_every_batch():
    hb = hub()
    subs = [hb.subscribe("", 0) for _ in range(5)]
    for i in range(4):
        hb.publish([stored(100 + i)])
    for sub in subs:
        assert [(await sub.next()).seq for _ in range(4)] == [1, 2, 3, 4]


async def test_slow_subscriber_is_cut_off_and_others_are_not_held_back():
    hb = hub(queue_batches=3)
    slow, fast = hb.subscribe("", 0), hb.subscribe("", 0)
    seen: list[int] = []
    for i in range(5):
        hb.publish([stored(200 + i)])  # never waits, whatever the subscribers do
        seen.append((await fast.next()).seq)
    assert seen == [1, 2, 3, 4, 5]
    assert hb.subscribers == 1 and hb.cut_off == 1
    with pytest.raises(errors.ResourceExhausted, match="more than 3 batches behind"):
        await slow.next()
    # It resumes where it was, from the log's buffer: no snapshot needed.
    again = hb.subscribe("e1", 1)
    assert again.resumed and [b.seq for b in again.initial] == [1, 2, 3, 4, 5]


async def test_close_ends_streams_after_what_is_queued():
    hb = hub()
    sub = hb.subscribe("", 0)
    hb.publish([stored(1)])
    waiter = asyncio.create_task(sub.next())
    hb.publish([stored(2)])
    assert (await waiter).seq == 1
    hb.close()
    assert (await sub.next()).seq == 2
    assert await sub.next() is None
    late = hb.subscribe("", 0)
    assert late.initial[0].snapshot and await late.next() is None


BATCHES = [
    pytest.param(KvEventBatch("w", "e", 1, (stored(1, 2, 3),)), id="root-chain"),
    pytest.param(
        KvEventBatch("w", "e", 7, (stored(4, parent=3), BlockRemoved(h(1), Tier.GPU))),
        id="child-and-removal",
    ),
    pytest.param(
        KvEventBatch("w", "e", 9, (BlockStored(h(2**64 - 1), BlockHash(0), Tier.DISK, 16),)),
        id="extreme-hashes-zero-parent",
    ),
    pytest.param(
        KvEventBatch("w", "e", 3, (AllBlocksCleared(), AllBlocksCleared(Tier.CPU))),
        id="cleared",
    ),
    pytest.param(KvEventBatch("w", "e", 5, (stored(8), stored(9)), snapshot=True), id="snapshot"),
    pytest.param(KvEventBatch("w", "e", 0, (), snapshot=True), id="empty-snapshot"),
]


@pytest.mark.parametrize("batch", BATCHES)
def test_protobuf_round_trip(batch: KvEventBatch):
    msg = kv_batch_to_pb(batch)
    assert kv_batch_from_pb(type(msg).FromString(msg.SerializeToString())) == batch


def test_snapshot_bytes_per_block():
    """What ``kv_snapshot_max_bytes`` is sized from: chained runs ~8 bytes per block, single
    unchained blocks ~30."""
    chained = KvEventBatch("w", "e", 1, (stored(*range(2**63, 2**63 + 1000)),), snapshot=True)
    single = KvEventBatch(
        "w", "e", 1, tuple(stored(2**63 + i, parent=2**62 + i) for i in range(1000)), True
    )
    assert kv_batch_to_pb(chained).ByteSize() / 1000 < 8.1
    assert kv_batch_to_pb(single).ByteSize() / 1000 < 32
