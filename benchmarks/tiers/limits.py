"""This machine's own limits, measured beside the kvmanager figures: memcpy, raw sequential file
I/O, and evicting files from the page cache (with ``mincore`` to check that it worked)."""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np


def memcpy_seconds(src: np.ndarray, dst: np.ndarray) -> float:
    """Copies ``src`` into ``dst`` row by row (one row = one block): the memcpy limit for blocks
    of that size. ``dst`` should be touched already, so page faults are not counted."""
    t = time.perf_counter()
    for i in range(src.shape[0]):
        np.copyto(dst[i], src[i])
    return time.perf_counter() - t


def write_sequential(path: Path, blocks: Sequence[bytes]) -> float:
    """Writes ``blocks`` one after another into one new file, then flushes the filesystem
    (``sync_filesystem``): the raw sequential write limit (seconds)."""
    t = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for b in blocks:
            view = memoryview(b)
            while view:
                view = view[os.write(fd, view) :]
    finally:
        os.close(fd)
    sync_filesystem(path)
    return time.perf_counter() - t


def sync_filesystem(path: Path) -> None:
    """Writes the dirty pages of the filesystem holding ``path`` to the device: one
    ``syncfs(2)`` (``sync(2)`` where libc has no syncfs). One flush for any number of files,
    so many small files and one big file pay the same kind of flush."""
    lib = _libc_or_none()
    syncfs = getattr(lib, "syncfs", None) if lib is not None else None
    if syncfs is None:
        os.sync()
        return
    fd = os.open(path if path.is_dir() else path.parent, os.O_RDONLY)
    try:
        if syncfs(fd) != 0:
            os.sync()
    finally:
        os.close(fd)


def read_sequential(path: Path, block_bytes: int) -> tuple[float, int]:
    """Reads a file from start to end in ``block_bytes`` reads into one reused buffer: the raw
    sequential read limit. (seconds, bytes read)"""
    buf = bytearray(block_bytes)
    total = 0
    t = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            total += n
    return time.perf_counter() - t, total


def evict(paths: Iterable[Path]) -> None:
    """fsync, then ``posix_fadvise(DONTNEED)``: the kernel drops the files' clean pages from the
    page cache (it may keep some; ``resident_bytes`` says what stayed)."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def resident_pages(vec: bytes | bytearray | Sequence[int]) -> int:
    """Pages in core, from a ``mincore`` vector (bit 0 of each byte)."""
    return sum(b & 1 for b in vec)


@dataclass(frozen=True, slots=True)
class Residency:
    """What of some files is in the page cache. ``checked`` False: mincore was not available."""

    checked: bool
    resident_bytes: int = 0
    total_bytes: int = 0

    @property
    def fraction(self) -> float | None:
        if not self.checked:
            return None
        return self.resident_bytes / self.total_bytes if self.total_bytes else 0.0

    def describe(self) -> str:
        if not self.checked:
            return "page cache eviction NOT verified (mincore unavailable)"
        return f"{self.fraction:.1%} of the files in the page cache before reading (mincore)"


_libc: ctypes.CDLL | None = None


def _mincore_lib() -> ctypes.CDLL | None:
    global _libc
    if _libc is None:
        name = ctypes.util.find_library("c")
        if name is None:
            return None
        lib = ctypes.CDLL(name, use_errno=True)
        lib.mmap.restype = ctypes.c_void_p
        lib.mmap.argtypes = [
            ctypes.c_void_p,
            ctypes.c_size_t,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_long,
        ]
        lib.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        lib.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        _libc = lib
    return _libc


def _libc_or_none() -> ctypes.CDLL | None:
    try:
        return _mincore_lib()
    except (OSError, AttributeError):
        return None


def residency(paths: Iterable[Path]) -> Residency:
    """How many bytes of ``paths`` are in the page cache now (``mincore`` on a fresh mapping,
    which faults nothing in)."""
    lib = _libc_or_none()
    if lib is None:
        return Residency(False)
    page = mmap.PAGESIZE
    resident = total = 0
    for p in paths:
        size = p.stat().st_size
        total += size
        if size == 0:
            continue
        fd = os.open(p, os.O_RDONLY)
        try:
            addr = lib.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
            if addr in (None, ctypes.c_void_p(-1).value):
                return Residency(False)
            try:
                vec = (ctypes.c_ubyte * ((size + page - 1) // page))()
                if lib.mincore(addr, size, vec) != 0:
                    return Residency(False)
                resident += min(size, resident_pages(bytes(vec)) * page)
            finally:
                lib.munmap(addr, size)
        finally:
            os.close(fd)
    return Residency(True, resident, total)


def filesystem_of(path: Path) -> str:
    """The filesystem type ``path`` lives on (longest mount point in /proc/mounts), or '?'."""
    best, fs = "", "?"
    real = str(path.resolve())
    try:
        mounts = Path("/proc/mounts").read_text().splitlines()
    except OSError:
        return fs
    for line in mounts:
        parts = line.split()
        if len(parts) < 3:
            continue
        mnt = parts[1]
        inside = real == mnt or real.startswith(mnt.rstrip("/") + "/")
        if inside and len(mnt) >= len(best):
            best, fs = mnt, parts[2]
    return fs
