"""KV events from a real vLLM engine (tiny model, float32, a 64-block KV cache) through the
worker's WatchKvEvents: block hashes exactly as vLLM computes them, numbered batches, snapshots
for fresh subscribers and unknown epochs, resume without a snapshot, evictions as BlockRemoved,
a prefix cache reset as AllBlocksCleared, and the router's subscriber riding out a cut
connection. One engine is shared by the module (its start dominates the runtime)."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from kvmesh.discovery.keys import WorkerId
from kvmesh.kv.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KvEventBatch,
    Tier,
)
from kvmesh.kv_wire import kv_batch_from_pb
from kvmesh.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from services.router.kvsync import KvEventSubscriber
from services.worker.config import EngineConfig, WorkerConfig
from services.worker.main import VLLM_ENVIRONMENT
from tests.integration.conftest import TcpProxy
from tests.support import eventually

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

BLOCK_SIZE = 32
VOCAB_SIZE = 1024
KV_CACHE_BYTES = 2 << 20  # tiny model in float32: 32 KiB per block, so 64 blocks


@dataclass
class Harness:
    worker: object  # services.worker.server.RunningWorker
    engine: object  # services.worker.engine.VllmEngine
    stub: worker_pb2_grpc.WorkerStub
    channel: grpc.aio.Channel


@pytest.fixture(scope="module")
async def h(tiny_model: Path) -> AsyncIterator[Harness]:
    with pytest.MonkeyPatch.context() as mp:
        for key, value in VLLM_ENVIRONMENT.items():
            mp.setenv(key, os.environ.get(key, value))
        from services.worker.engine import VllmEngine
        from services.worker.server import start_worker
        from services.worker.traced import TracedEngine

        config = WorkerConfig(
            engine=EngineConfig(
                model=str(tiny_model),
                served_model_name="tiny",
                dtype="float32",
                max_model_len=1024,
                block_size=BLOCK_SIZE,
                kv_cache_bytes=KV_CACHE_BYTES,
            ),
            worker_id="kv-worker",
            drain_grace_s=2.0,
        )
        engine = await VllmEngine.start(config.engine)
        worker = await start_worker(config, TracedEngine(engine))
        channel = grpc.aio.insecure_channel(worker.address)
        try:
            yield Harness(worker, engine, worker_pb2_grpc.WorkerStub(channel), channel)
        finally:
            await channel.close()
            await worker.stop()
        assert engine.kv_events.stats.lost == 0


def prompt_of(n: int, salt: int) -> list[int]:
    """``n`` token ids unique to ``salt``."""
    return [10 + (salt * 7919 + i * 31 + (i * i) % 7) % (VOCAB_SIZE - 10) for i in range(n)]


async def generate(h: Harness, rid: str, prompt: list[int], max_tokens: int = 1) -> None:
    req = worker_pb2.WorkerGenerateRequest(
        request_id=rid,
        prompt_token_ids=prompt,
        sampling=common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0),
    )
    msgs = [m async for m in h.stub.Generate(req, timeout=60)]
    assert msgs[-1].HasField("finished")


def vllm_block_hashes(prompt: list[int]) -> list[int]:
    """The published (64-bit) hashes of the prompt's full blocks, by vLLM's own functions
    (default algorithm sha256; the engine process derives the same root hash)."""
    from vllm.utils.hashing import sha256
    from vllm.v1.core import kv_cache_utils as kcu

    kcu.init_none_hash(sha256)
    out, parent = [], None
    for i in range(len(prompt) // BLOCK_SIZE):
        parent = kcu.hash_block_tokens(
            sha256, parent, prompt[i * BLOCK_SIZE : (i + 1) * BLOCK_SIZE]
        )
        out.append(int.from_bytes(parent, "big") & (2**64 - 1))
    return out


class Stream:
    """One WatchKvEvents call, read as event values."""

    def __init__(self, h: Harness, epoch: str = "", from_seq: int = 0) -> None:
        self.call = h.stub.WatchKvEvents(
            worker_pb2.WatchKvEventsRequest(epoch=epoch, from_seq=from_seq)
        )
        self.batches: list[KvEventBatch] = []

    async def metadata(self) -> dict[str, str]:
        return {k: v for k, v in await self.call.initial_metadata()}

    async def read(self, timeout_s: float = 20.0) -> KvEventBatch:
        msg = await asyncio.wait_for(self.call.read(), timeout_s)
        assert msg is not grpc.aio.EOF
        batch = kv_batch_from_pb(msg)
        self.batches.append(batch)
        return batch

    async def read_until(self, predicate, timeout_s: float = 20.0) -> list[KvEventBatch]:
        deadline = time.monotonic() + timeout_s
        start = len(self.batches)
        while not predicate(self.batches[start:]):
            await self.read(max(0.1, deadline - time.monotonic()))
        return self.batches[start:]

    def close(self) -> None:
        self.call.cancel()


def stored_hashes(batches: list[KvEventBatch]) -> list[int]:
    return [
        x
        for b in batches
        for ev in b.events
        if isinstance(ev, BlockStored)
        for x in ev.block_hashes
    ]


def removed_hashes(batches: list[KvEventBatch]) -> list[int]:
    return [
        x
        for b in batches
        for ev in b.events
        if isinstance(ev, BlockRemoved)
        for x in ev.block_hashes
    ]


def has_all(expected: list[int]):
    return lambda batches: set(expected) <= set(stored_hashes(batches))


async def test_prompt_blocks_stream_with_vllms_hashes_and_later_subscribers_get_a_snapshot(
    h: Harness,
) -> None:
    first = Stream(h)
    try:
        snap = await first.read()
        assert snap.snapshot and snap.worker_id == "kv-worker"
        assert snap.epoch == h.worker.kv_events.log.epoch
        prompt = prompt_of(4 * BLOCK_SIZE + 12, salt=1)  # 4 full blocks and a partial one
        expected = vllm_block_hashes(prompt)
        await generate(h, "kv-1", prompt)
        live = await first.read_until(has_all(expected))
        assert [b.seq for b in live] == list(range(snap.seq + 1, snap.seq + 1 + len(live)))
        assert all(not b.snapshot and b.epoch == snap.epoch for b in live)
        events = [ev for b in live for ev in b.events if isinstance(ev, BlockStored)]
        assert stored_hashes(live) == expected  # exactly the prompt's full blocks, in order
        assert events[0].parent_hash is None  # the chain starts at the root
        assert all(ev.tier is Tier.GPU and ev.block_size == BLOCK_SIZE for ev in events)

        later = Stream(h)
        try:
            snap2 = await later.read()
            assert snap2.snapshot and snap2.seq == live[-1].seq
            assert set(expected) <= set(stored_hashes([snap2]))
        finally:
            later.close()
    finally:
        first.close()


async def settled(log, quiet_s: float = 0.3, timeout_s: float = 10.0) -> None:  # type: ignore[no-untyped-def]
    """Waits until the event log's sequence number has not moved for ``quiet_s``."""
    deadline = time.monotonic() + timeout_s
    seq, since = log.seq, time.monotonic()
    while time.monotonic() - since < quiet_s:
        assert time.monotonic() < deadline, "the KV event log kept moving"
        await asyncio.sleep(0.02)
        if log.seq != seq:
            seq, since = log.seq, time.monotonic()


async def test_resume_replays_only_the_missed_batches(h: Harness) -> None:
    s = Stream(h)
    snap = await s.read()
    s.close()
    p1, p2 = prompt_of(2 * BLOCK_SIZE + 1, salt=2), prompt_of(3 * BLOCK_SIZE + 1, salt=3)
    await generate(h, "kv-2", p1)
    await generate(h, "kv-3", p2)
    log = h.worker.kv_events.log
    await settled(log)  # vLLM's last KV events may arrive just after the stream ended
    resumed = Stream(h, snap.epoch, snap.seq + 1)
    try:
        md = await resumed.metadata()
        assert md["kvmesh-kv-resumed"] == "1" and md["kvmesh-kv-epoch"] == snap.epoch
        assert int(md["kvmesh-kv-seq"]) == log.seq > snap.seq
        missed = [await resumed.read() for _ in range(log.seq - snap.seq)]
        assert [b.seq for b in missed] == list(range(snap.seq + 1, log.seq + 1))
        assert not any(b.snapshot for b in missed)
        assert stored_hashes(missed) == vllm_block_hashes(p1) + vllm_block_hashes(p2)
    finally:
        resumed.close()


async def test_unknown_epoch_gets_a_snapshot(h: Harness) -> None:
    s = Stream(h, "no-such-epoch", 5)
    try:
        md = await s.metadata()
        assert md["kvmesh-kv-resumed"] == "0"
        batch = await s.read()
        assert batch.snapshot and batch.epoch == h.worker.kv_events.log.epoch
    finally:
        s.close()


async def test_router_subscriber_resumes_after_a_cut_without_a_snapshot(h: Harness) -> None:
    proxy = TcpProxy("127.0.0.1", h.worker.port)
    await proxy.start()
    got: list[KvEventBatch] = []
    lost: list[WorkerId] = []
    sub = KvEventSubscriber(
        WorkerId("kv-worker"),
        proxy.endpoint,
        lambda b: got.append(b) or False,
        on_lost=lost.append,
        backoff_s=(0.05,),
    )
    sub.start()
    try:
        await eventually(lambda: sub.stats.live, 20.0)
        await proxy.cut()
        await eventually(lambda: lost, 20.0)
        prompt = prompt_of(2 * BLOCK_SIZE, salt=4)
        await generate(h, "kv-4", prompt)  # its events wait in the worker's buffer
        await proxy.resume()
        await eventually(lambda: set(vllm_block_hashes(prompt)) <= set(stored_hashes(got)), 20.0)
        assert [b.snapshot for b in got] == [True] + [False] * (len(got) - 1)
        assert [b.seq for b in got[1:]] == list(range(got[0].seq + 1, got[-1].seq + 1))
        assert sub.stats.reconnects >= 1 and sub.stats.snapshots == 1
    finally:
        await sub.close()
        await proxy.close()


async def test_evictions_are_block_removed(h: Harness) -> None:
    s = Stream(h)
    try:
        snap = await s.read()
        held = set(stored_hashes([snap]))
        # 21 full blocks each; the cache has 63 usable blocks, so the 4th prompt evicts.
        prompts = [prompt_of(21 * BLOCK_SIZE + 5, salt=10 + i) for i in range(4)]
        for i, p in enumerate(prompts):
            await generate(h, f"kv-evict-{i}", p)
        everything = [x for p in prompts for x in vllm_block_hashes(p)]
        batches = await s.read_until(lambda bs: set(everything[-21:]) <= set(stored_hashes(bs)))
        removed = removed_hashes(batches)
        assert removed, "a full cache must evict"
        assert set(removed) <= held | set(stored_hashes(batches))  # only blocks it had stored
        assert not set(everything[-21:]) & set(removed)  # the newest prompt's blocks stay
        log = h.worker.kv_events.log
        assert log.held(Tier.GPU) <= KV_CACHE_BYTES // (32 << 10) - 1
    finally:
        s.close()


async def test_prefix_cache_reset_is_all_blocks_cleared(h: Harness) -> None:
    s = Stream(h)
    try:
        snap = await s.read()
        assert stored_hashes([snap])
        assert await h.engine.llm.reset_prefix_cache()
        prompt = prompt_of(BLOCK_SIZE, salt=20)
        await generate(h, "kv-reset", prompt)  # the clear goes out with the next step's events
        await s.read_until(has_all(vllm_block_hashes(prompt)))
        events = [ev for b in s.batches[1:] for ev in b.events]
        assert AllBlocksCleared(Tier.GPU) in events
        later = Stream(h)
        try:
            assert stored_hashes([await later.read()]) == vllm_block_hashes(prompt)
        finally:
            later.close()
    finally:
        s.close()
