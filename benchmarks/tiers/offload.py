"""Part 1: worker -> kvmanager offload and kvmanager -> worker load, beside memcpy.

The real ``KvManagerBlockClient`` (what the connector runs in the engine process: sync gRPC
PutBlocks / GetBlocks) against a real kvmanager daemon in its own process on loopback, with blocks
handed over as the connector hands them (rows of a numpy array). Offload = ``client.save`` of
consecutive blocks in the batches a step would carry, timed until the last call returns (the
daemon has stored them); load = ``client.load`` of the same batches, bytes back in this process.
The limit: ``np.copyto`` of the same blocks, block by block, into a touched buffer.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from services.worker.connector.kvmanager_client import KvManagerBlockClient, kv_layout

from .blocks import SPECS, BlockSpec, count_for, random_blocks
from .daemons import Daemon, start_daemon
from .limits import memcpy_seconds
from .report import Figure, gbps, median

BATCH_BYTES = 16 << 20  # at most this much payload per save/load call
MAX_BATCH_BLOCKS = 64  # ... and at most this many blocks (a 2K-token step of 32-token blocks)


def batch_blocks(block_bytes: int) -> int:
    """Blocks per save/load call: a step's worth, capped by ``BATCH_BYTES``."""
    return max(1, min(MAX_BATCH_BLOCKS, BATCH_BYTES // block_bytes))


@dataclass(frozen=True, slots=True)
class OffloadConfig:
    total_bytes: int = 64 << 20  # payload per cell
    repeats: int = 3  # measured runs per cell (plus one warm-up)


def _save(client: KvManagerBlockClient, key: str, hashes: list[int], data: np.ndarray) -> None:
    step = batch_blocks(data.shape[1])
    parent: int | None = None
    for i in range(0, len(hashes), step):
        rows = [memoryview(data[j]) for j in range(i, min(i + step, len(hashes)))]
        client.save(key, hashes[i : i + step], parent, rows)
        parent = hashes[i + len(rows) - 1]


def _load(client: KvManagerBlockClient, key: str, hashes: list[int]) -> list[bytes]:
    step = batch_blocks(kv_layout(key).block_bytes)
    out: list[bytes] = []
    for i in range(0, len(hashes), step):
        got = client.load(key, hashes[i : i + step]) or []
        out.extend(bytes(b) if not isinstance(b, bytes) else b for b in got)
    return out


def run(cfg: OffloadConfig, log: Callable[[str], None] = print) -> list[Figure]:
    runs = cfg.repeats + 1
    counts = {s: count_for(cfg.total_bytes, s.block_bytes) for s in SPECS}
    budget = sum(runs * n * s.block_bytes for s, n in counts.items()) + (64 << 20)
    daemon: Daemon = start_daemon("tiers-offload", cpu_bytes=budget)
    client = KvManagerBlockClient(daemon.address, load_timeout_s=60.0, save_timeout_s=60.0)
    results: dict[tuple[str, BlockSpec], list[float]] = defaultdict(list)
    data = {s: random_blocks(n, s.block_bytes, seed=i) for i, (s, n) in enumerate(counts.items())}
    try:
        for r in range(runs):
            for spec in SPECS:
                n, src = counts[spec], data[spec]
                nbytes = n * spec.block_bytes
                key = spec.connector_key(f"offload-{r}")
                hashes = [(r << 40) + (j + 1) for j in range(n)]
                dst = np.ones_like(src)  # touched: no page faults in the copy
                mem = gbps(nbytes, memcpy_seconds(src, dst))
                t = time.perf_counter()
                _save(client, key, hashes, src)
                save_s = time.perf_counter() - t
                held = client.lookup(key, hashes)
                if held != n:
                    raise RuntimeError(f"kvmanager holds {held} of {n} offloaded blocks")
                t = time.perf_counter()
                loaded = _load(client, key, hashes)
                load_s = time.perf_counter() - t
                if len(loaded) != n or loaded[-1] != src[-1].tobytes():
                    raise RuntimeError(f"loaded {len(loaded)} of {n} blocks, or wrong bytes")
                log(
                    f"offload {spec.label} run {r}: save {gbps(nbytes, save_s):.2f}"
                    f" load {gbps(nbytes, load_s):.2f} memcpy {mem:.2f} GB/s"
                )
                if r == 0:
                    continue  # warm-up
                results["save", spec].append(gbps(nbytes, save_s))
                results["load", spec].append(gbps(nbytes, load_s))
                results["memcpy", spec].append(mem)
    finally:
        client.close()
        daemon.stop()
    figures = []
    for spec in SPECS:
        n = counts[spec]
        step = batch_blocks(spec.block_bytes)
        common = dict(
            block_bytes=spec.block_bytes,
            limit_name="memcpy",
            limit=median(results["memcpy", spec]),
            unit="gbps",
            limit_path="np.copyto block by block",
            extra={"blocks": n, "batch_blocks": step, "repeats": cfg.repeats},
        )
        figures.append(
            Figure(
                title="worker -> kvmanager offload",
                name="offload",
                value=median(results["save", spec]),
                path=f"KvManagerBlockClient.save (gRPC PutBlocks), {step} blocks/call",
                **common,  # type: ignore[arg-type]
            )
        )
        figures.append(
            Figure(
                title="kvmanager -> worker load",
                name="load",
                value=median(results["load", spec]),
                path=f"KvManagerBlockClient.load (gRPC GetBlocks), {step} blocks/call",
                **common,  # type: ignore[arg-type]
            )
        )
    return figures
