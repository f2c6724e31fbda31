"""LMCache 0.5.6's LocalCPU/LocalDisk backends vs a plain-Python block store, side by side.

The project's venv does not carry LMCache (see docs/kvmanager-lmcache.md). To run the LMCache
side, install it into a separate target directory and put that on PYTHONPATH:

    .venv/bin/pip install --no-deps --target /tmp/lmc-site lmcache==0.5.6 aiofile==3.12.3 caio==0.12.10
    LMCACHE_TRACK_USAGE=false PYTHONPATH=/tmp/lmc-site \\
        .venv/bin/python benchmarks/lmcache_store_bench.py [--volume-mib 128] [--reps 3] [--dir /tmp]

Without LMCache importable it says so and measures only the plain store.

What is measured, per block size (64 KiB, 1 MiB, 4 MiB; a 32-token vLLM block of Llama-3-8B in
bf16 is 4 MiB, of SmolLM2-135M about 720 KiB), ``--volume-mib`` of distinct random blocks:

- ``lmcache-cpu``: ``LocalCPUBackend`` on its own ``MixedMemoryAllocator`` arena. put = allocate +
  copy the bytes into the arena + ``submit_put_task``; get = ``get_blocking`` (a zero-copy,
  ref-counted view) + ``ref_count_down``.
- ``lmcache-disk``: ``LocalDiskBackend`` in a temp dir, its writes on its own asyncio loop thread
  (4 I/O workers, its default); put time runs until every write's completion callback has fired;
  get = ``get_blocking`` (allocate a staging buffer + ``readinto``).
- ``plain-cpu``: bytes in an OrderedDict with a byte budget and LRU (the stored object is the
  caller's immutable ``bytes``: no copy).
- ``plain-disk``: one file per block, a 32-byte header (magic, block hash, length, zlib.crc32),
  written to a temp name and renamed, synchronously on the caller's thread; get reads the file,
  checks header, length and CRC.

Each cell is the median of ``--reps`` runs, the backends interleaved within each rep. Disk reads
come from the page cache for both (the files were just written). Then a table of behaviour checks
(restart, corrupt files, LRU on read, budgets) and the cost of a put into a full disk tier.
Everything prints as markdown. About 20-40 s on 2 shared cores.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shutil
import statistics
import struct
import sys
import tempfile
import threading
import time
import zlib
from collections import OrderedDict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")
os.environ.setdefault("LMCACHE_LOG_LEVEL", "ERROR")

MiB = 1024 * 1024
GiB = 1024 * MiB
LAYOUT = "bench-layout-b32"  # stands in for our (model, dtype, block layout) identity
SIZES = (64 * 1024, MiB, 4 * MiB)


# --------------------------------------------------------------------------------------------
# The plain-Python baseline: what our own store would do, minimally.


class PlainCpuStore:
    """Bytes in an OrderedDict (LRU order), a hard byte budget, pins that block eviction."""

    def __init__(self, budget: int, on_evict: Callable[[int, bytes], None] | None = None) -> None:
        self.budget = budget
        self.used = 0
        self.blocks: OrderedDict[int, bytes] = OrderedDict()
        self.pins: dict[int, int] = {}
        self.on_evict = on_evict  # write-back demotion hook (to the disk tier)

    def put(self, key: int, data: bytes) -> bool:
        if key in self.blocks:
            self.blocks.move_to_end(key)
            return True
        if len(data) > self.budget:
            return False
        need = self.used + len(data) - self.budget
        if need > 0:
            victims = []
            for k, v in self.blocks.items():  # LRU first
                if not self.pins.get(k):
                    victims.append(k)
                    need -= len(v)
                    if need <= 0:
                        break
            if need > 0:
                return False  # pinned blocks fill the tier: refuse, evict nothing
            for k in victims:
                v = self.blocks.pop(k)
                self.used -= len(v)
                if self.on_evict is not None:
                    self.on_evict(k, v)
        self.blocks[key] = data
        self.used += len(data)
        return True

    def get(self, key: int) -> bytes | None:
        data = self.blocks.get(key)
        if data is not None:
            self.blocks.move_to_end(key)
        return data

    def pin(self, key: int) -> None:
        self.pins[key] = self.pins.get(key, 0) + 1

    def unpin(self, key: int) -> None:
        if self.pins.get(key, 0) <= 1:
            self.pins.pop(key, None)
        else:
            self.pins[key] -= 1


_HDR = struct.Struct("<4sHHQQI4x")  # magic, version, flags, block hash, payload length, crc32
_MAGIC = b"KVB1"


class PlainDiskStore:
    """One file per block: header + payload, tmp+rename on write, CRC verified on every read.
    The index (LRU order by mtime) is rebuilt from the directory on open."""

    def __init__(self, root: Path, budget: int) -> None:
        self.root = root
        self.budget = budget
        self.used = 0
        self.index: OrderedDict[int, int] = OrderedDict()  # hash -> file size, LRU first
        self.pins: dict[int, int] = {}
        root.mkdir(parents=True, exist_ok=True)
        found = []
        for entry in os.scandir(root):
            if entry.name.endswith(".tmp"):
                os.unlink(entry.path)  # a write that never finished
                continue
            st = entry.stat()
            try:
                key = int(entry.name.removesuffix(".kvb"), 16)
                with open(entry.path, "rb") as f:
                    magic, _, _, h, n, _ = _HDR.unpack(f.read(_HDR.size))
                ok = magic == _MAGIC and h == key and st.st_size == _HDR.size + n
            except (ValueError, struct.error):
                ok = False
            if not ok:
                os.unlink(entry.path)  # truncated or foreign: never served
                continue
            found.append((st.st_mtime_ns, key, st.st_size))
        for _, key, size in sorted(found):
            self.index[key] = size
            self.used += size
        # a smaller budget than what was found: evict down to it now
        self._make_room(0)

    def _path(self, key: int) -> str:
        return os.path.join(self.root, f"{key:016x}.kvb")

    def _make_room(self, size: int) -> bool:
        need = self.used + size - self.budget
        while need > 0:
            victim = next((k for k in self.index if not self.pins.get(k)), None)
            if victim is None:
                return False
            need -= self._drop(victim)
        return True

    def _drop(self, key: int) -> int:
        size = self.index.pop(key)
        self.used -= size
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._path(key))
        return size

    def put(self, key: int, data: bytes) -> bool:
        if key in self.index:
            self.index.move_to_end(key)
            return True
        size = _HDR.size + len(data)
        if size > self.budget or not self._make_room(size):
            return False
        path = self._path(key)
        tmp = path + ".tmp"
        with open(tmp, "wb") as f:
            f.write(_HDR.pack(_MAGIC, 1, 0, key, len(data), zlib.crc32(data)))
            f.write(data)
        os.replace(tmp, path)
        self.index[key] = size
        self.used += size
        return True

    def get(self, key: int) -> memoryview | None:
        if key not in self.index:
            return None
        try:
            with open(self._path(key), "rb") as f:
                raw = f.read()
        except FileNotFoundError:
            raw = b""
        view = memoryview(raw)
        ok = len(raw) >= _HDR.size
        if ok:
            magic, _, _, h, n, crc = _HDR.unpack_from(raw)
            payload = view[_HDR.size :]
            ok = magic == _MAGIC and h == key and len(payload) == n and zlib.crc32(payload) == crc
        if not ok:
            self._drop(key)  # corrupt, truncated or gone: drop it, report a miss
            return None
        self.index.move_to_end(key)
        return payload


# --------------------------------------------------------------------------------------------
# LMCache, driven standalone (no vLLM engine, no StorageManager).


class Lmc:
    """The few LMCache pieces the benchmark drives, imported lazily."""

    def __init__(self) -> None:
        import torch
        from lmcache.utils import CacheEngineKey
        from lmcache.v1.config import LMCacheEngineConfig
        from lmcache.v1.memory_allocators.mixed_memory_allocator import MixedMemoryAllocator
        from lmcache.v1.memory_management import MemoryFormat
        from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend
        from lmcache.v1.storage_backend.local_disk_backend import LocalDiskBackend

        self.torch = torch
        self.Key = CacheEngineKey
        self.Config = LMCacheEngineConfig
        self.Arena = MixedMemoryAllocator
        self.fmt = MemoryFormat.KV_2LTD
        self.Cpu = LocalCPUBackend
        self.Disk = LocalDiskBackend
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def key(self, block_hash: int) -> Any:
        # Our key maps onto CacheEngineKey: layout -> model_name, 64-bit hash -> chunk_hash.
        return self.Key(
            model_name=LAYOUT,
            world_size=1,
            worker_id=0,
            chunk_hash=block_hash,
            dtype=self.torch.uint8,
        )

    def cpu(self, budget: int, hot: bool = True) -> Any:
        cfg = self.Config.from_defaults(
            chunk_size=32,
            local_cpu=hot,
            max_local_cpu_size=budget / GiB,
            lmcache_instance_id="bench",
        )
        return self.Cpu(cfg, memory_allocator=self.Arena(budget))

    def disk(self, path: Path, budget: int, staging: Any) -> Any:
        cfg = self.Config.from_defaults(
            chunk_size=32,
            local_cpu=False,
            local_disk=str(path),
            max_local_disk_size=budget / GiB,
            lmcache_instance_id="bench",
        )
        return self.Disk(cfg, self.loop, staging)

    def obj(self, cpu: Any, data: bytes, busy_loop: bool = True) -> Any:
        m = cpu.allocate(
            self.torch.Size([1, 1, 1, len(data)]), self.torch.uint8, self.fmt, busy_loop=busy_loop
        )
        if m is not None:
            m.byte_array.cast("B")[:] = data
        return m

    def wait_disk(self, disk: Any, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while disk.disk_worker.put_tasks and time.monotonic() < deadline:
            time.sleep(0.0005)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=5)


# --------------------------------------------------------------------------------------------
# Throughput


def blocks_of(size: int, volume: int) -> list[bytes]:
    n = max(4, volume // size)
    pool = os.urandom(size * n)
    return [pool[i * size : (i + 1) * size] for i in range(n)]


Timing = tuple[float, float]  # put seconds, get seconds


def run_plain_cpu(blocks: list[bytes], base: int, copy: bool = False) -> Timing:
    store = PlainCpuStore(budget=len(blocks) * len(blocks[0]))
    t0 = time.perf_counter()
    for i, b in enumerate(blocks):
        # copy: the bytes arrive in a buffer the caller reuses (as LMCache's put always copies)
        store.put(base + i, bytes(memoryview(b)) if copy else b)
    t1 = time.perf_counter()
    for i in range(len(blocks)):
        v = store.get(base + i)
        assert v is not None
    t2 = time.perf_counter()
    return t1 - t0, t2 - t1


def run_plain_disk(blocks: list[bytes], base: int, root: Path) -> Timing:
    path = Path(tempfile.mkdtemp(prefix="plain-", dir=root))
    try:
        store = PlainDiskStore(path, budget=2 * len(blocks) * (len(blocks[0]) + 64))
        t0 = time.perf_counter()
        for i, b in enumerate(blocks):
            store.put(base + i, b)
        t1 = time.perf_counter()
        for i in range(len(blocks)):
            v = store.get(base + i)
            assert v is not None
        t2 = time.perf_counter()
        return t1 - t0, t2 - t1
    finally:
        shutil.rmtree(path, ignore_errors=True)


def run_lmc_cpu(lmc: Lmc, blocks: list[bytes], base: int) -> Timing:
    cpu = lmc.cpu(budget=len(blocks) * len(blocks[0]) + 16 * MiB)
    keys = [lmc.key(base + i) for i in range(len(blocks))]
    try:
        t0 = time.perf_counter()
        for k, b in zip(keys, blocks, strict=True):
            m = lmc.obj(cpu, b)
            cpu.submit_put_task(k, m)
            m.ref_count_down()
        t1 = time.perf_counter()
        for k in keys:
            m = cpu.get_blocking(k)
            assert m is not None and len(m.byte_array) == len(blocks[0])
            m.ref_count_down()
        t2 = time.perf_counter()
        return t1 - t0, t2 - t1
    finally:
        cpu.close()


def run_lmc_disk(lmc: Lmc, blocks: list[bytes], base: int, root: Path, staging: Any) -> Timing:
    path = Path(tempfile.mkdtemp(prefix="lmc-", dir=root))
    disk = lmc.disk(path, 2 * len(blocks) * len(blocks[0]), staging)
    keys = [lmc.key(base + i) for i in range(len(blocks))]
    done = threading.Semaphore(0)
    try:
        t0 = time.perf_counter()
        for k, b in zip(keys, blocks, strict=True):
            m = lmc.obj(staging, b)
            disk.submit_put_task(k, m, on_complete_callback=lambda _k: done.release())
            m.ref_count_down()
        for _ in keys:
            if not done.acquire(timeout=60):
                raise RuntimeError("LMCache disk writes did not complete")
        t1 = time.perf_counter()
        for k in keys:
            m = disk.get_blocking(k)
            assert m is not None and len(m.byte_array) == len(blocks[0])
            m.ref_count_down()
        t2 = time.perf_counter()
        return t1 - t0, t2 - t1
    finally:
        disk.close()
        shutil.rmtree(path, ignore_errors=True)


def throughput(lmc: Lmc | None, volume: int, reps: int, root: Path) -> list[str]:
    names = ["plain-cpu", "plain-cpu+copy", "plain-disk"] + (
        ["lmcache-cpu", "lmcache-disk"] if lmc else []
    )
    staging = lmc.cpu(budget=volume + 32 * MiB, hot=False) if lmc else None
    rows = []
    base = 1 << 40
    for size in SIZES:
        blocks = blocks_of(size, volume)
        results: dict[str, list[Timing]] = {n: [] for n in names}
        for _ in range(reps):
            for name in names:
                base += len(blocks)
                if name.startswith("plain-cpu"):
                    results[name].append(run_plain_cpu(blocks, base, copy=name.endswith("copy")))
                elif name == "plain-disk":
                    results[name].append(run_plain_disk(blocks, base, root))
                elif name == "lmcache-cpu":
                    assert lmc is not None
                    results[name].append(run_lmc_cpu(lmc, blocks, base))
                else:
                    assert lmc is not None
                    results[name].append(run_lmc_disk(lmc, blocks, base, root, staging))
        total = len(blocks) * size
        for name in names:
            put = statistics.median(t[0] for t in results[name])
            get = statistics.median(t[1] for t in results[name])
            rows.append(
                f"| {size // 1024} KiB | {name} | {len(blocks)} | {total / put / 1e6:,.0f} | "
                f"{len(blocks) / put:,.0f} | {total / get / 1e6:,.0f} | {len(blocks) / get:,.0f} |"
            )
        del blocks
    if staging is not None:
        staging.close()
    return rows


# --------------------------------------------------------------------------------------------
# Behaviour checks


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _corrupt(path: str, how: str) -> None:
    if how == "truncate":
        os.truncate(path, 100)
    elif how == "flip":
        with open(path, "r+b") as f:
            f.seek(4000)
            b = f.read(1)
            f.seek(4000)
            f.write(bytes([b[0] ^ 0xFF]))
    else:
        os.unlink(path)


def _describe(got: bytes | None, want: bytes, raised: str | None = None) -> str:
    if raised:
        return f"raises {raised}"
    if got is None:
        return "miss (dropped)"
    if got == want:
        return "served, intact"
    same = next((i for i, (a, b) in enumerate(zip(got, want, strict=True)) if a != b), len(got))
    return f"**served, wrong bytes** (first {same} B right)"


def checks_plain(root: Path) -> dict[str, str]:
    out: dict[str, str] = {}
    blk = 64 * 1024
    data = [os.urandom(blk) for _ in range(40)]
    path = Path(tempfile.mkdtemp(prefix="plain-chk-", dir=root))
    budget = 16 * (blk + _HDR.size)
    try:
        d = PlainDiskStore(path, budget)
        for i, b in enumerate(data):
            d.put(i, b)
        kept = sorted(d.index)
        out["burst"] = f"{len(kept)} kept: keys {kept[0]}-{kept[-1]} (the newest)"
        d2 = PlainDiskStore(path, budget)
        out["restart"] = f"{len(d2.index)} of {len(os.listdir(path))} files indexed"
        for i in range(100, 116):
            d2.put(i, data[i % 40])
        used = sum(e.stat().st_size for e in os.scandir(path))
        out["restart-budget"] = f"{used / budget:.2f} x budget"
        for how, key in (("truncate", 100), ("flip", 101), ("delete", 102)):
            _corrupt(d2._path(key), how)
            out[how] = _describe(None if (v := d2.get(key)) is None else bytes(v), data[key % 40])
    finally:
        shutil.rmtree(path, ignore_errors=True)
    c = PlainCpuStore(8 * 120 * 1024)
    for i in range(8):
        c.put(i, bytes([i]) * 120 * 1024)
    c.get(0)
    c.put(100, b"z" * 120 * 1024)
    out["lru-get"] = "kept" if c.get(0) is not None else "evicted"
    n = len(c.blocks)
    c.put(200, b"q" * (2 * 8 * 120 * 1024))
    out["oversize"] = f"refused; {n - len(c.blocks)} of {n} evicted"
    r0 = _rss()
    PlainCpuStore(256 * MiB)
    out["rss"] = f"+{(_rss() - r0) / MiB:.0f} MiB"
    return out


def checks_lmc(lmc: Lmc, root: Path) -> dict[str, str]:
    out: dict[str, str] = {}
    blk = 64 * 1024
    data = [os.urandom(blk) for _ in range(40)]
    path = Path(tempfile.mkdtemp(prefix="lmc-chk-", dir=root))
    budget = 16 * blk
    staging = lmc.cpu(budget=64 * MiB, hot=False)
    try:
        d = lmc.disk(path, budget, staging)
        for i, b in enumerate(data):
            m = lmc.obj(staging, b)
            d.submit_put_task(lmc.key(i), m)
            m.ref_count_down()
        lmc.wait_disk(d)
        kept = sorted(k.chunk_hash for k in d.dict)
        out["burst"] = f"{len(kept)} kept: keys {kept[0]}-{kept[-1]} (newer puts dropped)"
        d.close()
        d2 = lmc.disk(path, budget, staging)
        out["restart"] = f"{len(d2.dict)} of {len(os.listdir(path))} files indexed"
        for i in range(100, 116):
            m = lmc.obj(staging, data[i % 40])
            d2.submit_put_task(lmc.key(i), m)
            m.ref_count_down()
        lmc.wait_disk(d2)
        used = sum(e.stat().st_size for e in os.scandir(path))
        out["restart-budget"] = f"{used / budget:.2f} x budget (old files orphaned)"
        for how, key in (("truncate", 100), ("flip", 101), ("delete", 102)):
            k = lmc.key(key)
            _corrupt(d2.dict[k].path, how)
            # Fill the free staging memory with junk, as other blocks' bytes would be in a
            # running system; a read that does not fill its buffer then shows up.
            junk = [lmc.obj(staging, b"\xaa" * blk, busy_loop=False) for _ in range(1024)]
            for j in junk:
                if j is not None:
                    j.ref_count_down()
            try:
                m = d2.get_blocking(k)
            except Exception as e:
                out[how] = _describe(None, b"", type(e).__name__)
                continue
            got = None if m is None else bytes(m.byte_array)
            if m is not None:
                m.ref_count_down()
            out[how] = _describe(got, data[key % 40])
        d2.close()
    finally:
        staging.close()
        shutil.rmtree(path, ignore_errors=True)
    c = lmc.cpu(budget=8 * 120 * 1024)
    for i in range(8):
        m = lmc.obj(c, bytes([i]) * 120 * 1024)
        c.submit_put_task(lmc.key(i), m)
        m.ref_count_down()
    m = c.get_blocking(lmc.key(0))
    m.ref_count_down()
    m = lmc.obj(c, b"z" * 120 * 1024)
    c.submit_put_task(lmc.key(100), m)
    m.ref_count_down()
    out["lru-get"] = "kept" if c.contains(lmc.key(0)) else "evicted (get_blocking is no LRU hit)"
    n = len(c.get_keys())
    m = lmc.obj(c, b"q" * (2 * 8 * 120 * 1024), busy_loop=False)
    out["oversize"] = f"refused; {n - len(c.get_keys())} of {n} evicted"
    c.close()
    r0 = _rss()
    c = lmc.cpu(budget=256 * MiB)
    out["rss"] = f"+{(_rss() - r0) / MiB:.0f} MiB (arena reserved up front)"
    c.close()
    return out


CHECKS = [
    ("burst", "disk tier of 16 blocks, 40 puts submitted at once"),
    ("restart", "disk index after reopening the directory"),
    ("restart-budget", "bytes in the dir after reopen + 16 more puts"),
    ("truncate", "get of a truncated file"),
    ("flip", "get of a file with one flipped byte"),
    ("delete", "get of an indexed block whose file was deleted"),
    ("lru-get", "cpu: block read, then one put under pressure"),
    ("oversize", "cpu: put larger than the whole tier"),
    ("rss", "cpu: RSS right after creating a 256 MiB tier"),
]


def full_disk_put_cost(lmc: Lmc | None, root: Path, n: int) -> list[str]:
    """Per-put time while filling a disk tier of n 4 KiB blocks, then at budget (each put evicts)."""
    blk = 4096
    payload = os.urandom(blk)
    rows = []
    extra = 500

    def timed(fn: Callable[[int], object], keys: Iterator[int], count: int) -> float:
        t0 = time.perf_counter()
        for _ in range(count):
            fn(next(keys))
        return (time.perf_counter() - t0) / count * 1e6

    path = Path(tempfile.mkdtemp(prefix="plain-full-", dir=root))
    try:
        d = PlainDiskStore(path, n * (blk + _HDR.size))
        keys = iter(range(10**9))
        fill = timed(lambda k: d.put(k, payload), keys, n)
        full = timed(lambda k: d.put(k, payload), keys, extra)
        rows.append(f"| plain-disk | {n} | {fill:.0f} | {full:.0f} |")
    finally:
        shutil.rmtree(path, ignore_errors=True)
    if lmc is not None:
        path = Path(tempfile.mkdtemp(prefix="lmc-full-", dir=root))
        staging = lmc.cpu(budget=64 * MiB, hot=False)
        d = lmc.disk(path, n * blk, staging)
        done = threading.Semaphore(0)
        try:

            def put(k: int) -> bool:
                key = lmc.key(k)
                m = lmc.obj(staging, payload)
                d.submit_put_task(key, m, on_complete_callback=lambda _k: done.release())
                m.ref_count_down()
                # admitted: its write is queued, or already done (insert precedes the unqueue)
                return d.disk_worker.exists_in_put_tasks(key) or key in d.dict

            def timed_drained(keys: Iterator[int], count: int) -> float:
                t0 = time.perf_counter()
                admitted = sum(put(next(keys)) for _ in range(count))
                if admitted < count:
                    print(f"(lmcache-disk dropped {count - admitted} of {count} puts)")
                for _ in range(admitted):  # until every admitted write has completed
                    if not done.acquire(timeout=60):
                        raise RuntimeError("LMCache disk writes did not complete")
                return (time.perf_counter() - t0) / count * 1e6

            keys = iter(range(10**9))
            fill = timed_drained(keys, n)
            full = timed_drained(keys, extra)
            rows.append(f"| lmcache-disk | {n} | {fill:.0f} | {full:.0f} |")
        finally:
            d.close()
            staging.close()
            shutil.rmtree(path, ignore_errors=True)
    return rows


def checksum_speed() -> str:
    data = os.urandom(64 * MiB)
    out = []
    t0 = time.perf_counter()
    zlib.crc32(data)
    out.append(f"zlib.crc32 {64 * MiB / (time.perf_counter() - t0) / 1e6:,.0f} MB/s")
    try:
        import blake3

        t0 = time.perf_counter()
        blake3.blake3(data).digest()
        out.append(f"blake3 {64 * MiB / (time.perf_counter() - t0) / 1e6:,.0f} MB/s")
    except ImportError:
        pass
    return ", ".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--volume-mib", type=int, default=128, help="data per block size and backend")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dir", default=tempfile.gettempdir(), help="where the disk tiers live")
    ap.add_argument(
        "--full-blocks", default="1000,5000", help="disk tier sizes (blocks) for the full-tier test"
    )
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="kvstore-bench-", dir=args.dir))

    lmc: Lmc | None = None
    try:
        import lmcache

        lmc = Lmc()
        print(
            f"LMCache {getattr(lmcache, '__version__', '?')} from {Path(lmcache.__file__).parent}"
        )
    except ImportError as e:
        print(
            f"SKIPPED the LMCache side: lmcache is not importable ({e}).\n"
            "It is not a dependency of this project; to measure it, install it into a side "
            "target and run with PYTHONPATH (see the top of this file):\n"
            "  .venv/bin/pip install --no-deps --target /tmp/lmc-site lmcache==0.5.6 "
            "aiofile==3.12.3 caio==0.12.10\n"
            "  LMCACHE_TRACK_USAGE=false PYTHONPATH=/tmp/lmc-site .venv/bin/python "
            "benchmarks/lmcache_store_bench.py\n"
            "Measuring the plain store only.\n"
        )
    t_start = time.perf_counter()
    try:
        print(
            f"## Throughput ({args.volume_mib} MiB per cell, median of {args.reps}, dir {root})\n"
        )
        print("| block | store | blocks | put MB/s | put blocks/s | get MB/s | get blocks/s |")
        print("|---|---|---|---|---|---|---|")
        for row in throughput(lmc, args.volume_mib * MiB, args.reps, root):
            print(row, flush=True)

        print("\n## Behaviour checks (64 KiB blocks)\n")
        plain = checks_plain(root)
        lm = checks_lmc(lmc, root) if lmc else {}
        print("| check | lmcache | plain |")
        print("|---|---|---|")
        for key, what in CHECKS:
            print(f"| {what} | {lm.get(key, 'n/a')} | {plain[key]} |")

        print("\n## Put into a disk tier of 4 KiB blocks (µs per put, writes drained)\n")
        print("| store | tier blocks | filling | at budget (each put evicts) |")
        print("|---|---|---|---|")
        for n in (int(x) for x in args.full_blocks.split(",")):
            for row in full_disk_put_cost(lmc, root, n):
                print(row, flush=True)
        print(f"\nchecksum speed, one thread: {checksum_speed()}")
        print(f"\ntotal {time.perf_counter() - t_start:.1f} s")
    finally:
        if lmc is not None:
            lmc.close()
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
