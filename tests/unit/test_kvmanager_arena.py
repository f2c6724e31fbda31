"""The CPU tier's arena: exact-size slots over one mapping, handed back only when the last
reference to a slot dies, never handed out twice, falling back (None) rather than failing."""

from __future__ import annotations

import gc
import threading

import pytest

from services.kvmanager.arena import PAGE_BYTES, Arena


def offset(slot: object) -> int:
    return slot._kv_offset  # type: ignore[attr-defined]


def test_slots_are_exact_size_writable_and_disjoint() -> None:
    arena = Arena(16 * PAGE_BYTES, populate=False)
    slots = [arena.allocate(5000) for _ in range(8)]  # 5000 B rounds to two pages each
    assert all(s is not None for s in slots)
    for i, s in enumerate(slots):
        view = memoryview(s).cast("B")
        assert view.nbytes == 5000 and not view.readonly
        view[:] = bytes([i]) * 5000
    for i, s in enumerate(slots):
        assert bytes(memoryview(s)) == bytes([i]) * 5000  # nobody wrote over anybody
    assert arena.owns(slots[0]) and not arena.owns(bytearray(5000))
    assert arena.allocate(5000) is None  # 8 x 2 pages: full
    assert arena.stats.fallbacks == 1 and arena.stats.in_use_bytes == 16 * PAGE_BYTES


def test_a_slot_returns_only_when_its_last_reader_lets_go() -> None:
    arena = Arena(2 * PAGE_BYTES, populate=False)
    a, b = arena.allocate(PAGE_BYTES), arena.allocate(PAGE_BYTES)
    reader = memoryview(a).cast("B")[10:20]  # e.g. a peer send still in flight
    freed_at = offset(a)
    del a
    gc.collect()
    assert arena.allocate(PAGE_BYTES) is None  # still read: not reusable
    del reader
    c = arena.allocate(PAGE_BYTES)
    assert c is not None and offset(c) == freed_at
    assert b is not None and offset(b) != freed_at


def test_sizes_are_kept_apart_and_other_sizes_fall_back() -> None:
    arena = Arena(4 * PAGE_BYTES, populate=False)
    small = [arena.allocate(PAGE_BYTES) for _ in range(4)]
    assert all(s is not None for s in small)
    small.clear()  # four free one-page slots
    assert arena.allocate(2 * PAGE_BYTES) is None  # no coalescing: the caller uses the heap
    assert arena.allocate(PAGE_BYTES) is not None


def test_populate_faults_everything_in_and_then_serves_all_of_it() -> None:
    arena = Arena(64 * PAGE_BYTES, populate=True)
    assert arena.wait_populated(timeout_s=30)
    assert arena.stats.populated_bytes == arena.capacity_bytes
    slots = [arena.allocate(PAGE_BYTES) for _ in range(64)]
    assert all(s is not None for s in slots)


def test_concurrent_allocation_never_hands_a_slot_out_twice() -> None:
    arena = Arena(256 * PAGE_BYTES, populate=False)
    live: dict[int, int] = {}  # offset -> owner thread
    lock = threading.Lock()
    errors: list[str] = []

    def churn(me: int) -> None:
        held = []
        for i in range(2000):
            s = arena.allocate(PAGE_BYTES)
            if s is not None:
                with lock:
                    if offset(s) in live:
                        errors.append(
                            f"{offset(s)} handed to {me} while {live[offset(s)]} holds it"
                        )
                    live[offset(s)] = me
                held.append(s)
            if len(held) > 40 or (i % 7 == 0 and held):
                gone = held.pop(0)
                with lock:
                    del live[offset(gone)]
                del gone
        with lock:
            for s in held:
                del live[offset(s)]

    threads = [threading.Thread(target=churn, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    gc.collect()
    assert arena.stats.in_use_bytes == 0


def test_too_small_is_refused() -> None:
    with pytest.raises(ValueError, match="at least"):
        Arena(100)
