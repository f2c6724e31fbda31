"""Part 1: worker -> kvmanager offload and kvmanager -> worker load, beside memcpy.

The real ``KvManagerBlockClient`` (what the connector runs in the engine process) against a real
kvmanager daemon in its own process on loopback, with blocks handed over as the connector hands
them (rows of a numpy array), over both of its paths side by side: shared memory (the segment
attached with ``AttachShm``: bytes by memcpy, regions in the gRPC messages; what a worker on the
kvmanager's node uses) and inline bytes (inside the PutBlocks / GetBlocks messages; the fallback
when the segment cannot be attached). Offload = ``client.save`` of consecutive blocks in the
batches a step would carry, timed until the last call returns (the daemon has stored them);
load = ``client.load`` of the same batches, each block then copied into a touched destination
array (as the connector copies loaded blocks into the KV cache). The limit: ``np.copyto`` of the
same blocks, block by block, into a touched buffer.
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


def _load(client: KvManagerBlockClient, key: str, hashes: list[int], dst: np.ndarray) -> None:
    """Loads the blocks into the rows of ``dst`` (a touched array, like the KV cache)."""
    step = batch_blocks(kv_layout(key).block_bytes)
    for i in range(0, len(hashes), step):
        got = client.load(key, hashes[i : i + step]) or []
        if len(got) != len(hashes[i : i + step]):
            raise RuntimeError(f"loaded {len(got)} of {len(hashes[i : i + step])} blocks")
        for j, b in enumerate(got):
            np.copyto(dst[i + j], np.frombuffer(b, dtype=np.uint8))


PATHS = ("shm", "inline")
_HOW = {
    "shm": "shared memory: bytes by memcpy through the attached segment, regions over gRPC",
    "inline": "inline bytes: inside the gRPC messages",
}


def run(cfg: OffloadConfig, log: Callable[[str], None] = print) -> list[Figure]:
    runs = cfg.repeats + 1
    counts = {s: count_for(cfg.total_bytes, s.block_bytes) for s in SPECS}
    budget = len(PATHS) * sum(runs * n * s.block_bytes for s, n in counts.items()) + (64 << 20)
    daemon: Daemon = start_daemon("tiers-offload", cpu_bytes=budget)
    clients = {
        "shm": KvManagerBlockClient(daemon.address, load_timeout_s=60.0, save_timeout_s=60.0),
        "inline": KvManagerBlockClient(
            daemon.address, load_timeout_s=60.0, save_timeout_s=60.0, shm_bytes=0
        ),
    }
    results: dict[tuple[str, BlockSpec], list[float]] = defaultdict(list)
    data = {s: random_blocks(n, s.block_bytes, seed=i) for i, (s, n) in enumerate(counts.items())}
    try:
        if not clients["shm"].wait_shm(10.0):
            raise RuntimeError("the kvmanager did not attach the client's shared memory")
        for r in range(runs):
            for spec in SPECS:
                n, src = counts[spec], data[spec]
                nbytes = n * spec.block_bytes
                dst = np.ones_like(src)  # touched: no page faults in the copy
                mem = gbps(nbytes, memcpy_seconds(src, dst))
                line = [f"offload {spec.label} run {r}:"]
                # Alternate which path goes first, so neither always gets the warmer machine.
                for path in PATHS if r % 2 == 0 else PATHS[::-1]:
                    client = clients[path]
                    key = spec.connector_key(f"offload-{path}-{r}")
                    hashes = [(r << 40) + (j + 1) for j in range(n)]
                    t = time.perf_counter()
                    _save(client, key, hashes, src)
                    save_s = time.perf_counter() - t
                    held = client.lookup(key, hashes)
                    if held != n:
                        raise RuntimeError(f"kvmanager holds {held} of {n} offloaded blocks")
                    dst.fill(0)
                    t = time.perf_counter()
                    _load(client, key, hashes, dst)
                    load_s = time.perf_counter() - t
                    if not np.array_equal(dst, src):
                        raise RuntimeError(f"{path}: loaded blocks differ from the saved ones")
                    line.append(
                        f"{path} save {gbps(nbytes, save_s):.2f} load {gbps(nbytes, load_s):.2f}"
                    )
                    if r > 0:  # run 0 is the warm-up
                        results[f"save_{path}", spec].append(gbps(nbytes, save_s))
                        results[f"load_{path}", spec].append(gbps(nbytes, load_s))
                log(" ".join(line) + f" memcpy {mem:.2f} GB/s")
                if r > 0:
                    results["memcpy", spec].append(mem)
    finally:
        for client in clients.values():
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
        for path in PATHS:
            figures.append(
                Figure(
                    title=f"worker -> kvmanager offload ({path})",
                    name=f"offload_{path}",
                    value=median(results[f"save_{path}", spec]),
                    path=f"KvManagerBlockClient.save (PutBlocks), {step} blocks/call, {_HOW[path]}",
                    **common,  # type: ignore[arg-type]
                )
            )
        for path in PATHS:
            figures.append(
                Figure(
                    title=f"kvmanager -> worker load ({path})",
                    name=f"load_{path}",
                    value=median(results[f"load_{path}", spec]),
                    path=f"KvManagerBlockClient.load (GetBlocks) + copy into a touched array,"
                    f" {step} blocks/call, {_HOW[path]}",
                    **common,  # type: ignore[arg-type]
                )
            )
    return figures
