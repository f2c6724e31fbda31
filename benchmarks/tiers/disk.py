"""Part 2: CPU -> disk demotion and disk -> CPU promotion through ``TieredStore``, beside raw
sequential file I/O on the same filesystem, with a cold page cache for the reads.

Demotion: a store whose RAM budget holds exactly ``n`` blocks is filled with ``n`` blocks, then
``n`` more are put (sequentially, as PutBlocks does): each new put waits while the store writes
an old dirty block back to its file (write-back, the default). Timed from the first new put until
the store is idle and the filesystem is flushed (one ``syncfs``: the store does not fsync by
default, so this makes the figure "bytes on the device", like the limit; the time until idle,
bytes in the page cache, is reported too). The limit: the same bytes written one block after
another into one file, then the same ``syncfs``.

Promotion: the store is closed and opened again on its directory (the disk tier is rebuilt from
the files; RAM is empty), every file is fsynced and evicted with ``posix_fadvise(DONTNEED)`` and
``mincore`` checks that none stayed in the page cache; then ``get`` of each block in chain order
(as GetBlocks does): read the file, check its CRC, promote it to RAM. The limit: one sequential
read of the raw file (evicted the same way) in block-sized reads into one reused buffer.
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from services.kvmanager import diskfile
from services.kvmanager.core.config import StoreConfig
from services.kvmanager.store import TieredStore

from .blocks import SPECS, BlockSpec, count_for, random_blocks
from .limits import (
    Residency,
    evict,
    filesystem_of,
    read_sequential,
    residency,
    sync_filesystem,
    write_sequential,
)
from .report import Figure, gbps, median


@dataclass(frozen=True, slots=True)
class DiskConfig:
    total_bytes: int = 64 << 20  # payload per cell
    repeats: int = 3
    tmp_dir: Path | None = None  # where the files go; None: the system temp directory
    io_threads: int = 4  # the store's I/O threads (its default)


@dataclass(slots=True)
class _Cell:
    demote_s: float
    demote_unsynced_s: float  # until the store was idle: written to the page cache
    write_s: float
    promote_s: float
    read_s: float
    cold: Residency  # of the block files and the raw file, just before reading


async def _cell(spec: BlockSpec, n: int, root: Path, tag: str, io_threads: int) -> _Cell:
    layout = spec.layout(tag)
    payload = [row.tobytes() for row in random_blocks(n, spec.block_bytes, seed=n)]
    store_dir, raw = root / f"store-{tag}", root / f"raw-{tag}.bin"
    config = StoreConfig(
        cpu_bytes=n * spec.block_bytes,
        disk_bytes=4 * n * diskfile.file_bytes(spec.block_bytes),
        disk_dir=store_dir,
        io_threads=io_threads,
    )
    old = list(range(1, n + 1))
    files = [diskfile.block_path(store_dir, layout.key, h) for h in old]
    store = await TieredStore.open(config)
    try:
        for i, h in enumerate(old):
            await store.put(layout, h, payload[i], old[i - 1] if i else None)
        t = time.perf_counter()
        for i in range(n):
            await store.put(layout, n + 1 + i, payload[i], n + i if i else n)
        await store.wait_idle()
        unsynced_s = time.perf_counter() - t
        await asyncio.to_thread(sync_filesystem, store_dir)
        demote_s = time.perf_counter() - t
        if store.stats.demotions != n:
            raise RuntimeError(f"expected {n} demotions, the store did {store.stats.demotions}")
    finally:
        await store.close()
    write_s = await asyncio.to_thread(write_sequential, raw, payload)

    store = await TieredStore.open(config)  # the scan reads headers: evict after it
    try:
        await asyncio.to_thread(evict, [*files, raw])
        cold = await asyncio.to_thread(residency, [*files, raw])
        t = time.perf_counter()
        for i, h in enumerate(old):
            data = await store.get(layout, h)
            if data is None or len(data) != spec.block_bytes:
                raise RuntimeError(f"block {h} did not come back from disk")
            if i == n - 1 and data != payload[i]:
                raise RuntimeError("the last promoted block's bytes differ")
        promote_s = time.perf_counter() - t
        if store.stats.promotions != n:
            raise RuntimeError(f"expected {n} promotions, the store did {store.stats.promotions}")
    finally:
        await store.close()
    read_s, got = await asyncio.to_thread(read_sequential, raw, spec.block_bytes)
    if got != n * spec.block_bytes:
        raise RuntimeError(f"read {got} bytes of the raw file, wrote {n * spec.block_bytes}")
    await asyncio.to_thread(shutil.rmtree, store_dir)
    raw.unlink()
    return _Cell(demote_s, unsynced_s, write_s, promote_s, read_s, cold)


async def _run(cfg: DiskConfig, log: Callable[[str], None]) -> list[Figure]:
    counts = {s: count_for(cfg.total_bytes, s.block_bytes) for s in SPECS}
    root = Path(tempfile.mkdtemp(prefix="kvmesh-bench-tiers-", dir=cfg.tmp_dir))
    fs = filesystem_of(root)
    cells: dict[BlockSpec, list[_Cell]] = defaultdict(list)
    try:
        for r in range(cfg.repeats):
            for spec in SPECS:
                n = counts[spec]
                c = await _cell(spec, n, root, f"{spec.label}-{r}", cfg.io_threads)
                nbytes = n * spec.block_bytes
                log(
                    f"disk {spec.label} run {r}: demote {gbps(nbytes, c.demote_s):.2f}"
                    f" write {gbps(nbytes, c.write_s):.2f} promote {gbps(nbytes, c.promote_s):.2f}"
                    f" read {gbps(nbytes, c.read_s):.2f} GB/s; {c.cold.describe()}"
                )
                cells[spec].append(c)
    finally:
        await asyncio.to_thread(shutil.rmtree, root, True)
    figures = []
    for spec in SPECS:
        n, cs = counts[spec], cells[spec]
        nbytes = n * spec.block_bytes
        fractions = [c.cold.fraction for c in cs]
        verified = all(f is not None for f in fractions)
        worst = max((f for f in fractions if f is not None), default=None)
        cold_note = (
            f"page cache after eviction: at most {worst:.1%} resident (mincore)"
            if verified and worst is not None
            else "page cache eviction NOT verified (mincore unavailable)"
        )
        extra: dict[str, object] = {
            "blocks": n,
            "repeats": cfg.repeats,
            "filesystem": fs,
            "eviction_verified": verified,
            "resident_fraction_max": worst,
        }
        unsynced = median(gbps(nbytes, c.demote_unsynced_s) for c in cs) or 0.0
        figures.append(
            Figure(
                title="CPU -> disk demotion",
                name="demotion",
                value=median(gbps(nbytes, c.demote_s) for c in cs),
                limit_name="seq_write",
                limit=median(gbps(nbytes, c.write_s) for c in cs),
                unit="gbps",
                block_bytes=spec.block_bytes,
                path="TieredStore write-back under RAM pressure, one file per block, + syncfs",
                limit_path="one file, block-sized os.write, + syncfs",
                notes=f"{fs}; to the page cache (until idle, no syncfs): {unsynced:.2f} GB/s",
                extra={**extra, "demotion_unsynced_gbps": unsynced},
            )
        )
        figures.append(
            Figure(
                title="disk -> CPU promotion",
                name="promotion",
                value=median(gbps(nbytes, c.promote_s) for c in cs),
                limit_name="seq_read",
                limit=median(gbps(nbytes, c.read_s) for c in cs),
                unit="gbps",
                block_bytes=spec.block_bytes,
                path="TieredStore.get per block (file read + CRC + into RAM), cold cache",
                limit_path="one file, block-sized readinto, cold cache",
                notes=f"{fs}; {cold_note}",
                extra=extra,
            )
        )
    return figures


def run(cfg: DiskConfig, log: Callable[[str], None] = print) -> list[Figure]:
    return asyncio.run(_run(cfg, log))
