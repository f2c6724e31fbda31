"""The worker's vLLM KV event reader against vLLM's own ZMQ publisher (its class, run in this
process; no engine): what vLLM encodes decodes to our values, events published before the
subscription took effect are replayed (slow joiner), a dropped batch is fetched from the replay
socket, and a batch nobody can replay makes the reader clear the engine's blocks."""

from __future__ import annotations

import asyncio
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from kvmesh.kv.events import AllBlocksCleared, BlockHash, BlockRemoved, BlockStored, KvEvent, Tier
from services.worker.kv_events import VllmKvEvents, events_config

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]


@pytest.fixture
def run_dir() -> Path:
    """Removed by the reader's close(). Not pytest's tmp_path: ipc paths must stay short."""
    return Path(tempfile.mkdtemp(prefix="kvz-"))


@pytest.fixture
async def reader(run_dir: Path) -> AsyncIterator[VllmKvEvents]:
    r = VllmKvEvents(events_config(None, str(run_dir)), str(run_dir), replay_timeout_s=2.0)
    yield r
    await r.close()


@pytest.fixture
def publisher(reader: VllmKvEvents) -> Iterator[object]:
    from vllm.distributed.kv_events import ZmqEventPublisher

    cfg = reader.config
    pub = ZmqEventPublisher(0, cfg["endpoint"], cfg["replay_endpoint"], buffer_steps=100)
    yield pub
    pub.shutdown()


def vllm_batch(*hashes: int, parent: int | None = None, removed: bool = False):
    from vllm.distributed.kv_events import BlockRemoved as VBlockRemoved
    from vllm.distributed.kv_events import BlockStored as VBlockStored
    from vllm.distributed.kv_events import KVEventBatch

    if removed:
        ev = VBlockRemoved(block_hashes=list(hashes), medium="GPU")
    else:
        ev = VBlockStored(
            block_hashes=list(hashes),
            parent_block_hash=parent,
            token_ids=list(range(32 * len(hashes))),
            block_size=32,
            lora_id=None,
            medium="GPU",
            lora_name=None,
        )
    return KVEventBatch(ts=time.time(), events=[ev])


def ours(*hashes: int, parent: int | None = None) -> BlockStored:
    return BlockStored(
        tuple(BlockHash(h) for h in hashes),
        None if parent is None else BlockHash(parent),
        Tier.GPU,
        32,
    )


class Sink:
    def __init__(self) -> None:
        self.batches: list[list[KvEvent]] = []

    def __call__(self, events) -> None:
        self.batches.append(list(events))

    async def wait_for(self, n: int, timeout_s: float = 10.0) -> list[list[KvEvent]]:
        deadline = time.monotonic() + timeout_s
        while len(self.batches) < n:
            assert time.monotonic() < deadline, f"{len(self.batches)} of {n} batches arrived"
            await asyncio.sleep(0.01)
        return self.batches


def _inject_dropped(pub, batch) -> None:
    """A batch vLLM numbered and buffered for replay but whose live message never reached us
    (what a full high-water mark does): take its seq and buffer it, without sending."""
    import msgspec

    seq = next(pub._seq_gen)
    pub._buffer.append((seq, msgspec.msgpack.encode(batch)))


async def test_slow_joiner_batches_are_replayed_then_live_ones_follow(reader, publisher):
    sink = Sink()
    reader.set_sink(sink)
    # Published right away, before the subscription can have reached the publisher.
    publisher.publish(vllm_batch(1, 2))
    publisher.publish(vllm_batch(3, parent=2))
    await reader.start()
    await sink.wait_for(2)
    publisher.publish(vllm_batch(2, removed=True))
    publisher.publish(vllm_batch(2**64 - 1))
    got = await sink.wait_for(4)
    assert got == [
        [ours(1, 2)],
        [ours(3, parent=2)],
        [BlockRemoved((BlockHash(2),), Tier.GPU)],
        [ours(2**64 - 1)],
    ]
    await asyncio.sleep(0.2)
    assert len(sink.batches) == 4  # each seq once, whether it came live, replayed or both
    assert reader.stats.lost == 0 and reader.stats.next_seq == 4


async def test_dropped_batch_is_fetched_from_the_replay_socket(reader, publisher):
    sink = Sink()
    reader.set_sink(sink)
    await reader.start()
    publisher.publish(vllm_batch(10))
    await sink.wait_for(1)
    _inject_dropped(publisher, vllm_batch(11, parent=10))
    publisher.publish(vllm_batch(12, parent=11))
    got = await sink.wait_for(3)
    assert got == [[ours(10)], [ours(11, parent=10)], [ours(12, parent=11)]]
    assert reader.stats.lost == 0 and reader.stats.replayed >= 1


async def test_unreplayable_gap_clears_the_engines_blocks(reader, publisher):
    sink = Sink()
    reader.set_sink(sink)
    await reader.start()
    publisher.publish(vllm_batch(20))
    await sink.wait_for(1)
    next(publisher._seq_gen)  # a seq that was never sent nor buffered
    publisher.publish(vllm_batch(22))
    got = await sink.wait_for(3)
    assert got == [[ours(20)], [AllBlocksCleared(Tier.GPU)], [ours(22)]]
    assert reader.stats.lost == 1


async def test_events_before_the_sink_is_set_are_kept(reader, publisher):
    await reader.start()
    publisher.publish(vllm_batch(30))
    await asyncio.sleep(0.3)
    sink = Sink()
    reader.set_sink(sink)
    publisher.publish(vllm_batch(31, parent=30))
    assert await sink.wait_for(2) == [[ours(30)], [ours(31, parent=30)]]


async def test_close_removes_the_run_dir(run_dir: Path):
    r = VllmKvEvents(events_config(None, str(run_dir)), str(run_dir))
    assert await asyncio.to_thread(run_dir.is_dir)
    await r.close()
    assert not await asyncio.to_thread(run_dir.exists)
