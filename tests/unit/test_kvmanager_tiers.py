"""The kvmanager's tier index: what a request gets (table), the demotion, pin and removal flows,
and property tests of its invariants over random interleavings of requests, I/O completions,
pins and failures (budgets, pins, refcounts, events vs. holdings, every queued request granted in
the end)."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from kvmesh.errors import InvalidArgument
from kvmesh.kv.eventlog import KvEventLog
from kvmesh.kv.events import BlockHash, BlockRemoved, BlockStored, Tier
from kvmesh.kv.layout import KvLayout
from services.kvmanager.core.errors import NotPinned
from services.kvmanager.core.plan import (
    Action,
    BlockId,
    CopyState,
    DeleteFromDisk,
    DropFromMemory,
    Grant,
    Granted,
    LayoutEvent,
    WriteToDisk,
)
from services.kvmanager.core.tiers import TierIndex

A = KvLayout("a", 1, 1, 1, 1, "float16")  # 4-byte blocks
B = KvLayout("b", 1, 1, 1, 2, "float16")  # 8-byte blocks
CPU, DISK = Tier.CPU, Tier.DISK


def file_bytes(payload_bytes: int) -> int:
    return payload_bytes + 4  # a header, so disk sizes differ from RAM sizes


def bid(h: int, layout: KvLayout = A) -> BlockId:
    return BlockId(layout.key, BlockHash(h))


def names(actions: list[Action]) -> list[str]:
    short = {DropFromMemory: "drop", WriteToDisk: "write", DeleteFromDisk: "delete"}
    out = []
    for a in actions:
        if isinstance(a, Granted):
            out.append(f"granted {a.block.block_hash} {a.tier}")
        else:
            out.append(f"{short[type(a)]} {a.block.block_hash}")
    return out


def store(index: TierIndex, h: int, tier: Tier, layout: KvLayout = A) -> None:
    """Puts a block on ``tier`` the way an adapter does, asserting it fits at once."""
    assert index.request(layout, BlockHash(h), tier) is Grant.GRANTED
    index.write_done(bid(h, layout), tier, ok=True)


# ---- what a request gets ----------------------------------------------------------------------


@dataclass(frozen=True)
class Scene:
    cpu_blocks: int  # RAM budget in A blocks
    disk_blocks: int | None  # disk budget in A files; None: no disk tier
    cpu: tuple[int, ...] = ()  # dirty RAM blocks, oldest first
    disk: tuple[int, ...] = ()  # disk blocks, oldest first
    both: tuple[int, ...] = ()  # clean blocks (disk file + RAM copy), stored after the others
    pinned: tuple[int, ...] = ()  # pinned on their fastest tier


@pytest.mark.parametrize(
    ("scene", "grant", "actions", "tiers_after"),
    [
        pytest.param(Scene(2, 2, cpu=(1,)), Grant.GRANTED, [], {1: CPU, 9: None}, id="fits"),
        pytest.param(
            Scene(2, 2, both=(1, 2)),
            Grant.GRANTED,
            ["drop 1"],
            {1: DISK, 2: CPU},
            id="clean-lru-dropped",
        ),
        pytest.param(
            Scene(2, 2, cpu=(1, 2)),
            Grant.QUEUED,
            ["write 1"],
            {1: CPU, 2: CPU},
            id="dirty-lru-demoted",
        ),
        pytest.param(
            Scene(2, None, cpu=(1, 2)),
            Grant.GRANTED,
            ["drop 1"],
            {1: None, 2: CPU},
            id="no-disk-dropped",
        ),
        pytest.param(
            Scene(2, 2, cpu=(1, 2), pinned=(1,)),
            Grant.QUEUED,
            ["write 2"],
            {1: CPU},
            id="pinned-skipped",
        ),
        pytest.param(
            Scene(2, 2, cpu=(1, 2), pinned=(1, 2)),
            Grant.REFUSED,
            [],
            {1: CPU, 2: CPU},
            id="all-pinned",
        ),
        pytest.param(
            Scene(2, 1, cpu=(1, 2), disk=(5,), pinned=(5,)),
            Grant.GRANTED,
            ["drop 1"],
            {1: None, 5: DISK},
            id="disk-pinned-full-victim-dropped",
        ),
        pytest.param(
            Scene(2, 1, cpu=(1, 2), disk=(5,)),
            Grant.QUEUED,
            ["delete 5"],
            {1: CPU, 5: None},
            id="disk-full-victim-waits-for-delete",
        ),
        pytest.param(Scene(2, 2, cpu=(9,)), Grant.PRESENT, [], {9: CPU}, id="present"),
    ],
)
def test_request(scene: Scene, grant: Grant, actions: list[str], tiers_after: dict) -> None:
    disk = None if scene.disk_blocks is None else scene.disk_blocks * file_bytes(4)
    index = TierIndex(scene.cpu_blocks * 4, disk, file_bytes)
    for h in scene.disk + scene.both:
        assert index.adopt(A, BlockHash(h), None)
    for h in scene.cpu + scene.both:
        store(index, h, CPU)
    for h in scene.pinned:
        assert index.pin(bid(h)) is not None
    index.take_actions()
    assert index.request(A, BlockHash(9), CPU) is grant
    assert names(index.take_actions()) == actions
    assert {h: index.tier_of(bid(h)) for h in tiers_after} == tiers_after
    index.check_invariants()


def test_too_big_for_the_tier_is_refused() -> None:
    index = TierIndex(cpu_bytes=7, disk_bytes=100)
    assert index.request(B, BlockHash(1), CPU) is Grant.REFUSED
    assert TierIndex(cpu_bytes=8).request(A, BlockHash(1), DISK) is Grant.REFUSED  # no disk tier


# ---- flows ------------------------------------------------------------------------------------


def test_demotion_writes_back_then_drops_then_grants_the_waiter() -> None:
    index = TierIndex(cpu_bytes=8, disk_bytes=100)
    store(index, 1, CPU)
    store(index, 2, CPU)
    index.take_events()
    assert index.request(A, BlockHash(3), CPU, parent=BlockHash(2)) is Grant.QUEUED
    assert names(index.take_actions()) == ["write 1"]
    assert index.usage(CPU).used_bytes == 8  # block 1's RAM still counts until it is on disk
    assert index.tier_of(bid(1)) is CPU  # and stays readable meanwhile
    index.write_done(bid(1), DISK, ok=True)
    assert names(index.take_actions()) == ["drop 1", "granted 3 cpu"]
    assert [e.event for e in index.take_events()] == [
        BlockStored((BlockHash(1),), None, DISK, 1),
        BlockRemoved((BlockHash(1),), CPU),
    ]
    index.write_done(bid(3), CPU, ok=True)
    assert index.lookup(A.key, [BlockHash(1), BlockHash(2), BlockHash(3)]) == [DISK, CPU, CPU]
    assert [e.event for e in index.take_events()] == [
        BlockStored((BlockHash(3),), BlockHash(2), CPU, 1)
    ]
    assert index.evictions(CPU) == index.evictions(DISK) == (0, 0)  # a demotion
    index.check_invariants()


def test_failed_demotion_drops_the_block_and_still_grants() -> None:
    index = TierIndex(cpu_bytes=4, disk_bytes=100)
    store(index, 1, CPU)
    assert index.request(A, BlockHash(2), CPU) is Grant.QUEUED
    index.write_done(bid(1), DISK, ok=False)
    assert names(index.take_actions()) == ["write 1", "drop 1", "granted 2 cpu"]
    assert index.tier_of(bid(1)) is None and index.usage(DISK).used_bytes == 0
    assert index.evictions(CPU) == (1, 4), "not written back: evicted"
    index.check_invariants()


def test_a_pinned_copy_leaves_only_at_its_last_unpin() -> None:
    index = TierIndex(cpu_bytes=4, disk_bytes=100, disk_file_bytes=file_bytes)
    assert index.adopt(A, BlockHash(1), None)
    assert index.pin(bid(1)) is DISK and index.pin(bid(1)) is DISK
    index.discard(bid(1), DISK)  # found corrupt by one reader
    assert index.tier_of(bid(1)) is None and index.pin(bid(1)) is None  # no new readers
    index.unpin(bid(1), DISK)
    assert index.take_actions() == []  # the other reader still reads the file
    index.unpin(bid(1), DISK)
    assert names(index.take_actions()) == ["delete 1"]
    assert index.usage(DISK).used_bytes == 8  # counted until the file is gone
    index.deleted(bid(1))
    assert index.usage(DISK).used_bytes == 0
    with pytest.raises(NotPinned):
        index.unpin(bid(1), DISK)
    index.check_invariants()


def test_a_ram_copy_read_by_a_disk_write_stays_until_the_write_ends() -> None:
    index = TierIndex(cpu_bytes=4, disk_bytes=100)
    store(index, 1, CPU)
    assert index.request(A, BlockHash(1), DISK) is Grant.GRANTED  # write-through
    index.discard(bid(1), CPU)
    assert index.state(bid(1), CPU) is CopyState.LEAVING and index.take_actions() == []
    assert index.request(A, BlockHash(2), CPU) is Grant.QUEUED  # not a victim either
    index.write_done(bid(1), DISK, ok=True)
    assert names(index.take_actions()) == ["drop 1", "granted 2 cpu"]
    assert index.state(bid(1), DISK) is CopyState.READABLE
    assert index.evictions(CPU) == (0, 0), "discarded, not evicted"
    index.check_invariants()


def test_discarding_a_ram_copy_withdraws_its_queued_demotion() -> None:
    """A dirty RAM copy doomed while the disk tier has no room yet queues its write-back there;
    if the copy then leaves (discarded), the write-back must go too: granted later, it would ask
    the adapter to write RAM bytes that are gone, and hold disk room others wait for."""
    index = TierIndex(cpu_bytes=8, disk_bytes=16, disk_file_bytes=file_bytes)
    store(index, 0, CPU, B)  # fills RAM
    assert index.adopt(A, BlockHash(0), None)  # 8 of 16 disk bytes
    assert index.request(A, BlockHash(0), CPU) is Grant.QUEUED  # promotion: demotes B0 (12)
    assert names(index.take_actions()) == ["delete 0"]  # A0's file makes room for it
    assert index.state(bid(0, B), CPU) is CopyState.DEMOTING
    assert index.usage(DISK).queued_bytes == 12
    index.discard(bid(0, B), CPU)
    assert names(index.take_actions()) == ["drop 0", "granted 0 cpu"]
    assert index.usage(DISK).queued_bytes == 0 and index.layout_of(bid(0, B)) is None
    assert index.request(A, BlockHash(1), DISK) is Grant.GRANTED  # no phantom ahead of it
    index.deleted(bid(0))
    assert index.take_actions() == []  # no WriteToDisk of the dropped B0
    index.write_done(bid(0), CPU, ok=True)
    index.write_done(bid(1), DISK, ok=True)
    assert index.usage(DISK).used_bytes == 8 and index.usage(DISK).leaving_bytes == 0
    assert index.evictions(DISK) == (1, 8)  # A0's file, deleted to make room
    assert index.evictions(CPU) == (0, 0)  # B0 was a victim, then discarded as bad
    index.check_invariants()


@pytest.mark.parametrize(
    ("disk_blocks", "evicted_cpu", "demotions"),
    [
        pytest.param(None, (3, 12), 0, id="no-disk-tier"),
        pytest.param(100, (0, 0), 3, id="disk-room"),
        pytest.param(0, (3, 12), 0, id="disk-full"),
    ],
)
def test_evictions_count_victims_that_were_not_written_back(
    disk_blocks: int | None, evicted_cpu: tuple[int, int], demotions: int
) -> None:
    index = TierIndex(cpu_bytes=8, disk_bytes=None if disk_blocks is None else 4 * disk_blocks)
    writes = 0
    for h in range(5):
        got = index.request(A, BlockHash(h), CPU)
        while got is Grant.QUEUED:  # the adapter's part: write back what the index asks
            for action in index.take_actions():
                if isinstance(action, WriteToDisk):
                    writes += 1
                    index.write_done(action.block, DISK, ok=True)
                elif isinstance(action, Granted):
                    got = Grant.GRANTED
        assert got is Grant.GRANTED
        index.write_done(bid(h), CPU, ok=True)
    assert (index.evictions(CPU), writes) == (evicted_cpu, demotions)
    assert index.evictions(DISK) == (0, 0)
    index.check_invariants()


def test_unpin_never_goes_below_zero() -> None:
    index = TierIndex(cpu_bytes=8)
    store(index, 1, CPU)
    with pytest.raises(NotPinned, match="without a pin"):
        index.unpin(bid(1), CPU)
    assert index.pin(bid(1)) is CPU
    index.unpin(bid(1), CPU)
    with pytest.raises(NotPinned):
        index.unpin(bid(1), CPU)
    assert index.pins(bid(1), CPU) == 0


def test_lookup_is_the_leading_run_on_the_fastest_tier() -> None:
    index = TierIndex(cpu_bytes=16, disk_bytes=100)
    store(index, 1, CPU)
    assert index.adopt(A, BlockHash(2), None)
    store(index, 3, CPU, B)  # another layout: not part of A's chain
    store(index, 4, CPU)
    hashes = [BlockHash(h) for h in (1, 2, 3, 4)]
    assert index.lookup(A.key, hashes) == [CPU, DISK]
    assert index.lookup(B.key, hashes) == []
    assert index.lookup(B.key, hashes[2:]) == [CPU]


def test_cancel_withdraws_a_queued_request_and_frees_its_claim() -> None:
    index = TierIndex(cpu_bytes=4, disk_bytes=100)
    store(index, 1, CPU)
    assert index.request(A, BlockHash(2), CPU) is Grant.QUEUED
    index.cancel(bid(2), CPU)
    assert index.usage(CPU).queued_bytes == 0
    index.write_done(bid(1), DISK, ok=True)
    assert names(index.take_actions()) == ["write 1", "drop 1"]  # no Granted for a withdrawn one
    index.check_invariants()


def test_requests_are_granted_in_order() -> None:
    index = TierIndex(cpu_bytes=8, disk_bytes=100)
    store(index, 1, CPU, B)
    assert index.request(A, BlockHash(2), CPU) is Grant.QUEUED  # demotes 1
    assert index.request(A, BlockHash(3), CPU) is Grant.QUEUED  # room from 1 covers it too
    assert index.request(A, BlockHash(2), CPU) is Grant.PRESENT  # already waiting
    index.write_done(bid(1, B), DISK, ok=True)
    assert names(index.take_actions()) == ["write 1", "drop 1", "granted 2 cpu", "granted 3 cpu"]


def test_bookkeeping_errors_are_refused() -> None:
    index = TierIndex(cpu_bytes=8, disk_bytes=100)
    with pytest.raises(InvalidArgument, match="no write in flight"):
        index.write_done(bid(1), CPU, ok=True)
    with pytest.raises(InvalidArgument, match="no delete in flight"):
        index.deleted(bid(1))
    store(index, 1, CPU)
    with pytest.raises(InvalidArgument, match="no write in flight"):
        index.write_done(bid(1), CPU, ok=True)


def test_adopt_takes_only_what_fits_without_evicting() -> None:
    index = TierIndex(cpu_bytes=8, disk_bytes=20, disk_file_bytes=file_bytes)
    assert index.adopt(A, BlockHash(1), None)
    assert index.adopt(A, BlockHash(2), BlockHash(1))
    assert not index.adopt(A, BlockHash(3), BlockHash(2))  # 3 files of 8 bytes > 20
    assert not index.adopt(A, BlockHash(1), None)  # present
    assert not TierIndex(cpu_bytes=8).adopt(A, BlockHash(1), None)  # no disk tier
    assert index.holdings(DISK) == {bid(1): None, bid(2): BlockHash(1)}


# ---- properties -------------------------------------------------------------------------------

HASHES = st.integers(0, 4)
LAYOUTS = st.sampled_from([A, B])
TIERS = st.sampled_from([CPU, DISK])


def replayed(log: KvEventLog, tier: Tier) -> dict[BlockHash, BlockHash | None]:
    """hash -> parent of what a subscriber of ``log`` believes is held on ``tier``."""
    held: dict[BlockHash, BlockHash | None] = {}
    for ev in log.snapshot().events:
        assert isinstance(ev, BlockStored)
        if ev.tier is tier:
            parent = ev.parent_hash
            for h in ev.block_hashes:
                held[h] = parent
                parent = h
    return held


@dataclass
class Adapter:
    """What an adapter would hold, to check the index's plans against."""

    sizes: dict[str, int]
    ram: set[BlockId] = field(default_factory=set)
    files: set[BlockId] = field(default_factory=set)
    writing: list[tuple[BlockId, Tier]] = field(default_factory=list)
    waiting: set[tuple[BlockId, Tier]] = field(default_factory=set)
    deleting: list[BlockId] = field(default_factory=list)
    pins: list[tuple[BlockId, Tier]] = field(default_factory=list)
    kept: set[tuple[BlockId, Tier]] = field(default_factory=set)  # pinned while READABLE
    sources: set[BlockId] = field(default_factory=set)  # RAM copies read by a disk write
    logs: dict[str, KvEventLog] = field(default_factory=dict)


class TierIndexMachine(RuleBasedStateMachine):
    @initialize(cpu_blocks=st.integers(1, 6), disk_blocks=st.none() | st.integers(0, 8))
    def start(self, cpu_blocks: int, disk_blocks: int | None) -> None:
        disk = None if disk_blocks is None else disk_blocks * 8
        self.index = TierIndex(cpu_blocks * 4, disk, file_bytes)
        self.io = Adapter({A.key: A.block_bytes, B.key: B.block_bytes})
        self.retained: set[BlockId] = set()

    def settle(self) -> None:
        io = self.io
        for action in self.index.take_actions():
            if isinstance(action, DropFromMemory):
                io.ram.remove(action.block)  # KeyError: dropped what never landed
                assert action.block not in io.sources  # a disk write still reads it
            elif isinstance(action, WriteToDisk):
                assert action.block in io.ram  # a demotion copies bytes that are there
                self.writing(action.block, DISK)
            elif isinstance(action, DeleteFromDisk):
                assert action.block in io.files
                io.deleting.append(action.block)
            else:
                io.waiting.remove((action.block, action.tier))
                self.writing(action.block, action.tier)
        for le in self.index.take_events():
            log = io.logs.setdefault(le.layout_key, KvEventLog("w", "e"))
            log.append([le.event])

    def writing(self, block: BlockId, tier: Tier) -> None:
        self.io.writing.append((block, tier))
        if tier is DISK and block in self.io.ram:
            self.io.sources.add(block)

    def written(self, block: BlockId, tier: Tier, ok: bool) -> None:
        self.index.write_done(block, tier, ok)
        if tier is DISK:
            self.io.sources.discard(block)
        if ok:
            (self.io.ram if tier is CPU else self.io.files).add(block)

    @rule(layout=LAYOUTS, h=HASHES, tier=TIERS, parent=st.none() | HASHES)
    def request(self, layout: KvLayout, h: int, tier: Tier, parent: int | None) -> None:
        p = BlockHash(parent) if parent is not None else None
        got = self.index.request(layout, BlockHash(h), tier, p)
        if got is Grant.GRANTED:
            self.writing(bid(h, layout), tier)
        elif got is Grant.QUEUED:
            self.io.waiting.add((bid(h, layout), tier))
        self.settle()

    @rule(i=st.integers(0, 100), ok=st.booleans())
    def finish_write(self, i: int, ok: bool) -> None:
        if self.io.writing:
            block, tier = self.io.writing.pop(i % len(self.io.writing))
            self.written(block, tier, ok)
            self.settle()

    @rule(i=st.integers(0, 100))
    def finish_delete(self, i: int) -> None:
        if self.io.deleting:
            block = self.io.deleting.pop(i % len(self.io.deleting))
            self.io.files.remove(block)
            self.index.deleted(block)
            self.settle()

    def held(self, tiers: tuple[Tier, ...]) -> list[BlockId]:
        blocks = {b for tier in tiers for b in self.index.holdings(tier)}
        return sorted(blocks, key=lambda b: (b.layout_key, b.block_hash))

    @rule(i=st.integers(0, 100))
    def pin(self, i: int) -> None:
        held = self.held((CPU, DISK))
        if held:
            block = held[i % len(held)]
            tier = self.index.pin(block)
            assert tier is not None
            if self.index.state(block, tier) is CopyState.READABLE:
                self.io.kept.add((block, tier))  # not demoting: must stay readable
            self.io.pins.append((block, tier))
            self.settle()

    @rule(i=st.integers(0, 100))
    def unpin(self, i: int) -> None:
        if self.io.pins:
            pinned = self.io.pins.pop(i % len(self.io.pins))
            self.index.unpin(*pinned)
            if pinned not in self.io.pins:
                self.io.kept.discard(pinned)
            self.settle()

    @rule(layout=LAYOUTS, h=HASHES)
    def retain(self, layout: KvLayout, h: int) -> None:
        """Session retention marks a block (held or not yet: a later copy is retained)."""
        self.index.retain(bid(h, layout))
        self.retained.add(bid(h, layout))
        self.settle()

    @rule(i=st.integers(0, 100))
    def release(self, i: int) -> None:
        if self.retained:
            block = sorted(self.retained, key=lambda b: (b.layout_key, b.block_hash))[
                i % len(self.retained)
            ]
            self.retained.discard(block)
            self.index.release(block)
            self.settle()

    @rule(i=st.integers(0, 100), tier=TIERS)
    def discard(self, i: int, tier: Tier) -> None:
        held = self.held((tier,))
        if held:
            self.index.discard(held[i % len(held)], tier)
            self.io.kept.discard((held[i % len(held)], tier))  # a bad copy goes, pinned or not
            self.settle()

    @rule(i=st.integers(0, 100))
    def cancel(self, i: int) -> None:
        mine = sorted(self.io.waiting, key=str) + [w for w in self.io.writing if w[1] is CPU]
        if mine:
            block, tier = mine[i % len(mine)]
            self.io.waiting.discard((block, tier))
            if (block, tier) in self.io.writing:
                self.io.writing.remove((block, tier))
            self.index.cancel(block, tier)
            if tier is DISK:
                self.io.sources.discard(block)
            self.settle()

    @rule(layout=LAYOUTS, h=HASHES)
    def adopt(self, layout: KvLayout, h: int) -> None:
        if self.index.adopt(layout, BlockHash(h), None):
            self.io.files.add(bid(h, layout))
        self.settle()

    @invariant()
    def consistent(self) -> None:
        self.index.check_invariants()
        io = self.io
        assert all(self.index.is_retained(b) for b in self.retained)
        for tier, landed in ((CPU, io.ram), (DISK, io.files)):
            usage = self.index.usage(tier)
            assert usage.used_bytes <= usage.budget_bytes
            size = (lambda n: n) if tier is CPU else file_bytes
            assert sum(size(io.sizes[b.layout_key]) for b in landed) <= usage.used_bytes
        for block, tier in io.pins:  # a pinned copy is never removed under its reader
            assert block in (io.ram if tier is CPU else io.files)
            assert self.index.pins(block, tier) >= 1
        for block, tier in io.kept:  # nor evicted (chosen for removal or demotion)
            assert self.index.state(block, tier) is CopyState.READABLE
        for tier in (CPU, DISK):
            held = self.index.holdings(tier)
            for key, log in io.logs.items():
                mine = {b.block_hash: p for b, p in held.items() if b.layout_key == key}
                assert replayed(log, tier) == mine
            assert all(b.layout_key in io.logs for b in held)

    def teardown(self) -> None:
        """Every queued request is granted once I/O ends and pins are released (liveness)."""
        if not hasattr(self, "index"):
            return
        io = self.io
        for block in list(self.retained):  # retention ends (TTL): retained copies evictable
            self.index.release(block)
        self.retained.clear()
        self.settle()
        while io.writing or io.deleting or io.pins:
            if io.pins:
                self.index.unpin(*io.pins.pop())
            elif io.deleting:
                block = io.deleting.pop()
                io.files.remove(block)
                self.index.deleted(block)
            else:
                self.written(*io.writing.pop(0), ok=True)
            self.settle()
        assert not io.waiting
        for tier in (CPU, DISK):
            assert self.index.usage(tier).queued_bytes == 0
            assert self.index.usage(tier).leaving_bytes == 0
        self.index.check_invariants()


TierIndexMachine.TestCase.settings = settings(
    max_examples=200, stateful_step_count=40, deadline=None
)
test_tier_index_invariants = TierIndexMachine.TestCase


# Falsifying examples the machine once found (a doomed RAM copy discarded while its demotion
# still waited for disk room), replayed step by step: the machine's own rules, invariants after
# every step, then its teardown (liveness).
MACHINE_EXAMPLES = {
    "discarded-demotion-source-then-delete": [
        ("request", {"h": 0, "layout": B, "parent": None, "tier": CPU}),
        ("adopt", {"h": 0, "layout": A}),
        ("finish_write", {"i": 0, "ok": True}),
        ("request", {"h": 0, "layout": A, "parent": None, "tier": CPU}),
        ("discard", {"i": 0, "tier": CPU}),
        ("request", {"h": 1, "layout": A, "parent": None, "tier": DISK}),
        ("finish_delete", {"i": 0}),
    ],
    "discarded-demotion-source-then-teardown": [
        ("request", {"h": 0, "layout": B, "parent": None, "tier": CPU}),
        ("adopt", {"h": 0, "layout": A}),
        ("finish_write", {"i": 0, "ok": True}),
        ("request", {"h": 0, "layout": A, "parent": None, "tier": CPU}),
        ("discard", {"i": 0, "tier": CPU}),
    ],
}


@pytest.mark.parametrize("steps", MACHINE_EXAMPLES.values(), ids=MACHINE_EXAMPLES.keys())
def test_tier_index_machine_examples(steps: list[tuple[str, dict]]) -> None:
    machine = TierIndexMachine()
    machine.start(cpu_blocks=2, disk_blocks=2)
    machine.consistent()
    for rule_name, kwargs in steps:
        getattr(machine, rule_name)(**kwargs)
        machine.consistent()
    machine.teardown()


def test_events_name_their_layout() -> None:
    index = TierIndex(cpu_bytes=16)
    store(index, 1, CPU, A)
    store(index, 1, CPU, B)  # same hash, another layout: another block
    assert index.take_events() == [
        LayoutEvent(A.key, BlockStored((BlockHash(1),), None, CPU, 1)),
        LayoutEvent(B.key, BlockStored((BlockHash(1),), None, CPU, 1)),
    ]
