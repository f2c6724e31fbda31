"""The tiered KV store on a real temp directory: round trips, demotion and promotion under
pressure, write-through, restart, corrupt and leftover files, pins, budgets, refusals, and the
KV events it publishes."""

from __future__ import annotations

import asyncio
import dataclasses
import os
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

from kvmesh.kv.eventlog import KvEventLog
from kvmesh.kv.events import BlockHash, BlockRemoved, BlockStored, Tier
from kvmesh.kv.layout import BadBlock, KvLayout
from services.kvmanager import diskfile
from services.kvmanager.core.config import Populate, StoreConfig
from services.kvmanager.core.errors import NotPinned, StoreClosed, StoreFull
from services.kvmanager.core.plan import LayoutEvent
from services.kvmanager.metrics import KvManagerMetrics
from services.kvmanager.store import TieredStore

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

L = KvLayout("tiny", 16, 2, 2, 64, "float16")  # 16 KiB blocks
L2 = dataclasses.replace(L, tp_rank=1, tp_size=2)  # the other rank's shard: another layout
BLOCK = L.block_bytes
FILE = diskfile.file_bytes(BLOCK)
CPU, DISK = Tier.CPU, Tier.DISK
START = Populate.START  # the arena is faulted in before the store opens: slots from the start


def payload(h: int, layout: KvLayout = L) -> bytes:
    return (h.to_bytes(8, "little") + layout.key.encode()) * (layout.block_bytes // 24) + bytes(
        layout.block_bytes % 24
    )


def config(tmp_path: Path, cpu_blocks: int, disk_blocks: int | None, **kw: object) -> StoreConfig:
    return StoreConfig(
        cpu_bytes=cpu_blocks * BLOCK,
        disk_bytes=(disk_blocks or 0) * FILE,
        disk_dir=tmp_path / "kv" if disk_blocks is not None else None,
        **kw,  # type: ignore[arg-type]
    )


def files(cfg: StoreConfig) -> list[Path]:
    assert cfg.disk_dir is not None
    return sorted(cfg.disk_dir.rglob(f"*{diskfile.SUFFIX}"))


def disk_use_bytes(cfg: StoreConfig) -> int:
    """Bytes of the block files on disk now (a file deleted by an I/O thread while we look
    counts 0: it is gone)."""
    total = 0
    for p in files(cfg):
        try:
            size = p.stat().st_size
        except FileNotFoundError:
            continue
        total += diskfile.file_bytes(size - diskfile.HEADER_BYTES)
    return total


def check_budgets(store: TieredStore, cfg: StoreConfig) -> None:
    for tier in (CPU, DISK):
        usage = store.usage(tier)
        assert usage.used_bytes <= usage.budget_bytes, usage
    if cfg.disk_dir is not None:
        assert disk_use_bytes(cfg) <= cfg.disk_bytes


def replay(events: list[LayoutEvent], logs: dict[str, KvEventLog] | None = None) -> dict:
    """{(layout key, tier): {hash: parent}} as a subscriber of per-layout event logs sees it."""
    logs = {} if logs is None else logs
    for le in events:
        logs.setdefault(le.layout_key, KvEventLog("kvm", "e")).append([le.event])
    held: dict[tuple[str, Tier], dict[BlockHash, BlockHash | None]] = {}
    for key, log in logs.items():
        for ev in log.snapshot().events:
            assert isinstance(ev, BlockStored)
            parent = ev.parent_hash
            for h in ev.block_hashes:
                held.setdefault((key, ev.tier), {})[h] = parent
                parent = h
    return held


@pytest.fixture
async def opened() -> AsyncIterator[Callable[[StoreConfig], object]]:
    """Opens stores and closes whatever is still open at the end."""
    stores: list[TieredStore] = []

    async def open_(cfg: StoreConfig) -> TieredStore:
        store = await TieredStore.open(cfg)
        stores.append(store)
        return store

    yield open_
    for store in stores:
        await store.close()


async def put_chain(store: TieredStore, hashes: range, layout: KvLayout = L) -> None:
    for h in hashes:
        assert await store.put(layout, h, payload(h, layout), parent=h - 1 if h else None)


async def test_round_trip_in_ram_with_parents_and_layouts(tmp_path: Path, opened) -> None:
    store = await opened(config(tmp_path, 8, None))
    assert await store.put(L, 0, payload(0))
    assert await store.put(L, 1, bytearray(payload(1)), parent=0)
    assert await store.put(L, 2, memoryview(payload(2)), parent=1)
    assert not await store.put(L, 2, payload(2), parent=1)  # held already
    assert await store.put(L2, 1, payload(1, L2))  # same hash, other rank: another block
    assert [await store.get(L, h) for h in range(3)] == [payload(h) for h in range(3)]
    assert await store.get(L2, 1) == payload(1, L2)
    assert await store.get(L2, 2) is None
    assert store.lookup(L, [0, 1, 2, 3, 1]) == [CPU, CPU, CPU]
    assert store.lookup(L2, [0, 1]) == []
    assert store.contains(L2, 1) and not store.contains(L2, 0)
    assert replay(store.drain_events()) == {
        (L.key, CPU): {0: None, 1: 0, 2: 1},
        (L2.key, CPU): {1: None},
    }
    assert store.stats.hits_cpu == 4 and store.stats.misses == 1


@pytest.mark.parametrize(
    ("layout", "block_hash", "data", "match"),
    [
        pytest.param(L, 1, b"x" * (BLOCK - 1), f"needs {BLOCK}", id="short"),
        pytest.param(L, 1, b"x" * (BLOCK + 2), "block payload is", id="long"),
        pytest.param(L2, 1, b"x" * (BLOCK // 2), "tp=1/2", id="other-layout-size"),
        pytest.param(L, -1, b"x" * BLOCK, "block hash", id="negative-hash"),
        pytest.param(L, 2**64, b"x" * BLOCK, "block hash", id="hash-over-u64"),
    ],
)
async def test_wrong_blocks_are_refused(
    tmp_path: Path, opened, layout: KvLayout, block_hash: int, data: bytes, match: str
) -> None:
    store = await opened(config(tmp_path, 4, 4))
    with pytest.raises(BadBlock, match=match):
        await store.put(layout, block_hash, data)
    assert store.usage(CPU).used_bytes == 0 and store.drain_events() == []


async def test_pressure_demotes_to_disk_and_reads_promote(tmp_path: Path, opened) -> None:
    cfg = config(tmp_path, 2, 8)
    store = await opened(cfg)
    await put_chain(store, range(5))
    await store.wait_idle()
    check_budgets(store, cfg)
    assert store.lookup(L, range(5)) == [DISK, DISK, DISK, CPU, CPU]
    assert len(files(cfg)) == 3 and store.stats.demotions == 3
    assert await store.get(L, 0) == payload(0)  # from disk; RAM is full of dirty blocks
    await store.wait_idle()  # the promotion waited for block 3's write-back
    check_budgets(store, cfg)
    assert store.lookup(L, range(5)) == [CPU, DISK, DISK, DISK, CPU]
    assert store.stats.promotions == 1 and store.stats.hits_disk == 1
    assert replay(store.drain_events()) == {
        (L.key, CPU): {4: 3, 0: None},
        (L.key, DISK): {0: None, 1: 0, 2: 1, 3: 2},
    }
    assert await store.get(L, 0) == payload(0) and store.stats.hits_cpu == 1


async def test_write_through_writes_before_put_returns(tmp_path: Path, opened) -> None:
    cfg = config(tmp_path, 2, 8, write_through=True, fsync=True)
    store = await opened(cfg)
    await put_chain(store, range(3))
    assert len(files(cfg)) == 3 and store.stats.disk_writes == 3
    assert store.lookup(L, range(3)) == [DISK, CPU, CPU]  # block 0 was clean: just dropped
    assert store.stats.demotions == 0
    check_budgets(store, cfg)


async def test_disk_overflow_evicts_least_recently_used(tmp_path: Path, opened) -> None:
    cfg = config(tmp_path, 1, 3)
    store = await opened(cfg)
    await put_chain(store, range(3))  # 0 and 1 demoted, 2 in RAM
    assert await store.get(L, 0) == payload(0)  # disk LRU now 1, 0; 2 is demoted for 0
    await store.wait_idle()
    assert store.lookup(L, range(3)) == [CPU, DISK, DISK]
    await put_chain(store, range(3, 6))
    await store.wait_idle()
    check_budgets(store, cfg)
    assert [h for h in range(6) if store.lookup(L, [h])] == [2, 3, 4, 5]
    assert {p.name for p in files(cfg)} == {f"{h:016x}.kvb" for h in (2, 3, 4)}  # 5: RAM
    removed = [
        (h, le.event.tier)
        for le in store.drain_events()
        if isinstance(le.event, BlockRemoved)
        for h in le.event.block_hashes
    ]
    assert [h for h, tier in removed if tier is DISK] == [1, 0]  # least recently used first


async def test_restart_rebuilds_the_disk_tier(tmp_path: Path, opened) -> None:
    cfg = config(tmp_path, 2, 8)
    store = await opened(cfg)
    await put_chain(store, range(5))
    await put_chain(store, range(2), L2)
    await store.close()
    leftover = files(cfg)[0].with_name(".0000000000000000.123.0.tmp")
    leftover.write_bytes(b"half a block")
    foreign = cfg.disk_dir / "README.txt"  # type: ignore[operator]
    foreign.write_text("not ours")

    store = await opened(cfg)
    assert store.lookup(L, range(5)) == [DISK] * 5  # all demoted to make room for L2's
    assert store.lookup(L2, range(2)) == []  # in RAM only: gone with the process
    assert all([await store.get(L, h) == payload(h) for h in range(5)])
    assert replay(store.drain_events())[(L.key, DISK)] == {0: None, 1: 0, 2: 1, 3: 2, 4: 3}
    assert not leftover.exists() and foreign.read_text() == "not ours"


async def test_restart_with_a_smaller_budget_keeps_the_newest(tmp_path: Path, opened) -> None:
    cfg = config(tmp_path, 1, 8)
    store = await opened(cfg)
    await put_chain(store, range(6))
    await store.close()
    for i, path in enumerate(files(cfg)):  # write times 0 < 1 < ... whatever the clock did
        os.utime(path, ns=(i * 10**9, i * 10**9))
    smaller = dataclasses.replace(cfg, disk_bytes=2 * FILE)
    store = await opened(smaller)
    assert [h for h in range(6) if store.lookup(L, [h])] == [3, 4]
    assert len(files(smaller)) == 2
    check_budgets(store, smaller)


@pytest.mark.parametrize(
    ("damage", "at_start"),
    [
        pytest.param(lambda raw: raw[: len(raw) // 2], True, id="truncated"),
        pytest.param(lambda raw: raw[:10], True, id="short-header"),
        pytest.param(lambda raw: raw + b"x", True, id="trailing-bytes"),
        pytest.param(lambda raw: raw[:20] + bytes([raw[20] ^ 1]) + raw[21:], True, id="header-bit"),
        pytest.param(
            lambda raw: raw[:-5] + bytes([raw[-5] ^ 0x40]) + raw[-4:], False, id="payload-bit"
        ),
    ],
)
async def test_damaged_files_are_dropped_never_served(
    tmp_path: Path, opened, damage: Callable[[bytes], bytes], at_start: bool
) -> None:
    cfg = config(tmp_path, 1, 8, write_through=True)
    store = await opened(cfg)
    await put_chain(store, range(3))  # 0 and 1 on disk only, 2 in RAM and on disk
    path = diskfile.block_path(cfg.disk_dir, L.key, 1)  # type: ignore[arg-type]
    path.write_bytes(damage(path.read_bytes()))
    store.drain_events()

    if at_start:  # the cheap check at start-up catches it; the rest survive
        await store.close()
        store = await opened(cfg)
        assert store.lookup(L, range(3)) == [DISK]
    else:  # only the checksum can tell: caught when read
        assert store.lookup(L, range(3)) == [DISK, DISK, CPU]
        assert await store.get(L, 1) is None
        await store.wait_idle()
        assert store.lookup(L, range(3)) == [DISK]
        assert store.stats.corrupt_dropped == 1
        events = [le.event for le in store.drain_events()]
        assert BlockRemoved((BlockHash(1),), DISK) in events
    assert not path.exists()
    assert await store.get(L, 1) is None
    assert await store.get(L, 0) == payload(0)


async def test_a_vanished_file_is_a_miss(tmp_path: Path, opened) -> None:
    cfg = config(tmp_path, 1, 8, write_through=True)
    store = await opened(cfg)
    await put_chain(store, range(2))
    diskfile.block_path(cfg.disk_dir, L.key, 0).unlink()  # type: ignore[arg-type]
    assert await store.get(L, 0) is None
    await store.wait_idle()
    assert store.lookup(L, [0]) == [] and store.usage(DISK).used_bytes == FILE


async def test_a_layout_directory_without_its_description_is_cleared(tmp_path: Path, opened):
    cfg = config(tmp_path, 1, 8, write_through=True)
    store = await opened(cfg)
    await put_chain(store, range(2))
    await store.close()
    (cfg.disk_dir / L.key / diskfile.LAYOUT_FILE).write_text("{broken")  # type: ignore[operator]
    store = await opened(cfg)
    assert store.lookup(L, [0]) == [] and files(cfg) == []


async def test_pinned_blocks_survive_pressure_and_full_pins_refuse(tmp_path: Path, opened):
    cfg = config(tmp_path, 2, 2)
    store = await opened(cfg)
    await put_chain(store, range(2))
    with store.pinned(L, [0, 1, 7]) as tiers:
        assert tiers == [CPU, CPU]
        with pytest.raises(StoreFull, match=f"2 pinned blocks hold {2 * BLOCK} of"):
            await store.put(L, 5, payload(5))
        assert store.usage(CPU).used_bytes == 2 * BLOCK
    pins = store.pin(L, [0])
    await put_chain(store, range(2, 4))
    await store.wait_idle()
    check_budgets(store, cfg)
    assert store.lookup(L, [0]) == [CPU] and await store.get(L, 0) == payload(0)
    assert store.lookup(L, [1, 2, 3]) == [DISK, DISK, CPU]
    store.unpin(pins)
    with pytest.raises(NotPinned):
        store.unpin(pins)


async def test_budgets_hold_under_concurrent_puts_and_gets(tmp_path: Path, opened) -> None:
    cfg = config(tmp_path, 3, 5)
    store = await opened(cfg)
    logs: dict[str, KvEventLog] = {}

    async def worker(offset: int) -> None:
        for h in range(offset, offset + 12):
            await store.put(L, h, payload(h), parent=h - 1 if h > offset else None)
            got = await store.get(L, h - 2)
            assert got is None or got == payload(h - 2)
            check_budgets(store, cfg)

    await asyncio.gather(*(worker(o) for o in (100, 200, 300)))
    await store.wait_idle()
    check_budgets(store, cfg)
    held = replay(store.drain_events(), logs)
    for h in (h for o in (100, 200, 300) for h in range(o, o + 12)):
        # What subscribers believe is what the store holds: readable where the events say.
        believed = [tier for tier in (CPU, DISK) if h in held.get((L.key, tier), {})]
        assert store.lookup(L, [h]) == believed[:1]
    assert len(held[(L.key, CPU)]) == 3 and len(held[(L.key, DISK)]) == 5
    assert store.stats.demotions >= 30 and store.stats.disk_deletes >= 25


async def test_events_can_be_pushed_to_a_callback(tmp_path: Path) -> None:
    batches: list[list[LayoutEvent]] = []
    store = await TieredStore.open(config(tmp_path, 1, None), on_events=batches.append)
    await put_chain(store, range(2))
    await store.close()
    assert store.drain_events() == []
    # One batch per loop iteration: both puts ran in one (neither had to wait).
    assert [[le.event for le in batch] for batch in batches] == [
        [
            BlockStored((BlockHash(0),), None, CPU, 16),
            BlockRemoved((BlockHash(0),), CPU),  # no disk tier: dropped to make room
            BlockStored((BlockHash(1),), BlockHash(0), CPU, 16),
        ]
    ]


async def test_events_of_separate_loop_iterations_are_separate_batches(tmp_path: Path) -> None:
    batches: list[list[LayoutEvent]] = []
    store = await TieredStore.open(config(tmp_path, 4, None), on_events=batches.append)
    await put_chain(store, range(1))
    assert batches == []  # not yet: at the end of this loop iteration
    await asyncio.sleep(0)
    assert len(batches) == 1
    await put_chain(store, range(1, 3))
    await store.close()  # flushes what is pending
    assert [len(b) for b in batches] == [1, 2]


async def test_closed_store_refuses_work(tmp_path: Path, opened) -> None:
    store = await opened(config(tmp_path, 1, None))
    await store.close()
    with pytest.raises(StoreClosed):
        await store.put(L, 1, payload(1))
    with pytest.raises(StoreClosed):
        await store.get(L, 1)


# ---- evictions: blocks removed to make room, not demotions -------------------------------------
def evicted(store: TieredStore) -> dict[Tier, tuple[int, int]]:
    return {tier: store.evictions(tier) for tier in (CPU, DISK)}


def metric(metrics: KvManagerMetrics, name: str, tier: Tier) -> float | None:
    return metrics.registry.get_sample_value(name, {"tier": tier.value})


async def test_demotions_are_not_evictions(tmp_path: Path, opened) -> None:
    cfg = config(tmp_path, 2, 8)
    store = await opened(cfg)
    await put_chain(store, range(5))
    assert await store.get(L, 0) == payload(0)  # the promotion demotes block 3
    await store.wait_idle()
    assert store.stats.demotions == 4
    assert evicted(store) == {CPU: (0, 0), DISK: (0, 0)}


async def test_ram_only_pressure_evicts_exactly_the_overflow(tmp_path: Path, opened) -> None:
    store = await opened(config(tmp_path, 2, None))
    await put_chain(store, range(5))
    assert evicted(store) == {CPU: (3, 3 * BLOCK), DISK: (0, 0)}
    assert store.lookup(L, [3, 4]) == [CPU, CPU] and not store.contains(L, 2)
    assert await store.get(L, 0) is None and await store.get(L, 4) == payload(4)
    metrics = KvManagerMetrics()
    metrics.refresh(store)
    assert metric(metrics, "kvmesh_kvmanager_evictions_total", CPU) == 3
    assert metric(metrics, "kvmesh_kvmanager_evicted_bytes_total", CPU) == 3 * BLOCK
    assert metric(metrics, "kvmesh_kvmanager_tier_hits_total", CPU) == 1
    assert metric(metrics, "kvmesh_kvmanager_tier_misses_total", CPU) == 1
    assert metric(metrics, "kvmesh_kvmanager_tier_misses_total", DISK) is None  # no disk tier


async def test_clean_drops_and_disk_overflow_are_evictions(tmp_path: Path, opened) -> None:
    cfg = config(tmp_path, 1, 3)
    store = await opened(cfg)
    await put_chain(store, range(3))  # 0 and 1 demoted, 2 in RAM
    assert await store.get(L, 0) == payload(0)  # promoted; 2 demoted for it
    await store.wait_idle()
    assert evicted(store) == {CPU: (0, 0), DISK: (0, 0)}
    # RAM holds 0 (clean: on disk too); disk is full with 0, 1, 2 (LRU: 1, 2, 0)... then:
    # put 3 drops clean 0 from RAM; put 4 demotes 3, deleting 1 from disk; put 5 demotes 4,
    # deleting the next least recently used disk block.
    await put_chain(store, range(3, 6))
    await store.wait_idle()
    check_budgets(store, cfg)
    assert store.stats.demotions == 5
    assert evicted(store) == {CPU: (1, BLOCK), DISK: (2, 2 * FILE)}
    removed = [
        le.event.tier
        for le in store.drain_events()
        if isinstance(le.event, BlockRemoved)
        for _ in le.event.block_hashes
    ]
    assert removed.count(DISK) == 2
    assert await store.get(L, 5) == payload(5) and await store.get(L, 4) == payload(4)
    assert await store.get(L, 1) is None
    await store.wait_idle()
    metrics = KvManagerMetrics()
    metrics.refresh(store)
    for tier, (blocks, nbytes) in evicted(store).items():
        assert metric(metrics, "kvmesh_kvmanager_evictions_total", tier) == blocks
        assert metric(metrics, "kvmesh_kvmanager_evicted_bytes_total", tier) == nbytes
    s = store.stats
    assert (s.hits_cpu, s.hits_disk, s.misses) == (1, 2, 1)
    assert metric(metrics, "kvmesh_kvmanager_tier_hits_total", CPU) == 1
    assert metric(metrics, "kvmesh_kvmanager_tier_hits_total", DISK) == 2
    assert metric(metrics, "kvmesh_kvmanager_tier_misses_total", CPU) == 3
    assert metric(metrics, "kvmesh_kvmanager_tier_misses_total", DISK) == 1


async def test_write_through_makes_ram_victims_clean_evictions(tmp_path: Path, opened) -> None:
    cfg = config(tmp_path, 2, 8, write_through=True)
    store = await opened(cfg)
    await put_chain(store, range(4))
    await store.wait_idle()
    assert store.stats.demotions == 0
    assert evicted(store) == {CPU: (2, 2 * BLOCK), DISK: (0, 0)}


# ---- the CPU arena and kept checksums -------------------------------------------------------


async def test_a_reader_keeps_its_bytes_while_the_block_is_evicted_and_its_slot_wanted(
    tmp_path: Path, opened
) -> None:
    """RAM blocks live in reused arena slots: a block evicted while a reader (a peer send, a
    shm copy) still holds its bytes must not be overwritten by the blocks that replace it."""
    store = await opened(config(tmp_path, 2, None, cpu_populate=START))
    await put_chain(store, range(2))
    held = await store.get(L, 0)
    assert isinstance(held, memoryview)  # a view of its arena slot, no copy
    await put_chain(store, range(2, 6))  # evicts 0 and 1 (no disk tier), reuses free slots
    assert not store.contains(L, 0)
    assert held == payload(0)  # the slot still holds block 0: nothing was written over it
    for h in (4, 5):
        assert await store.get(L, h) == payload(h)
    arena = store.arena_stats
    assert arena is not None and arena.fallbacks >= 1  # 2 went to the heap while 0 was held
    metrics = KvManagerMetrics()
    metrics.refresh(store)
    sample = metrics.registry.get_sample_value
    assert sample("kvmesh_kvmanager_arena_capacity_bytes") == 2 * BLOCK
    assert sample("kvmesh_kvmanager_arena_populated_bytes") == 2 * BLOCK
    assert sample("kvmesh_kvmanager_arena_fallbacks_total") == arena.fallbacks
    assert sample("kvmesh_kvmanager_arena_in_use_bytes") == 2 * BLOCK  # block 0's + one
    del held


async def test_a_buffer_from_allocate_is_kept_as_it_is(tmp_path: Path, opened) -> None:
    store = await opened(config(tmp_path, 4, None, cpu_populate=START))
    buf = store.allocate(BLOCK)
    assert isinstance(buf, memoryview)
    buf[:] = payload(7)
    assert await store.put(L, 7, buf)
    with store.pinned(L, [7]) as tiers:
        assert tiers == [CPU]
    got = await store.get(L, 7)
    assert isinstance(got, memoryview) and got.obj is buf.obj  # the same slot: no copy
    # Bytes from elsewhere are copied into a slot of their own.
    src = bytearray(payload(8))
    assert await store.put(L, 8, src)
    src[:8] = bytes(8)
    assert await store.get(L, 8) == payload(8)


async def test_without_the_arena_blocks_live_on_the_heap(tmp_path: Path, opened) -> None:
    store = await opened(config(tmp_path, 2, None, cpu_arena=False))
    assert store.arena_stats is None
    assert isinstance(store.allocate(BLOCK), bytearray)
    await put_chain(store, range(3))
    assert isinstance(await store.get(L, 2), bytes)


async def test_ram_blocks_keep_a_checksum_for_peers(tmp_path: Path, opened) -> None:
    from services.kvmanager.peer import wire

    store = await opened(config(tmp_path, 1, 4))
    assert await store.put(L, 0, payload(0))
    got = store.checksum(L.key, 0)
    assert got is not None and got.algo is wire.preferred_algo()
    assert got.value == wire.checksum(got.algo, payload(0))
    given = wire.Checksum(
        wire.ChecksumAlgo.CRC32, wire.checksum(wire.ChecksumAlgo.CRC32, payload(1))
    )
    assert await store.put(L, 1, payload(1), parent=0, checksum=given)  # 0 demoted to disk
    assert store.checksum(L.key, 1) == given  # a peer's verified one is kept as given
    assert store.checksum(L.key, 0) is None  # on disk only
    assert await store.get(L, 0) == payload(0)  # promoted back (1 demoted): checksummed again
    await store.wait_idle()
    promoted = store.checksum(L.key, 0)
    assert promoted is not None and promoted.value == wire.checksum(promoted.algo, payload(0))


async def test_put_nowait_answers_at_once_unless_it_must_wait(tmp_path: Path, opened) -> None:
    """The fast path of a peer fetch: a bool when RAM has room (or the block is held), an
    awaitable when room must first be made (a dirty block written back) or with write-through."""
    store = await opened(config(tmp_path, 1, 4))
    assert store.put_nowait(L, 0, payload(0)) is True
    assert store.put_nowait(L, 0, payload(0)) is False  # held
    later = store.put_nowait(L, 1, payload(1), parent=0)  # RAM full of a dirty block: demote it
    assert not isinstance(later, bool)
    assert await later is True
    await store.wait_idle()
    assert store.lookup(L, [0, 1]) == [DISK, CPU]
    wt = await opened(config(tmp_path / "wt", 2, 4, write_through=True))
    got = wt.put_nowait(L, 5, payload(5))
    assert not isinstance(got, bool) and await got is True
    assert (
        wt.lookup(L, [5]) == [CPU]
        and len(list((tmp_path / "wt").rglob(f"*{diskfile.SUFFIX}"))) == 1
    )


async def test_a_closed_store_is_freed_at_once_without_the_cyclic_collector(
    tmp_path: Path,
) -> None:
    """Its arena mapping (GBs on a real node) goes when the last reference does: nothing in the
    store (its session retention included) makes a cycle that would leave the mapping to the
    cyclic collector. A test run starting a kvmanager per test was OOM-killed that way."""
    import gc
    import weakref

    from services.kvmanager.core.config import RetentionConfig

    cfg = config(tmp_path, cpu_blocks=8, disk_blocks=32)
    store = await TieredStore.open(cfg, retention=RetentionConfig())
    assert store.retention.budget_bytes > 0
    await store.close()
    gone = weakref.ref(store)
    gc.disable()
    try:
        del store
        assert gone() is None
    finally:
        gc.enable()
