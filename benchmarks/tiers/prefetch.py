"""What session prefetch buys (docs/agents.md#prefetch): a retained session's next-turn load from
the kvmanager's disk tier, against the same load after ``PrefetchSession`` brought the chain into
RAM, and the prefetch's own time (the head start it needs).

Per cell: a ``TieredStore`` with a disk tier holds one session's chain of ``n`` blocks, retained;
the store is closed and opened again on its directory (RAM empty, the chain on disk only: what a
session whose copies were written back while its tool ran looks like), the session pinned again,
and every file evicted from the page cache (``posix_fadvise(DONTNEED)``, checked by ``mincore``).
Then, timed with ``get`` of each block in chain order (what the connector's GetBlocks does):

- ``disk``: the load with no prefetch (each block read from its file, checked, promoted);
- ``prefetch``: ``prefetch_session`` alone (the promotions, in parallel on the store's I/O
  threads), then the load (``ram``: every block from RAM);
- ``race``: the prefetch and the load started together (the turn arrives with no head start:
  the load reads what the prefetch has not landed yet from disk itself).

Run: ``python -m benchmarks.tiers.prefetch`` (``--json`` for one object per cell).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from kvmesh.kv.layout import KvLayout
from services.kvmanager import diskfile
from services.kvmanager.core.config import RetentionConfig, StoreConfig
from services.kvmanager.store import TieredStore

from .blocks import SPECS, BlockSpec, random_blocks
from .limits import evict, residency
from .report import median

SESSION = "agent"


@dataclass(frozen=True, slots=True)
class Cell:
    block: str
    blocks: int
    disk_load_ms: float  # the load with no prefetch
    prefetch_ms: float  # PrefetchSession's promotions alone
    ram_load_ms: float  # the load after the prefetch
    race_ms: float  # prefetch and load started together: until the load ended
    resident_before_pct: float  # the chain's file pages in the page cache before a timed read


async def _open(config: StoreConfig, layout: KvLayout, chain: list[int]) -> TieredStore:
    """The store on its directory (RAM empty), the session pinned, the files evicted."""
    store = await TieredStore.open(config, retention=RetentionConfig(bytes=config.disk_bytes // 2))
    store.retain_session("", SESSION, layout.key, chain, ttl_s=600)
    return store


async def _load(store: TieredStore, layout: KvLayout, chain: list[int], block_bytes: int) -> None:
    for h in chain:
        data = await store.get(layout, h)
        if data is None or len(data) != block_bytes:
            raise RuntimeError(f"block {h} did not come back")


async def _cell(spec: BlockSpec, n: int, root: Path, repeats: int) -> Cell:
    layout = spec.layout(f"prefetch{n}")
    payload = [row.tobytes() for row in random_blocks(n, spec.block_bytes, seed=n)]
    store_dir = root / f"store-{n}"
    config = StoreConfig(
        cpu_bytes=2 * n * spec.block_bytes,  # the prefetch may fill half of it: the whole chain
        disk_bytes=4 * n * diskfile.file_bytes(spec.block_bytes),
        disk_dir=store_dir,
        write_through=True,
    )
    chain = list(range(1, n + 1))
    files = [diskfile.block_path(store_dir, layout.key, h) for h in chain]
    store = await TieredStore.open(config)
    try:
        for i, h in enumerate(chain):
            await store.put(layout, h, payload[i], chain[i - 1] if i else None)
        await store.wait_idle()
    finally:
        await store.close()

    async def cold() -> tuple[TieredStore, float]:
        store = await _open(config, layout, chain)
        await asyncio.to_thread(evict, files)
        return store, (await asyncio.to_thread(residency, files)).fraction or 0.0

    disk, pre, ram, race, resident = [], [], [], [], []
    for _ in range(repeats):
        store, pct = await cold()
        try:
            t = time.perf_counter()
            await _load(store, layout, chain, spec.block_bytes)
            disk.append(time.perf_counter() - t)
        finally:
            await store.close()
        resident.append(pct)

        store, pct = await cold()
        try:
            t = time.perf_counter()
            got = await store.prefetch_session("", SESSION, timeout_s=600)
            pre.append(time.perf_counter() - t)
            if got.promoted != n or not got.done:
                raise RuntimeError(f"prefetch promoted {got.promoted} of {n}: {got}")
            hits = store.stats.hits_cpu
            t = time.perf_counter()
            await _load(store, layout, chain, spec.block_bytes)
            ram.append(time.perf_counter() - t)
            if store.stats.hits_cpu - hits != n:
                raise RuntimeError("the load after the prefetch did not read RAM only")
        finally:
            await store.close()
        resident.append(pct)

        store, pct = await cold()
        try:
            t = time.perf_counter()
            prefetch = asyncio.ensure_future(store.prefetch_session("", SESSION, timeout_s=600))
            await _load(store, layout, chain, spec.block_bytes)
            race.append(time.perf_counter() - t)
            await prefetch
        finally:
            await store.close()
        resident.append(pct)
    await asyncio.to_thread(shutil.rmtree, store_dir)

    def ms(xs: list[float]) -> float:
        m = median(xs)
        assert m is not None
        return round(m * 1e3, 1)

    return Cell(spec.label, n, ms(disk), ms(pre), ms(ram), ms(race), round(max(resident) * 100, 1))


async def _run(tokens: int, repeats: int, tmp_dir: Path | None) -> list[Cell]:
    cells = []
    with tempfile.TemporaryDirectory(dir=tmp_dir, prefix="kvmesh-prefetch-") as tmp:
        for spec in SPECS:
            n = max(1, tokens // spec.block_size)
            cells.append(await _cell(spec, n, Path(tmp), repeats))
    return cells


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=2000, help="the session's chain, in tokens")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--tmp-dir", type=Path, default=None)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    cells = asyncio.run(_run(a.tokens, a.repeats, a.tmp_dir))
    if a.json:
        for c in cells:
            print(json.dumps(asdict(c)))
        return
    print(
        "| block | blocks | load from disk ms | prefetch ms | load from RAM after it ms "
        "| prefetch + load together ms | page cache before |"
    )
    print("|---|---|---|---|---|---|---|")
    for c in cells:
        print(
            f"| {c.block} | {c.blocks} | {c.disk_load_ms} | {c.prefetch_ms} | {c.ram_load_ms} "
            f"| {c.race_ms} | {c.resident_before_pct}% |"
        )


if __name__ == "__main__":
    main()
