"""The tiered KV block store: block bytes in RAM (the CPU tier) and in files (the disk tier), laid
out and evicted as the pure ``TierIndex`` plans. Async API for the daemon's one event loop; every
file operation runs on the store's own I/O threads, never on the loop.

RAM blocks live in slots of one pre-faulted mapping of the CPU budget (``arena.Arena``): a block
is received, copied or read from disk straight into its slot, and slots are reused, so storing a
block never page-faults fresh memory. A block with no slot free (see arena.py) lives in a heap
``bytes`` instead. Each RAM block keeps its checksum (verified on arrival from a peer, or
computed at put when XXH3 is at hand) so serving it to a peer takes no pass over its bytes.

Call it from one event loop only (the index is not thread-safe). Disk trouble degrades to a miss:
a corrupt or vanished file is dropped and ``get`` answers None; a failed write leaves the block
where it was (or drops it, for a demotion) and is logged.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from kvmesh.errors import NotFound, Unavailable
from kvmesh.kv.events import BlockHash, Tier
from kvmesh.kv.layout import KvLayout, check_block_hash, check_layout_key

from . import diskfile
from .arena import PAGE_BYTES, Arena, ArenaStats
from .core.config import Populate, RetentionConfig, StoreConfig
from .core.errors import CorruptBlock, StoreClosed, StoreFull
from .core.plan import (
    BlockId,
    DeleteFromDisk,
    DropFromMemory,
    Grant,
    Granted,
    LayoutEvent,
    TierUsage,
    WriteToDisk,
)
from .core.prefetch import (
    PrefetchPlan,
    PrefetchResult,
    Promotion,
    outcome,
    plan_prefetch,
    ram_cap_bytes,
)
from .core.retention import PinResult, Retention, SessionKey
from .core.tiers import TierIndex
from .peer import wire

log = logging.getLogger(__name__)
_T = TypeVar("_T")
_MAX_PENDING_PROMOTIONS = 16  # promotions waiting for RAM room; more reads skip promoting

RamBlock = bytes | memoryview  # a RAM block: a heap ``bytes`` or a view of its arena slot


@dataclass(frozen=True, slots=True)
class Pins:
    """Blocks pinned by ``TieredStore.pin``: each stays on its tier until ``unpin``."""

    blocks: tuple[tuple[BlockId, Tier], ...]

    @property
    def tiers(self) -> list[Tier]:
        return [tier for _, tier in self.blocks]


@dataclass(slots=True)
class StoreStats:
    """Counters since start (for metrics)."""

    hits_cpu: int = 0
    hits_disk: int = 0
    misses: int = 0
    promotions: int = 0  # disk -> RAM copies made by get and by prefetch
    demotions: int = 0  # RAM -> disk write-backs done under memory pressure
    disk_writes: int = 0
    disk_deletes: int = 0
    corrupt_dropped: int = 0
    disk_bytes_written: int = 0
    disk_bytes_read: int = 0
    # Renewed retentions whose previous pin's blocks were all still held (kept) or not (lost).
    retention_kept: int = 0
    retention_lost: int = 0
    # Session prefetch (PrefetchSession): calls for a live session, those whose planned
    # promotions all landed in RAM before their deadline, and the blocks they brought from disk.
    prefetch_requests: int = 0
    prefetch_done: int = 0
    prefetch_blocks: int = 0


class TieredStore:
    """Use ``await TieredStore.open(config)``; ``close()`` when done. ``on_events``, if given,
    gets every batch of KV events as it happens; otherwise ``drain_events`` returns them."""

    def __init__(
        self,
        config: StoreConfig,
        on_events: Callable[[list[LayoutEvent]], None] | None = None,
        retention: RetentionConfig | None = None,
    ) -> None:
        self._config = config
        self._root: Path | None = config.disk_dir if config.has_disk else None
        self._index = TierIndex(
            config.cpu_bytes,
            config.disk_bytes if self._root is not None else None,
            diskfile.file_bytes,
        )
        self._on_events = on_events
        self._events: list[LayoutEvent] = []
        self._flush_scheduled = False
        self._ram: dict[BlockId, RamBlock] = {}
        self._sums: dict[BlockId, wire.Checksum] = {}  # of RAM blocks, where known
        self._arena = (
            Arena(config.cpu_bytes, populate=config.cpu_populate is not Populate.OFF)
            if config.cpu_arena and config.cpu_bytes >= PAGE_BYTES
            else None
        )
        # Computed at put only when it is cheap (XXH3: ~50 us per 2 MiB); else the data plane
        # computes one per send.
        algo = wire.preferred_algo()
        self._put_sum_algo = algo if algo is wire.ChecksumAlgo.XXH3_64 else None
        self._waiters: dict[tuple[BlockId, Tier], asyncio.Future[None]] = {}
        self._tasks: set[asyncio.Task[Any]] = set()
        self._executor = ThreadPoolExecutor(config.io_threads, thread_name_prefix="kvstore-io")
        self._closed = False
        self._promotions = 0  # promotion tasks waiting for room
        self.stats = StoreStats()
        rc = retention if retention is not None else RetentionConfig(bytes=0)
        self._retention = Retention(
            rc.budget_bytes(config),
            rc.tenant_bytes,
            rc.max_ttl_s,
            # The index's own methods, not the store's: a callback bound to the store would make
            # a cycle, and the store (with its arena mapping, GBs) would then wait for the
            # cyclic collector instead of being freed when its last user lets it go.
            self._index.retain,
            self._index.release,
        )

    @classmethod
    async def open(
        cls,
        config: StoreConfig,
        on_events: Callable[[list[LayoutEvent]], None] | None = None,
        retention: RetentionConfig | None = None,
    ) -> TieredStore:
        """A store whose disk tier holds what the directory held (checked, within budget)."""
        store = cls(config, on_events, retention)
        try:
            if store._arena is not None and config.cpu_populate is Populate.START:
                await asyncio.get_running_loop().run_in_executor(None, store._arena.wait_populated)
            await store._load_disk()
        except BaseException:
            await store.close()
            raise
        return store

    # ---- the API -------------------------------------------------------------------------

    def allocate(self, size: int) -> memoryview | bytearray:
        """A writable buffer of ``size`` bytes to receive a block into before ``put``: a free
        arena slot when there is one (``put`` then keeps it as it is, no copy), else a heap
        bytearray. Thread-safe."""
        slot = self._arena.allocate(size) if self._arena is not None else None
        return bytearray(size) if slot is None else memoryview(slot).cast("B")

    @property
    def arena_stats(self) -> ArenaStats | None:
        return self._arena.stats if self._arena is not None else None

    async def put(
        self,
        layout: KvLayout,
        block_hash: int,
        data: bytes | bytearray | memoryview,
        parent: int | None = None,
        checksum: wire.Checksum | None = None,
    ) -> bool:
        """Stores a block in RAM (and on disk too before returning, with write_through). False if
        it was held already (or is being evicted this instant). Waits while room is made;
        StoreFull if reader pins leave no room for it; BadBlock if ``data`` is not one block of
        ``layout`` or a hash is not an unsigned 64-bit int. ``checksum``, when the caller
        verified one (a peer's), is kept with the block. The caller must not write to ``data``
        afterwards (a buffer from ``allocate`` is kept as it is)."""
        got = self.put_nowait(layout, block_hash, data, parent, checksum)
        return got if isinstance(got, bool) else await got

    def put_nowait(
        self,
        layout: KvLayout,
        block_hash: int,
        data: bytes | bytearray | memoryview,
        parent: int | None = None,
        checksum: wire.Checksum | None = None,
    ) -> bool | Awaitable[bool]:
        """``put`` without a coroutine when it need not wait (RAM has room, no write-through):
        the answer at once; else an awaitable of it, which the caller must await. For callers
        storing many small blocks in a row (a peer fetch): a coroutine per block costs more than
        the store's own bookkeeping."""
        self._check_open()
        h = check_block_hash(block_hash)
        parent_hash = check_block_hash(parent) if parent is not None else None
        layout.check_payload(memoryview(data).nbytes)
        bid = BlockId(layout.key, h)
        got = self._index.request(layout, h, Tier.CPU, parent_hash)
        self._sync()
        if got is Grant.QUEUED:  # the waiter now, before anything else can grant it
            return self._put_when_granted(
                self._waiter(bid, Tier.CPU), layout, bid, data, parent_hash, checksum
            )
        return self._put_granted(got, layout, bid, data, parent_hash, checksum)

    async def _put_when_granted(
        self,
        fut: asyncio.Future[None],
        layout: KvLayout,
        bid: BlockId,
        data: bytes | bytearray | memoryview,
        parent: BlockHash | None,
        checksum: wire.Checksum | None,
    ) -> bool:
        await self._granted(fut, bid, Tier.CPU)
        got = self._put_granted(Grant.GRANTED, layout, bid, data, parent, checksum)
        return got if isinstance(got, bool) else await got

    def _put_granted(
        self,
        got: Grant,
        layout: KvLayout,
        bid: BlockId,
        data: bytes | bytearray | memoryview,
        parent: BlockHash | None,
        checksum: wire.Checksum | None,
    ) -> bool | Awaitable[bool]:
        if got is Grant.REFUSED:
            usage = self._index.usage(Tier.CPU)
            raise StoreFull(
                f"no room for a {layout.block_bytes}-byte block in RAM: {usage.pinned} pinned"
                f" blocks hold {usage.pinned_bytes} of its {usage.budget_bytes} bytes"
            )
        if got is not Grant.GRANTED:
            return False
        payload = self._keep(data)
        if checksum is None and self._put_sum_algo is not None:
            checksum = wire.Checksum(self._put_sum_algo, wire.checksum(self._put_sum_algo, payload))
        if checksum is not None:
            self._sums[bid] = checksum
        self._ram[bid] = payload
        self._index.write_done(bid, Tier.CPU, ok=True)
        self._sync()
        if self._config.write_through and self._root is not None:
            return self._write_through(layout, bid, parent, payload)
        return True

    async def _write_through(
        self, layout: KvLayout, bid: BlockId, parent: BlockHash | None, payload: RamBlock
    ) -> bool:
        if await self._reserve(layout, bid, Tier.DISK, parent) is Grant.GRANTED:
            write = self._spawn(self._write_file(layout, bid, parent, payload))
            await asyncio.shield(write)
        return True

    async def get(self, layout: KvLayout, block_hash: int) -> RamBlock | None:
        """The block's payload, or None (also for a bad file, which is dropped). A block read
        from disk is promoted to RAM: at once if there is room, else in the background once
        there is (the read never waits for it). Read-only by contract; a view of an arena slot
        keeps the slot from reuse for as long as it lives."""
        self._check_open()
        bid = BlockId(layout.key, check_block_hash(block_hash))
        tier = self._index.pin(bid)
        if tier is None:
            self.stats.misses += 1
            return None
        if tier is Tier.CPU:
            self.stats.hits_cpu += 1
            data = self._ram[bid]
            self._index.unpin(bid, tier)
            self._sync()
            return data
        # A task of its own: if the caller goes away, the read still ends and unpins.
        return await asyncio.shield(self._spawn(self._read_file(layout, bid)))

    def contains(self, layout: KvLayout, block_hash: int) -> bool:
        return self._index.tier_of(BlockId(layout.key, check_block_hash(block_hash))) is not None

    def lookup(self, layout: KvLayout, hashes: Iterable[int]) -> list[Tier]:
        """The tier of each block of the leading run of ``hashes`` held (stops at the first
        missing one). Not a promise: pin them to keep them."""
        return self._index.lookup(layout.key, (check_block_hash(h) for h in hashes))

    def pin(self, layout: KvLayout, hashes: Iterable[int]) -> Pins:
        """Pins the leading run of ``hashes`` held, each on its fastest tier: none of them is
        evicted before ``unpin``."""
        self._check_open()
        pinned: list[tuple[BlockId, Tier]] = []
        for h in hashes:
            bid = BlockId(layout.key, check_block_hash(h))
            tier = self._index.pin(bid)
            if tier is None:
                break
            pinned.append((bid, tier))
        return Pins(tuple(pinned))

    def pin_one(self, layout_key: str, block_hash: BlockHash) -> tuple[BlockId, Tier] | None:
        """Pins one block (``unpin_one`` releases it): the data plane's per-block path, with
        no per-call tuples of ``pin``. ``block_hash`` must be a valid hash already (a ticket's)."""
        bid = BlockId(layout_key, block_hash)
        tier = self._index.pin(bid)
        return None if tier is None else (bid, tier)

    def ram_block(self, bid: BlockId) -> tuple[RamBlock, wire.Checksum | None]:
        """A block pinned on the CPU tier by ``pin_one``: its payload and kept checksum."""
        return self._ram[bid], self._sums.get(bid)

    def unpin_one(self, bid: BlockId, tier: Tier) -> None:
        self._index.unpin(bid, tier)
        self._sync()

    def unpin(self, pins: Pins) -> None:
        """Releases ``pin``'s pins (once: a second unpin raises NotPinned)."""
        try:
            for bid, tier in pins.blocks:
                self._index.unpin(bid, tier)
        finally:
            self._sync()

    @contextlib.contextmanager
    def pinned(self, layout: KvLayout, hashes: Iterable[int]) -> Iterator[list[Tier]]:
        """``with store.pinned(layout, hashes) as tiers:`` the leading run held, pinned."""
        pins = self.pin(layout, hashes)
        try:
            yield pins.tiers
        finally:
            self.unpin(pins)

    def checksum(self, layout_key: str, block_hash: int) -> wire.Checksum | None:
        """The kept checksum of a RAM block (None: not in RAM, or none known)."""
        return self._sums.get(BlockId(layout_key, check_block_hash(block_hash)))

    def layout_of(self, layout_key: str, block_hash: int) -> KvLayout | None:
        """The full layout of a block known under ``layout_key`` (held or being written)."""
        return self._index.layout_of(BlockId(layout_key, check_block_hash(block_hash)))

    def parent_of(self, layout: KvLayout, block_hash: int) -> BlockHash | None:
        """The parent hash a known block was stored with (None: a chain root, or unknown)."""
        return self._index.parent_of(BlockId(layout.key, check_block_hash(block_hash)))

    # ---- session retention ---------------------------------------------------------------

    @property
    def retention(self) -> Retention:
        """The sessions kept (read-only use: change them through ``retain_session``)."""
        return self._retention

    def retain_session(
        self,
        tenant: str,
        session_id: str,
        layout_key: str,
        hashes: Iterable[int],
        ttl_s: float,
        now_s: float | None = None,
    ) -> tuple[PinResult, int, int]:
        """Pins the session's chain (``core/retention.py``); with how many of its blocks, and
        of its previous pin's, are held here now. NotFound: no block of the layout was ever
        stored here (its block size is not known); Unavailable: retention is off."""
        self._check_open()
        if self._retention.budget_bytes == 0:
            raise Unavailable("session retention is off on this kvmanager (--retention-bytes 0)")
        layout = self._index.known_layout(check_layout_key(layout_key))
        if layout is None:
            raise NotFound(f"no block of layout {layout_key} was stored here")
        chain = [check_block_hash(h) for h in hashes]
        now = time.monotonic() if now_s is None else now_s
        try:
            got = self._retention.pin(
                SessionKey(tenant, session_id), layout.key, layout.block_bytes, chain, ttl_s, now
            )
        finally:
            self._sync()
        held = sum(
            1
            for b in self._retention.blocks_of(SessionKey(tenant, session_id))
            if self._index.tier_of(b) is not None
        )
        previous_held = sum(1 for b in got.previous if self._index.tier_of(b) is not None)
        if got.renewed:
            if previous_held == len(got.previous):
                self.stats.retention_kept += 1
            else:
                self.stats.retention_lost += 1
        return got, held, previous_held

    def release_session(self, tenant: str, session_id: str) -> bool:
        try:
            return self._retention.end(SessionKey(tenant, session_id))
        finally:
            self._sync()

    def expire_sessions(self, now_s: float) -> int:
        """Releases the sessions whose TTL passed (the daemon calls it every few seconds)."""
        try:
            return len(self._retention.expire(now_s))
        finally:
            self._sync()

    async def prefetch_session(
        self, tenant: str, session_id: str, timeout_s: float | None = None
    ) -> PrefetchResult:
        """Brings the session's retained chain from disk into RAM (``core/prefetch.py``'s
        plan); waits at most ``timeout_s`` (promotions under way then still land). No live
        retention: an empty result."""
        self._check_open()
        chain = self._retention.blocks_of(SessionKey(tenant, session_id))
        layout = self._index.layout_of(chain[0]) if chain else None
        if layout is None:
            return outcome(PrefetchPlan((), 0, 0, len(chain)), ())
        plan = plan_prefetch(
            chain,
            self._index.tier_of,
            layout.block_bytes,
            ram_cap_bytes(self._index.usage(Tier.CPU).budget_bytes),
        )
        self.stats.prefetch_requests += 1
        ended: list[Promotion] = []
        if plan.promote:
            run = chain[: len(plan.promote) + plan.in_cpu + plan.on_disk]
            task = self._spawn(self._prefetch(layout, run, plan.promote, ended))
            with contextlib.suppress(TimeoutError):  # what is under way still lands
                await asyncio.wait_for(asyncio.shield(task), timeout_s)
        got = outcome(plan, list(ended))
        self.stats.prefetch_blocks += got.promoted
        self.stats.prefetch_done += got.done
        return got

    async def _prefetch(
        self,
        layout: KvLayout,
        run: Sequence[BlockId],
        promote: Sequence[BlockId],
        ended: list[Promotion],
    ) -> None:
        """Promotes ``promote`` (in parallel), keeping the run's RAM copies pinned meanwhile:
        making room for one promotion must not push out another, or a block in RAM already
        (the run is at most half the RAM tier). ``ended`` gets each promotion's outcome."""
        pinned: list[BlockId] = []
        for b in run:
            if self._index.tier_of(b) is Tier.CPU and self._index.pin(b) is Tier.CPU:
                pinned.append(b)

        async def one(b: BlockId) -> None:
            ended.append(await self.promote(layout, b.block_hash, keep=pinned))

        try:
            await asyncio.gather(*(one(b) for b in promote), return_exceptions=True)
        finally:
            for b in pinned:
                self._index.unpin(b, Tier.CPU)
            self._sync()

    async def promote(
        self, layout: KvLayout, block_hash: int, keep: list[BlockId] | None = None
    ) -> Promotion:
        """Brings a block held on disk (only) into RAM, waiting while room is made. ``keep``:
        the RAM copy landed is pinned and added to it (the caller unpins it)."""
        self._check_open()
        bid = BlockId(layout.key, check_block_hash(block_hash))
        tier = self._index.pin(bid)
        if tier is not Tier.DISK:
            if tier is not None:
                self._index.unpin(bid, tier)
                self._sync()
            return Promotion.MISSING if tier is None else Promotion.IN_CPU
        try:
            try:
                got = await self._reserve(layout, bid, Tier.CPU, self._index.parent_of(bid))
            except StoreClosed:
                return Promotion.NO_ROOM
            if got is not Grant.GRANTED:
                return Promotion.IN_CPU if got is Grant.PRESENT else Promotion.NO_ROOM
            data: RamBlock | None = None
            try:
                data = await self._read_checked(layout, bid)
            finally:
                if data is None:  # a bad file (dropped), or cancelled: the RAM copy never lands
                    self._index.write_done(bid, Tier.CPU, ok=False)
            if data is None:
                return Promotion.MISSING
            self._land(bid, data)
            if keep is not None and self._index.pin(bid) is Tier.CPU:
                keep.append(bid)
            return Promotion.PROMOTED
        finally:
            self._index.unpin(bid, Tier.DISK)
            self._sync()

    def retained_usage(self) -> dict[Tier, tuple[int, int]]:
        """(blocks, bytes) of retained blocks' copies per tier."""
        return self._index.retained_usage()

    def drain_events(self) -> list[LayoutEvent]:
        """KV events since the last drain, in order (empty when ``on_events`` is set: those
        go to it at the end of the loop iteration they happen in)."""
        if self._on_events is not None:
            return []
        events, self._events = self._events, []
        return events

    def usage(self, tier: Tier) -> TierUsage:
        return self._index.usage(tier)

    @property
    def has_disk(self) -> bool:
        return self._index.has_disk

    def evictions(self, tier: Tier) -> tuple[int, int]:
        """(blocks, bytes) evicted from ``tier`` since start to make room: not demotions (RAM
        copies written back to disk first, ``stats.demotions``), not bad files dropped."""
        return self._index.evictions(tier)

    async def close(self) -> None:
        """Refuses new work, fails waiting puts with StoreClosed, finishes the disk I/O under
        way. RAM contents are not written back (a cache: the next start has the disk tier)."""
        self._closed = True
        if self._arena is not None:
            self._arena.close()
        for fut in list(self._waiters.values()):
            if not fut.done():
                fut.set_exception(StoreClosed("the KV store is closing"))
        await self.wait_idle()
        self._flush_events()
        self._executor.shutdown(wait=False)

    async def wait_idle(self) -> None:
        """Waits until the background disk I/O under way (and what it starts) has ended."""
        while self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)

    # ---- internals -----------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosed("the KV store is closed")

    def _keep(self, data: bytes | bytearray | memoryview) -> RamBlock:
        """What RAM holds for a granted block: a whole arena slot as it is; other bytes copied
        into a free slot; else (no slot free) a heap ``bytes``, the given one when it is one."""
        view = memoryview(data)
        if self._arena is not None:
            if self._arena.owns(view.obj) and view.nbytes == len(view.obj):  # type: ignore[arg-type]
                return view if view.format == "B" else view.cast("B")
            slot = self._arena.allocate(view.nbytes)
            if slot is not None:
                kept = memoryview(slot).cast("B")
                kept[:] = view.cast("B") if view.format != "B" else view
                return kept
        return data if isinstance(data, bytes) else view.tobytes()

    async def _reserve(
        self, layout: KvLayout, bid: BlockId, tier: Tier, parent: BlockHash | None
    ) -> Grant:
        """Asks the index for room and waits while it is being made: GRANTED, or what else the
        index answered."""
        got = self._index.request(layout, bid.block_hash, tier, parent)
        self._sync()
        if got is not Grant.QUEUED:
            return got
        await self._granted(self._waiter(bid, tier), bid, tier)
        return Grant.GRANTED

    def _waiter(self, bid: BlockId, tier: Tier) -> asyncio.Future[None]:
        fut = asyncio.get_running_loop().create_future()
        self._waiters[(bid, tier)] = fut
        return fut

    async def _granted(self, fut: asyncio.Future[None], bid: BlockId, tier: Tier) -> None:
        """Waits for a queued request's Granted; withdraws the request if that fails."""
        try:
            await fut
        except BaseException:
            self._waiters.pop((bid, tier), None)
            self._index.cancel(bid, tier)
            self._sync()
            raise

    def _sync(self) -> None:
        """Carries out what the index planned and passes its events on. Call after every index
        call, before the next await (RAM drops must land before anything reuses the key)."""
        for action in self._index.take_actions():
            if isinstance(action, DropFromMemory):
                del self._ram[action.block]  # an arena slot is reused once no reader holds it
                self._sums.pop(action.block, None)
            elif isinstance(action, Granted):
                fut = self._waiters.pop((action.block, action.tier), None)
                if fut is not None and not fut.done():
                    fut.set_result(None)
                # else: the waiter was cancelled and withdraws the grant itself
            elif isinstance(action, WriteToDisk):
                self._spawn(self._demote(action.block))
            elif isinstance(action, DeleteFromDisk):
                self._spawn(self._delete(action.block))
        events = self._index.take_events()
        if events:
            self._events.extend(events)
            if self._on_events is not None and not self._flush_scheduled:
                # One batch per loop iteration, not per block: a peer fetch or a PutBlocks
                # stores hundreds of blocks per wake-up, and each batch costs the event log and
                # every subscriber a message.
                self._flush_scheduled = True
                asyncio.get_running_loop().call_soon(self._flush_events)

    def _flush_events(self) -> None:
        self._flush_scheduled = False
        events, self._events = self._events, []
        if events and self._on_events is not None:
            self._on_events(events)

    def _spawn(self, coro: Coroutine[Any, Any, _T]) -> asyncio.Task[_T]:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and (exc := task.exception()) is not None:
            log.error("kv store background task failed", exc_info=exc)

    async def _io(self, fn: Callable[..., _T], *args: Any) -> _T:
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    async def _read_file(self, layout: KvLayout, bid: BlockId) -> RamBlock | None:
        """Reads a pinned disk copy and promotes it to RAM: at once if there is room, else by a
        task that waits for room (the disk copy stays pinned meanwhile and is read again then,
        so no bytes wait outside the RAM budget). Unpins the disk copy when done."""
        assert self._root is not None
        handed_off = False
        try:
            data = await self._read_checked(layout, bid)
            if data is None:
                return None
            self.stats.hits_disk += 1
            got = self._index.request(layout, bid.block_hash, Tier.CPU, self._index.parent_of(bid))
            self._sync()
            if got is Grant.GRANTED:
                self._land(bid, data)
            elif got is Grant.QUEUED and self._promotions < _MAX_PENDING_PROMOTIONS:
                fut = self._waiter(bid, Tier.CPU)
                self._spawn(self._promote_when_granted(layout, bid, fut))
                handed_off = True
            elif got is Grant.QUEUED:
                self._index.cancel(bid, Tier.CPU)  # promotion is best effort
            return data
        finally:
            if not handed_off:
                self._index.unpin(bid, Tier.DISK)
                self._sync()

    async def _promote_when_granted(
        self, layout: KvLayout, bid: BlockId, fut: asyncio.Future[None]
    ) -> None:
        self._promotions += 1
        try:
            try:
                await self._granted(fut, bid, Tier.CPU)
            except StoreClosed:
                return
            data = await self._read_checked(layout, bid)
            if data is None:
                self._index.write_done(bid, Tier.CPU, ok=False)
            else:
                self._land(bid, data)
        finally:
            self._promotions -= 1
            self._index.unpin(bid, Tier.DISK)
            self._sync()

    async def _read_checked(self, layout: KvLayout, bid: BlockId) -> RamBlock | None:
        """A pinned disk copy's payload (read into an arena slot when one is free), or None
        after dropping a bad file (never served)."""
        assert self._root is not None
        try:
            data, _ = await self._io(
                diskfile.read_block, self._root, layout, bid.block_hash, self.allocate
            )
        except (CorruptBlock, OSError) as e:
            log.warning("dropping block %s of layout %s: %s", bid.block_hash, layout.key, e)
            self.stats.corrupt_dropped += 1
            self.stats.misses += 1
            self._index.discard(bid, Tier.DISK)
            self._sync()
            return None
        self.stats.disk_bytes_read += len(data)
        return data

    def _land(self, bid: BlockId, data: RamBlock) -> None:
        """A granted RAM copy's bytes arrive."""
        if self._put_sum_algo is not None:
            self._sums[bid] = wire.Checksum(
                self._put_sum_algo, wire.checksum(self._put_sum_algo, data)
            )
        self._ram[bid] = data
        self._index.write_done(bid, Tier.CPU, ok=True)
        self._sync()
        self.stats.promotions += 1

    async def _write_file(
        self, layout: KvLayout, bid: BlockId, parent: BlockHash | None, data: RamBlock
    ) -> bool:
        """Writes a granted disk copy and reports it to the index (ok or not)."""
        assert self._root is not None
        ok = False
        try:
            await self._io(
                diskfile.write_block,
                self._root,
                layout,
                bid.block_hash,
                parent,
                data,
                self._config.fsync,
            )
            ok = True
            self.stats.disk_writes += 1
            self.stats.disk_bytes_written += len(data)
        except Exception:
            log.warning(
                "writing block %s of layout %s failed", bid.block_hash, layout.key, exc_info=True
            )
        finally:
            self._index.write_done(bid, Tier.DISK, ok)
            self._sync()
        return ok

    async def _demote(self, bid: BlockId) -> None:
        layout = self._index.layout_of(bid)
        assert layout is not None
        if await self._write_file(layout, bid, self._index.parent_of(bid), self._ram[bid]):
            self.stats.demotions += 1

    async def _delete(self, bid: BlockId) -> None:
        assert self._root is not None
        try:
            await self._io(diskfile.delete_block, self._root, bid.layout_key, bid.block_hash)
            self.stats.disk_deletes += 1
        except OSError:
            log.warning("deleting block file %s failed", bid, exc_info=True)
        finally:
            self._index.deleted(bid)
            self._sync()

    async def _load_disk(self) -> None:
        """Rebuilds the disk tier from the directory: the newest files that fit the budget are
        adopted (oldest first, so LRU order follows write time); the others are deleted."""
        if self._root is None:
            return
        found = await self._io(diskfile.scan, self._root)
        for why in found.removed:
            log.warning("removed at start: %s", why)
        keep_from, size_bytes = len(found.blocks), 0
        for i in range(len(found.blocks) - 1, -1, -1):
            size_bytes += diskfile.file_bytes(found.blocks[i].layout.block_bytes)
            if size_bytes > self._config.disk_bytes:
                break
            keep_from = i
        drop = found.blocks[:keep_from]
        for b in found.blocks[keep_from:]:
            if not self._index.adopt(b.layout, b.block_hash, b.parent):
                drop.append(b)
        self._sync()
        for b in drop:
            await self._io(diskfile.delete_block, self._root, b.layout.key, b.block_hash)
        log.info(
            "disk tier %s: %d blocks adopted, %d over budget deleted, %d bad files removed",
            self._root,
            len(found.blocks) - len(drop),
            len(drop),
            len(found.removed),
        )
