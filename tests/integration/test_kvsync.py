"""The router's KV event subscriber against a real worker gRPC server (``start_worker``) whose
engine is a stub that only emits KV events: snapshot first, live batches in order, resume after
a cut connection without a snapshot, a snapshot after a worker restart (new epoch) and when the
index asks for one, a slow subscriber cut off and resuming, and the worker set's changes."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field

import grpc
import pytest

from kvmesh.discovery.keys import WorkerId, WorkerRecord
from kvmesh.kv.events import BlockHash, BlockStored, KvEventBatch, Tier
from kvmesh.v1 import worker_pb2, worker_pb2_grpc
from services.router.core.workers import Change
from services.router.kvsync import KvEventSubscriber, KvEventSync
from services.worker.config import WorkerConfig
from services.worker.core import EngineInfo, EngineLoad, KvEventSink
from services.worker.server import RunningWorker, start_worker
from tests.integration.conftest import TcpProxy
from tests.support import eventually

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]


class EventsOnlyEngine:
    """Just enough of an ``Engine`` to serve KV events; ``emit`` plays an engine step."""

    info = EngineInfo("stub", "/nonexistent", 128, 32, 100)

    def __init__(self) -> None:
        self.sink: KvEventSink | None = None
        self._next = 1

    def add_load_listener(self, listener: Callable[[], None]) -> None:
        pass

    def load(self) -> EngineLoad:
        return EngineLoad()

    def is_running(self, request_id: str) -> bool:
        return False

    def set_kv_event_sink(self, sink: KvEventSink) -> None:
        self.sink = sink

    def emit(self, n_blocks: int = 1) -> list[BlockHash]:
        hashes = [BlockHash(self._next + i) for i in range(n_blocks)]
        self._next += n_blocks
        assert self.sink is not None
        self.sink([BlockStored(tuple(hashes), None, Tier.GPU, 32)])
        return hashes

    async def close(self) -> None:
        pass


@dataclass
class Index:
    """Records what the subscriber hands over; ``resync_next`` makes on_batch ask for a
    snapshot once."""

    batches: list[KvEventBatch] = field(default_factory=list)
    events: list[str] = field(default_factory=list)  # "batch", "live", "lost" in order
    resync_next: bool = False

    def on_batch(self, batch: KvEventBatch) -> bool:
        self.batches.append(batch)
        self.events.append("snapshot" if batch.snapshot else f"batch {batch.seq}")
        resync, self.resync_next = self.resync_next, False
        return resync

    def on_live(self, wid: WorkerId) -> None:
        self.events.append("live")

    def on_lost(self, wid: WorkerId) -> None:
        self.events.append("lost")

    def held(self) -> set[int]:
        out: set[int] = set()
        for b in self.batches:
            if b.snapshot:
                out.clear()
            for ev in b.events:
                out.update(getattr(ev, "block_hashes", ()))
        return out


@pytest.fixture
async def worker() -> AsyncIterator[tuple[RunningWorker, EventsOnlyEngine]]:
    engine = EventsOnlyEngine()
    w = await start_worker(WorkerConfig(worker_id="kv-w", drain_grace_s=0.1), engine)
    yield w, engine
    await w.stop()


def subscriber(address: str, index: Index, backoff: Sequence[float] = (0.05,)):
    return KvEventSubscriber(
        WorkerId("kv-w"),
        address,
        index.on_batch,
        on_lost=index.on_lost,
        on_live=index.on_live,
        backoff_s=backoff,
    )


async def test_snapshot_first_then_live_batches(worker):
    w, engine = worker
    before = engine.emit(3)
    index = Index()
    sub = subscriber(w.address, index)
    sub.start()
    try:
        await eventually(lambda: "live" in index.events)
        assert index.events == ["snapshot", "live"]
        snap = index.batches[0]
        assert (snap.worker_id, snap.epoch, snap.seq) == ("kv-w", w.kv_events.log.epoch, 1)
        assert index.held() == set(before)
        for _ in range(3):
            engine.emit()
        await eventually(lambda: len(index.batches) == 4)
        assert [b.seq for b in index.batches[1:]] == [2, 3, 4]
        assert sub.stats.last_seq == 4 and sub.stats.blocks_stored == 6
        assert sub.stats.live and sub.stats.snapshots == 1
    finally:
        await sub.close()


async def test_resumes_after_a_cut_connection_without_a_snapshot(worker):
    w, engine = worker
    proxy = TcpProxy("127.0.0.1", w.port)
    await proxy.start()
    index = Index()
    sub = subscriber(proxy.endpoint, index)
    sub.start()
    try:
        engine.emit()
        await eventually(lambda: index.held() == {1})
        await proxy.cut()
        await eventually(lambda: "lost" in index.events)
        missed = engine.emit(2) + engine.emit()  # seq 2 and 3, while nobody listens
        await proxy.resume()
        await eventually(lambda: len(index.batches) >= 3 and index.events[-1] == "live")
        assert [b.snapshot for b in index.batches] == [True, False, False]
        assert [b.seq for b in index.batches[1:]] == [2, 3]
        assert index.held() == {1, *missed}
        assert index.events[-4:] == ["lost", "batch 2", "batch 3", "live"]
        assert sub.stats.reconnects >= 1 and sub.stats.lost == 1
    finally:
        await sub.close()
        await proxy.close()


async def test_resume_with_nothing_missed_is_live_at_once(worker):
    w, engine = worker
    proxy = TcpProxy("127.0.0.1", w.port)
    await proxy.start()
    index = Index()
    sub = subscriber(proxy.endpoint, index)
    sub.start()
    try:
        engine.emit()
        await eventually(lambda: index.held() == {1})
        await proxy.cut()
        await eventually(lambda: "lost" in index.events)
        await proxy.resume()
        await eventually(lambda: index.events[-1] == "live")
        assert len(index.batches) == 1  # nothing re-sent
    finally:
        await sub.close()
        await proxy.close()


async def test_index_asking_for_a_resync_gets_a_snapshot(worker):
    w, engine = worker
    index = Index()
    sub = subscriber(w.address, index)
    sub.start()
    try:
        await eventually(lambda: "live" in index.events)
        index.resync_next = True
        engine.emit()
        await eventually(lambda: len(index.batches) == 3)
        assert [b.snapshot for b in index.batches] == [True, False, True]
        assert index.batches[2].seq == 1 and index.held() == {1}
        assert sub.stats.resyncs == 1
        assert index.events == ["snapshot", "live", "batch 1", "snapshot", "live"]
    finally:
        await sub.close()


async def test_restarted_worker_new_epoch_gets_a_snapshot(worker):
    w, engine = worker
    index = Index()
    sub = subscriber(w.address, index)
    sub.start()
    try:
        engine.emit(2)
        await eventually(lambda: index.held() == {1, 2})
        old_epoch = w.kv_events.log.epoch
        await w.stop()
        engine2 = EventsOnlyEngine()
        w2 = await start_worker(WorkerConfig(worker_id="kv-w", port=w.port), engine2)
        try:
            new_epoch = w2.kv_events.log.epoch
            await eventually(lambda: index.batches[-1].epoch == new_epoch)
            assert index.batches[-1].snapshot and new_epoch != old_epoch
            assert index.held() == set()  # the new engine holds nothing yet
            engine2.emit()
            await eventually(lambda: index.held() == {1})
        finally:
            await w2.stop()
    finally:
        await sub.close()


async def test_slow_subscriber_is_cut_and_resumes(worker):
    w, engine = worker
    w.kv_events.queue_batches = 2
    index = Index()
    sub = subscriber(w.address, index)
    sub.start()
    try:
        await eventually(lambda: "live" in index.events)
        hashes = [h for _ in range(20) for h in engine.emit()]  # no await: it cannot keep up
        assert w.kv_events.cut_off == 1
        await eventually(lambda: index.held() == set(hashes))
        assert [b.seq for b in index.batches[1:]] == list(range(1, 21))
        assert sub.stats.snapshots == 1  # resumed from the worker's buffer
    finally:
        await sub.close()


async def test_sync_follows_the_worker_set(worker):
    w, engine = worker
    index = Index()
    sync = KvEventSync(index.on_batch, index.on_lost, index.on_live, backoff_s=(0.05,))
    rec = WorkerRecord(
        worker_id=WorkerId("kv-w"),
        address=w.address,
        model="stub",
        model_path="/nonexistent",
        max_model_len=128,
        block_size=32,
        vocab_size=100,
    )
    try:
        sync.apply(Change(added=(rec,)))
        sync.apply(Change(updated=(rec,)))  # same address: the stream stays
        await eventually(lambda: "live" in index.events)
        engine.emit()
        await eventually(lambda: index.held() == {1})
        assert sync.stats()[WorkerId("kv-w")].last_seq == 1
        sync.apply(Change(removed=(WorkerId("kv-w"),)))
        await eventually(lambda: w.kv_events.subscribers == 0)
        assert sync.stats() == {}
    finally:
        await sync.close()


async def test_snapshot_over_the_send_limit_is_resource_exhausted():
    engine = EventsOnlyEngine()
    w = await start_worker(
        WorkerConfig(worker_id="kv-w", max_request_bytes=1024, kv_snapshot_max_bytes=1024), engine
    )
    try:
        for _ in range(100):
            engine.emit()  # 100 unchained roots: ~25 bytes each
        async with grpc.aio.insecure_channel(w.address) as channel:
            stub = worker_pb2_grpc.WorkerStub(channel)
            call = stub.WatchKvEvents(worker_pb2.WatchKvEventsRequest())
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await call.read()
        assert err.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "kv_snapshot_max_bytes" in err.value.details()
    finally:
        await w.stop()
