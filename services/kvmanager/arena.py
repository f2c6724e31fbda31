"""The CPU tier's memory: one anonymous mapping of the tier's budget, carved into page-aligned
slots that blocks are received, copied or read into, and reused as blocks come and go.

Why: a block kept in a fresh Python ``bytes`` lands in memory the kernel has never mapped, so
every 4 KiB of it takes a page fault and a page of zeroing on the way in. Measured here
(docs/kvmanager-dataplane.md), receiving 2 MiB blocks into fresh kept buffers ran at 0.26-0.35x
of raw loopback TCP, into pre-faulted arena slots at 0.72-0.83x. The arena maps its budget once,
asks for transparent huge pages, and faults it in on a background thread at start
(``populate``), so the hot path writes into memory that is already there.

A slot is a ``ctypes`` char array over the mapping (a buffer: ``memoryview(slot)`` views it, no
copy). Its lifetime is Python's own: the slot goes back to the arena when its last reference
(the store's, or a reader's memoryview) is gone, never while anything can still read it; so a
block evicted while a peer is still being sent its bytes cannot be overwritten under the send.

Allocation is exact-size: freed slots are kept per (page-rounded) size and reused by the next
block of that size; fresh slots come off the top of the mapping, below the populated mark. When
neither has room (the budget is used by slots readers still hold, by slots of other sizes, or
not yet populated), ``allocate`` answers None and the caller falls back to a heap buffer: the
arena is a fast path, never a reason to refuse a block. Thread-safe (the data plane's receive
threads allocate; slots die on whichever thread drops them last).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import mmap
import threading
import time
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

PAGE_BYTES = 4096
_POPULATE_CHUNK_BYTES = 64 << 20


def _round_up(size: int) -> int:
    return -(-size // PAGE_BYTES) * PAGE_BYTES


@dataclass(slots=True)
class ArenaStats:
    """Counters since start (for metrics and benchmarks)."""

    capacity_bytes: int = 0
    populated_bytes: int = 0  # faulted in so far (all of it once populate is done)
    populate_seconds: float = 0.0
    in_use_bytes: int = 0  # slots alive (the store's and readers')
    allocations: int = 0
    fallbacks: int = 0  # allocate() answered None: the caller used the heap


class Arena:
    """``Arena(capacity_bytes)``; ``allocate(size)`` -> a slot (a writable buffer of exactly
    ``size`` bytes) or None. ``close()`` stops populating; live slots stay valid."""

    def __init__(self, capacity_bytes: int, *, populate: bool = True) -> None:
        if capacity_bytes < PAGE_BYTES:
            raise ValueError(f"an arena needs at least {PAGE_BYTES} bytes, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes - capacity_bytes % PAGE_BYTES
        self._map = mmap.mmap(-1, self.capacity_bytes)
        with contextlib.suppress(AttributeError, OSError):  # THP off or not Linux: 4 KiB pages
            self._map.madvise(mmap.MADV_HUGEPAGE)
        self._lock = threading.Lock()
        self._free: dict[int, list[int]] = {}  # rounded size -> offsets of free slots
        self._top = 0  # slots below it have been handed out at least once
        self._types: dict[int, type[Any]] = {}
        self._closed = False
        self.stats = ArenaStats(capacity_bytes=self.capacity_bytes)
        if populate:
            self._ready = 0  # bytes faulted in: fresh slots come from below this mark
            self._populator: threading.Thread | None = threading.Thread(
                target=self._populate, name="kvstore-arena-populate", daemon=True
            )
            self._populator.start()
        else:  # pages fault in on first use; reused slots are still fault-free
            self._ready = self.capacity_bytes
            self._populator = None
            self.stats.populated_bytes = self.capacity_bytes

    def allocate(self, size: int) -> Any | None:
        """A slot of ``size`` bytes (contents undefined), or None when the arena has no room
        for it right now."""
        if size <= 0 or self._closed:
            return None
        rounded = _round_up(size)
        with self._lock:
            offsets = self._free.get(rounded)
            if offsets:
                offset = offsets.pop()
            elif self._top + rounded <= self._ready:
                offset, self._top = self._top, self._top + rounded
            else:
                self.stats.fallbacks += 1
                return None
            self.stats.allocations += 1
            self.stats.in_use_bytes += rounded
            slot_type = self._types.get(size)
            if slot_type is None:
                slot_type = self._types[size] = _slot_type(size)
        slot = slot_type.from_buffer(self._map, offset)
        slot._kv_arena = self
        slot._kv_offset = offset
        return slot

    def owns(self, obj: object) -> bool:
        """Whether ``obj`` is a slot of this arena (a memoryview's ``.obj`` for one)."""
        return getattr(obj, "_kv_arena", None) is self

    def _release(self, offset: int, size: int) -> None:
        rounded = _round_up(size)
        with self._lock:
            self._free.setdefault(rounded, []).append(offset)
            self.stats.in_use_bytes -= rounded

    def close(self) -> None:
        """Stops the populate thread (at its next chunk). The mapping lives on while slots do."""
        self._closed = True

    def wait_populated(self, timeout_s: float | None = None) -> bool:
        """Waits for the populate thread; True once the whole arena is faulted in."""
        if self._populator is not None:
            self._populator.join(timeout_s)
        return self._ready >= self.capacity_bytes

    def _populate(self) -> None:
        """Faults the mapping in, a chunk at a time (one write per page; with huge pages, one
        fault per 2 MiB), raising the mark fresh slots may come from as it goes."""
        started = time.monotonic()
        base = ctypes.addressof(ctypes.c_char.from_buffer(self._map))
        offset = 0
        while offset < self.capacity_bytes and not self._closed:
            chunk = min(_POPULATE_CHUNK_BYTES, self.capacity_bytes - offset)
            ctypes.memset(base + offset, 0, chunk)  # a foreign call: releases the GIL
            offset += chunk
            with self._lock:
                self._ready = offset
                self.stats.populated_bytes = offset
        self.stats.populate_seconds = time.monotonic() - started
        log.info(
            "CPU tier arena: %d MiB populated in %.2f s",
            offset >> 20,
            self.stats.populate_seconds,
        )


def _slot_type(size: int) -> type[Any]:
    """A char-array type of ``size`` bytes whose instances give their memory back to their
    arena when they die."""
    base: Any = ctypes.c_char * size

    def __del__(self: Any) -> None:
        arena = getattr(self, "_kv_arena", None)
        if arena is not None:
            arena._release(self._kv_offset, size)

    return type(f"ArenaSlot{size}", (base,), {"__del__": __del__})
