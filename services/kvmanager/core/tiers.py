"""The tier index: which block has a copy on which tier, byte budgets, LRU order and pins. Pure,
synchronous and deterministic: it never touches bytes or files, it plans. Every call may leave
actions (``take_actions``) that the adapter must carry out and report back, and KV events
(``take_events``) saying which copies became readable or stopped being readable.

Accounting. A copy's bytes count against its tier from the moment room is granted for it (before
a byte is written) until the adapter reports it gone (RAM: at once; disk: ``deleted``), so
``used_bytes <= budget_bytes`` holds at every instant, mid-operation included. A copy is

- *writing*: granted, being written, not readable;
- *readable*: in the tier's LRU; readers ``pin`` it (a refcount, never negative);
- *doomed* (RAM only): chosen for demotion, still readable, leaves once its disk write ends;
- *leaving*: chosen for removal, no longer readable, removed once its last pin is released.

A request that does not fit now queues (FIFO per tier), and the index dooms unpinned readable
copies, least recently used first, until the tier's *future* occupancy (used - leaving + queued)
fits the budget. Copies still being written, or read by a disk write, become evictable when that
ends, and the index goes on dooming then (and when a pin is released). A request is REFUSED only
if reader pins block it: pinned bytes + its size exceed the budget. So every queued request is
granted in turn once in-flight I/O ends and pins are released; more may wait than fit at once
(each then makes room for the next).

Policy. RAM victims with a readable disk copy (clean) are dropped at once; others (dirty) are
written back to disk first (demotion) if the disk tier has room for them, else dropped. Disk
victims are deleted; a RAM copy of the same block then becomes dirty. A doomed RAM copy that
leaves before its write-back got disk room (discarded) withdraws that queued write-back.

Retention (``retain`` / ``release``): a block a live session keeps (``core/retention.py``
decides which). Retained copies are victims only after every unretained one: a retained RAM copy
is written back to disk (or dropped when its disk copy is readable already), never dropped
when there is no disk tier; a retained disk copy is never a victim. A retained block's mark
outlives its copies, so a block saved after its session pinned it is retained as it lands.
Retained copies a search for victims passes over move to the LRU's end (so the next search does
not scan them again); a released block so rejoins the LRU at its last use or later. The
retention budget keeps retained bytes well under the tier budgets (``RetentionConfig``).

Evictions (``evictions``): copies that leave their tier because room was being made for
others, counted per tier when they stop being readable: RAM victims dropped (clean, or dirty
with no disk room, or whose write-back failed or was withdrawn) and disk victims deleted. A RAM
victim that leaves once the index's own write-back landed is a demotion, not an eviction; copies
removed as bad (``discard``) are not evictions either.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from kvmesh.errors import InvalidArgument
from kvmesh.kv.events import BlockHash, BlockRemoved, BlockStored, Tier
from kvmesh.kv.layout import KvLayout

from .errors import NotPinned
from .plan import (
    Action,
    BlockId,
    CopyState,
    DeleteFromDisk,
    DropFromMemory,
    Grant,
    Granted,
    LayoutEvent,
    TierUsage,
    WriteToDisk,
)

_CPU, _DISK = Tier.CPU, Tier.DISK


@dataclass(slots=True)
class _Copy:
    size_bytes: int
    ready: bool = False  # written: readable unless leaving
    pins: int = 0  # reader refcount
    copying: bool = False  # RAM copy being read by a disk write of the same block
    doomed: bool = False  # RAM copy: leaves once its disk write ends
    leaving: bool = False  # chosen for removal: unreadable, removed at pins == 0
    deleting: bool = False  # disk copy: DeleteFromDisk handed out
    victim: bool = False  # chosen by _make_room: leaving it counts as an eviction...
    demoting: bool = False  # ...unless it is a RAM copy the index wrote back (WriteToDisk)


@dataclass(slots=True)
class _Block:
    layout: KvLayout
    parent: BlockHash | None
    copies: dict[Tier, _Copy] = field(default_factory=dict)


@dataclass(slots=True)
class _Request:
    size_bytes: int
    demotion: bool  # True: the index's own write-back (WriteToDisk when granted)


@dataclass(slots=True)
class _Tier:
    budget_bytes: int
    used_bytes: int = 0
    leaving_bytes: int = 0
    queued_bytes: int = 0
    pinned_bytes: int = 0  # copies with reader pins: what a request may not count on
    evicted_blocks: int = 0  # since start: victims of _make_room gone (demotions excluded)
    evicted_bytes: int = 0
    lru: OrderedDict[BlockId, None] = field(default_factory=OrderedDict)  # readable, oldest first
    queue: OrderedDict[BlockId, _Request] = field(default_factory=OrderedDict)


class TierIndex:
    """Bookkeeping of the RAM (``Tier.CPU``) and disk tiers; ``disk_bytes=None``: no disk tier.
    ``disk_file_bytes`` maps a payload size to what its file costs on disk (header, rounding)."""

    def __init__(
        self,
        cpu_bytes: int,
        disk_bytes: int | None = None,
        disk_file_bytes: Callable[[int], int] = lambda payload_bytes: payload_bytes,
    ) -> None:
        self._tiers: dict[Tier, _Tier] = {_CPU: _Tier(cpu_bytes)}
        if disk_bytes is not None:
            self._tiers[_DISK] = _Tier(disk_bytes)
        self._disk_file_bytes = disk_file_bytes
        self._blocks: dict[BlockId, _Block] = {}
        self._retained: set[BlockId] = set()
        self._layouts: dict[str, KvLayout] = {}  # every layout a block was stored under
        self._actions: list[Action] = []
        self._events: list[LayoutEvent] = []
        # The request being queued: a grant of it during the same call is returned, not acted.
        self._quiet: tuple[BlockId, Tier] | None = None
        self._quiet_granted = False

    # ---- queries -------------------------------------------------------------------------

    @property
    def has_disk(self) -> bool:
        return _DISK in self._tiers

    def tier_of(self, block: BlockId) -> Tier | None:
        """The fastest tier with a readable copy, or None."""
        b = self._blocks.get(block)
        return self._readable(b) if b is not None else None

    def lookup(self, layout_key: str, hashes: Iterable[BlockHash]) -> list[Tier]:
        """The tier of each block of the leading run of ``hashes`` that is readable somewhere
        (stops at the first one that is not)."""
        tiers: list[Tier] = []
        for h in hashes:
            b = self._blocks.get(BlockId(layout_key, h))
            tier = self._readable(b) if b is not None else None
            if tier is None:
                break
            tiers.append(tier)
        return tiers

    def layout_of(self, block: BlockId) -> KvLayout | None:
        b = self._blocks.get(block)
        return b.layout if b is not None else None

    def parent_of(self, block: BlockId) -> BlockHash | None:
        b = self._blocks.get(block)
        return b.parent if b is not None else None

    def holdings(self, tier: Tier) -> dict[BlockId, BlockHash | None]:
        """Every readable copy on ``tier``, with its parent hash."""
        return {
            bid: b.parent
            for bid, b in self._blocks.items()
            if (c := b.copies.get(tier)) is not None and c.ready and not c.leaving
        }

    def state(self, block: BlockId, tier: Tier) -> CopyState | None:
        """Where the block's copy on ``tier`` stands; None: no copy."""
        b = self._blocks.get(block)
        c = b.copies.get(tier) if b is not None else None
        if c is None:
            return None
        if c.leaving:
            return CopyState.LEAVING
        if c.doomed:
            return CopyState.DEMOTING
        return CopyState.READABLE if c.ready else CopyState.WRITING

    def pins(self, block: BlockId, tier: Tier) -> int:
        b = self._blocks.get(block)
        c = b.copies.get(tier) if b is not None else None
        return c.pins if c is not None else 0

    def usage(self, tier: Tier) -> TierUsage:
        t = self._tiers.get(tier) or _Tier(0)
        copies = [c for b in self._blocks.values() if (c := b.copies.get(tier)) is not None]
        return TierUsage(
            tier=tier,
            budget_bytes=t.budget_bytes,
            used_bytes=t.used_bytes,
            leaving_bytes=t.leaving_bytes,
            queued_bytes=t.queued_bytes,
            blocks=sum(1 for c in copies if c.ready and not c.leaving),
            pinned=sum(1 for c in copies if c.pins),
            pinned_bytes=t.pinned_bytes,
        )

    def known_layout(self, layout_key: str) -> KvLayout | None:
        """The layout of that key if any block was ever stored under it."""
        return self._layouts.get(layout_key)

    def is_retained(self, block: BlockId) -> bool:
        return block in self._retained

    def retained_usage(self) -> dict[Tier, tuple[int, int]]:
        """(blocks, bytes) of retained blocks' readable copies per tier (O(retained))."""
        out = {tier: (0, 0) for tier in self._tiers}
        for bid in self._retained:
            b = self._blocks.get(bid)
            if b is None:
                continue
            for tier, c in b.copies.items():
                if c.ready and not c.leaving:
                    n, size = out[tier]
                    out[tier] = (n + 1, size + c.size_bytes)
        return out

    def evictions(self, tier: Tier) -> tuple[int, int]:
        """(blocks, bytes) evicted from ``tier`` since start (see the module doc); (0, 0) for
        a tier this index does not have."""
        t = self._tiers.get(tier)
        return (t.evicted_blocks, t.evicted_bytes) if t is not None else (0, 0)

    # ---- writes --------------------------------------------------------------------------

    def request(
        self, layout: KvLayout, block_hash: BlockHash, tier: Tier, parent: BlockHash | None = None
    ) -> Grant:
        """Asks for room to write a copy of the block on ``tier`` (a put, a promotion, a
        write-through). GRANTED or a later Granted action: write it, then ``write_done``."""
        return self._request(layout, BlockId(layout.key, block_hash), tier, parent, False)

    def write_done(self, block: BlockId, tier: Tier, ok: bool) -> None:
        """The copy granted on ``tier`` is written (readable now) or failed (its room is freed)."""
        b = self._blocks.get(block)
        c = b.copies.get(tier) if b is not None else None
        if b is None or c is None or c.ready:
            raise InvalidArgument(f"no write in flight for {block} on {tier}")
        t = self._tiers[tier]
        if ok:
            c.ready = True
            t.lru[block] = None
            self._emit(b, BlockStored((block.block_hash,), b.parent, tier, b.layout.block_size))
            self._make_room(tier)
        else:
            del b.copies[tier]
            t.used_bytes -= c.size_bytes
        if tier is _DISK:
            self._disk_write_ended(block, b)
        if not ok:
            self._forget_if_unused(block)
            self._pump(tier)

    def cancel(self, block: BlockId, tier: Tier) -> None:
        """Withdraws a caller's request: still queued, or granted but not written."""
        t = self._tiers.get(tier)
        b = self._blocks.get(block)
        if t is None or b is None:
            return
        req = t.queue.pop(block, None)
        if req is not None:
            t.queued_bytes -= req.size_bytes
            if tier is _DISK:
                self._disk_write_ended(block, b)
            self._forget_if_unused(block)
            self._pump(tier)
        elif (c := b.copies.get(tier)) is not None and not c.ready:
            self.write_done(block, tier, ok=False)

    def adopt(self, layout: KvLayout, block_hash: BlockHash, parent: BlockHash | None) -> bool:
        """Takes in a block file found on disk at start-up, if it fits without evicting."""
        block = BlockId(layout.key, block_hash)
        t = self._tiers.get(_DISK)
        if t is None or block in t.queue:
            return False
        b = self._blocks.get(block)
        if b is not None and _DISK in b.copies:
            return False
        size = self._disk_file_bytes(layout.block_bytes)
        if t.queue or t.used_bytes + size > t.budget_bytes:
            return False
        b = self._ensure(layout, block, parent)
        self._grant(b, block, _DISK, size, demotion=False)
        self.write_done(block, _DISK, ok=True)
        return True

    def deleted(self, block: BlockId) -> None:
        """The adapter deleted the block's file (after DeleteFromDisk): its bytes are free."""
        b = self._blocks.get(block)
        c = b.copies.get(_DISK) if b is not None else None
        if b is None or c is None or not c.deleting:
            raise InvalidArgument(f"no delete in flight for {block}")
        t = self._tiers[_DISK]
        del b.copies[_DISK]
        t.used_bytes -= c.size_bytes
        t.leaving_bytes -= c.size_bytes
        self._forget_if_unused(block)
        self._pump(_DISK)

    # ---- reads ---------------------------------------------------------------------------

    def pin(self, block: BlockId) -> Tier | None:
        """Pins the fastest readable copy (it stays until ``unpin``) and marks it used; returns
        its tier, or None if no copy is readable."""
        b = self._blocks.get(block)
        tier = self._readable(b) if b is not None else None
        if b is None or tier is None:
            return None
        c = b.copies[tier]
        if c.pins == 0:
            self._tiers[tier].pinned_bytes += c.size_bytes
        c.pins += 1
        lru = self._tiers[tier].lru
        if block in lru:  # a doomed copy (being demoted) is readable but out of the LRU
            lru.move_to_end(block)
        return tier

    def unpin(self, block: BlockId, tier: Tier) -> None:
        b = self._blocks.get(block)
        c = b.copies.get(tier) if b is not None else None
        if c is None or c.pins == 0:
            raise NotPinned(f"unpin of {block} on {tier} without a pin")
        c.pins -= 1
        if c.pins == 0:
            self._tiers[tier].pinned_bytes -= c.size_bytes
            self._remove_if_idle(block, tier)
            self._make_room(tier)

    def discard(self, block: BlockId, tier: Tier) -> None:
        """The copy on ``tier`` is bad (corrupt file): stop serving it and remove it."""
        b = self._blocks.get(block)
        c = b.copies.get(tier) if b is not None else None
        if c is not None and c.ready and not c.leaving:
            c.victim = False  # removed as bad: not an eviction, even if it was a victim
            self._leave(block, tier)

    # ---- retention -----------------------------------------------------------------------

    def retain(self, block: BlockId) -> None:
        """Marks the block retained (held now or not: a later copy is retained as it lands)."""
        self._retained.add(block)

    def release(self, block: BlockId) -> None:
        """Ends the block's retention; a tier over its budget makes room now."""
        if block not in self._retained:
            return
        self._retained.discard(block)
        b = self._blocks.get(block)
        if b is not None:
            for tier in list(b.copies):
                self._make_room(tier)

    # ---- outboxes ------------------------------------------------------------------------

    def take_actions(self) -> list[Action]:
        actions, self._actions = self._actions, []
        return actions

    def take_events(self) -> list[LayoutEvent]:
        events, self._events = self._events, []
        return events

    # ---- internals -----------------------------------------------------------------------

    def _readable(self, b: _Block) -> Tier | None:
        for tier in (_CPU, _DISK):
            c = b.copies.get(tier)
            if c is not None and c.ready and not c.leaving:
                return tier
        return None

    def _ensure(self, layout: KvLayout, block: BlockId, parent: BlockHash | None) -> _Block:
        b = self._blocks.get(block)
        if b is None:  # the parent is fixed while the block lives: its events all agree
            b = self._blocks[block] = _Block(layout, parent)
            self._layouts.setdefault(layout.key, layout)
        return b

    def _request(
        self,
        layout: KvLayout,
        block: BlockId,
        tier: Tier,
        parent: BlockHash | None,
        demotion: bool,
    ) -> Grant:
        t = self._tiers.get(tier)
        if t is None:
            return Grant.REFUSED
        b = self._blocks.get(block)
        if b is not None:
            c = b.copies.get(tier)
            if c is not None:
                if c.leaving:
                    return Grant.BUSY
                if block in t.lru:
                    t.lru.move_to_end(block)
                return Grant.PRESENT
            if block in t.queue:
                return Grant.PRESENT
        size = layout.block_bytes if tier is _CPU else self._disk_file_bytes(layout.block_bytes)
        if size > t.budget_bytes:
            return Grant.REFUSED
        if not t.queue and t.used_bytes + size <= t.budget_bytes:
            self._grant(self._ensure(layout, block, parent), block, tier, size, demotion)
            return Grant.GRANTED
        if t.pinned_bytes + size > t.budget_bytes:
            return Grant.REFUSED
        self._ensure(layout, block, parent)
        outer = self._quiet, self._quiet_granted  # demotions nest one level deep
        self._quiet, self._quiet_granted = (block, tier), False
        try:
            t.queue[block] = _Request(size, demotion)
            t.queued_bytes += size
            self._make_room(tier)
            self._pump(tier)
            granted = self._quiet_granted
        finally:
            self._quiet, self._quiet_granted = outer
        return Grant.GRANTED if granted else Grant.QUEUED

    def _make_room(self, tier: Tier) -> None:
        """Dooms unpinned readable copies, least recently used first, until the tier's future
        occupancy fits (or none is left: more become evictable as I/O ends and pins go)."""
        t = self._tiers[tier]
        shortfall = t.used_bytes - t.leaving_bytes + t.queued_bytes - t.budget_bytes
        if shortfall <= 0:
            return
        victims: list[BlockId] = []
        retained: list[BlockId] = []  # victims of the second pass, least recently used first
        kept: list[BlockId] = []  # retained copies that may not leave this tier
        for block in t.lru:
            if shortfall <= 0:
                break
            c = self._blocks[block].copies[tier]
            if c.pins or c.copying:
                continue
            if block in self._retained:
                (retained if self._retained_evictable(block, tier) else kept).append(block)
                continue
            victims.append(block)
            shortfall -= c.size_bytes
        skipped: list[BlockId] = []  # retained copies passed over
        for i, block in enumerate(retained):
            if shortfall <= 0:
                skipped = retained[i:]
                break
            victims.append(block)
            shortfall -= self._blocks[block].copies[tier].size_bytes
        skipped += kept
        # Retained copies passed over go to the LRU's end (in their order), so the next call
        # does not scan them again: they are victims only after every unretained copy anyway.
        for block in skipped:
            t.lru.move_to_end(block)
        for victim in victims:
            self._evict(victim, tier)

    def _retained_evictable(self, block: BlockId, tier: Tier) -> bool:
        """A retained copy may leave ``tier`` only for the disk tier: a RAM copy with a disk
        tier (its disk copy stays, or it is written back first). Never a disk copy."""
        return tier is _CPU and self.has_disk

    def _grant(self, b: _Block, block: BlockId, tier: Tier, size: int, demotion: bool) -> None:
        b.copies[tier] = _Copy(size)
        self._tiers[tier].used_bytes += size
        if tier is _DISK and (src := b.copies.get(_CPU)) is not None:
            src.copying = True
        if demotion:
            self._actions.append(WriteToDisk(block))

    def _pump(self, tier: Tier) -> None:
        """Grants queued requests in order while they fit."""
        t = self._tiers[tier]
        while t.queue:
            block, req = next(iter(t.queue.items()))
            if t.used_bytes + req.size_bytes > t.budget_bytes:
                break
            del t.queue[block]
            t.queued_bytes -= req.size_bytes
            self._grant(self._blocks[block], block, tier, req.size_bytes, req.demotion)
            if self._quiet == (block, tier):
                self._quiet_granted = True  # the caller learns it from request()'s answer
            elif not req.demotion:
                self._actions.append(Granted(block, tier))

    def _evict(self, block: BlockId, tier: Tier) -> None:
        b = self._blocks[block]
        c = b.copies[tier]
        disk = b.copies.get(_DISK)
        clean = disk is not None and disk.ready and not disk.leaving
        c.victim = True
        if tier is _CPU and self.has_disk and not clean and (disk is None or not disk.leaving):
            t = self._tiers[_CPU]
            del t.lru[block]
            c.doomed = True
            t.leaving_bytes += c.size_bytes
            if disk is None:  # else a disk write of this block is under way already
                got = self._request(b.layout, block, _DISK, b.parent, demotion=True)
                c.demoting = got is not Grant.REFUSED
                if got is Grant.REFUSED:
                    self._leave(block, _CPU)
            return
        self._leave(block, tier)

    def _leave(self, block: BlockId, tier: Tier) -> None:
        b = self._blocks[block]
        c = b.copies[tier]
        t = self._tiers[tier]
        withdrawn = False
        if c.doomed:
            c.doomed = False  # its bytes count as leaving already
            withdrawn = self._withdraw_demotion(block)
        else:
            t.leaving_bytes += c.size_bytes
            t.lru.pop(block, None)
        c.leaving = True
        if c.victim:
            disk = b.copies.get(_DISK)
            demoted = c.demoting and disk is not None and disk.ready and not withdrawn
            if not demoted:
                t.evicted_blocks += 1
                t.evicted_bytes += c.size_bytes
        if c.ready:
            self._emit(b, BlockRemoved((block.block_hash,), tier))
        self._remove_if_idle(block, tier)
        if withdrawn:
            self._pump(_DISK)

    def _withdraw_demotion(self, block: BlockId) -> bool:
        """A doomed RAM copy leaves before its write-back got room on disk: the queued demotion
        goes with it (granted later, it would write bytes that are gone, or bad)."""
        t = self._tiers.get(_DISK)
        req = t.queue.get(block) if t is not None else None
        if t is None or req is None or not req.demotion:
            return False
        del t.queue[block]
        t.queued_bytes -= req.size_bytes
        return True

    def _remove_if_idle(self, block: BlockId, tier: Tier) -> None:
        b = self._blocks[block]
        c = b.copies[tier]
        if not c.leaving or c.pins or c.copying:
            return
        if tier is _DISK:
            if not c.deleting:
                c.deleting = True
                self._actions.append(DeleteFromDisk(block))
            return
        t = self._tiers[_CPU]
        del b.copies[_CPU]
        t.used_bytes -= c.size_bytes
        t.leaving_bytes -= c.size_bytes
        self._actions.append(DropFromMemory(block))
        self._forget_if_unused(block)
        self._pump(_CPU)

    def _disk_write_ended(self, block: BlockId, b: _Block) -> None:
        """A disk write of ``block`` ended (or was withdrawn): release its RAM source, and let a
        RAM copy doomed by demotion go."""
        src = b.copies.get(_CPU)
        if src is None:
            return
        src.copying = False
        if src.doomed:
            self._leave(block, _CPU)
        else:
            self._remove_if_idle(block, _CPU)
            self._make_room(_CPU)

    def _forget_if_unused(self, block: BlockId) -> None:
        b = self._blocks.get(block)
        if (
            b is not None
            and not b.copies
            and all(block not in t.queue for t in self._tiers.values())
        ):
            del self._blocks[block]

    def _emit(self, b: _Block, event: BlockStored | BlockRemoved) -> None:
        self._events.append(LayoutEvent(b.layout.key, event))

    def check_invariants(self) -> None:
        """Recounts everything and raises AssertionError on any inconsistency (tests; O(n))."""
        for tier, t in self._tiers.items():
            copies = {bid: c for bid, b in self._blocks.items() if (c := b.copies.get(tier))}
            used = sum(c.size_bytes for c in copies.values())
            leaving = sum(c.size_bytes for c in copies.values() if c.leaving or c.doomed)
            readable = [bid for bid, c in copies.items() if c.ready and not c.leaving]
            assert t.used_bytes == used, (tier, t.used_bytes, used)
            assert t.leaving_bytes == leaving, (tier, t.leaving_bytes, leaving)
            assert t.used_bytes <= t.budget_bytes, (tier, t.used_bytes, t.budget_bytes)
            assert t.queued_bytes == sum(r.size_bytes for r in t.queue.values())
            assert t.pinned_bytes == sum(c.size_bytes for c in copies.values() if c.pins)
            if t.used_bytes - t.leaving_bytes + t.queued_bytes > t.budget_bytes:  # no victim left
                assert all(
                    copies[bid].pins
                    or copies[bid].copying
                    or (bid in self._retained and not self._retained_evictable(bid, tier))
                    for bid in t.lru
                ), tier
            assert set(t.lru) == {bid for bid in readable if not copies[bid].doomed}
            assert all(c.pins >= 0 for c in copies.values())
            assert not any(bid in copies for bid in t.queue)
            assert all(c.doomed <= (tier is _CPU and c.ready) for c in copies.values())
        for bid, b in self._blocks.items():
            assert b.copies or any(bid in t.queue for t in self._tiers.values()), bid
