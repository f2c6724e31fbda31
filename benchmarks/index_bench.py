"""The router's KV block index: ingest rate, match() latency and memory, on one CPU core.

    .venv/bin/python benchmarks/index_bench.py [--blocks 1000000] [--workers 64] [--seed 0]

Builds an index of ``--blocks`` distinct blocks held by ``--workers`` workers through
``KvIndex.apply`` (as the KV event adapter would: one batch per worker step, prefill-sized
BlockStored events of 16 blocks; every worker also holds a 64-block shared system prompt, and
about a tenth of each worker's blocks are on the cpu tier too). Then times ``match()`` of a
6,100-block prompt (195K tokens at 32 tokens a block) and measures the index's memory with
tracemalloc in a second, separate build. Prints markdown tables. Deterministic for a seed
(timings are not: the machine is shared). Objects made before the timings are frozen
(`gc.freeze`) so a full collection of the benchmark's own event objects is not charged to match().
"""

from __future__ import annotations

import argparse
import gc
import random
import sys
import time
import tracemalloc
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeGuard

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvmesh.discovery.keys import WorkerId
from kvmesh.kv.events import BlockHash, BlockRemoved, BlockStored, KvEvent, KvEventBatch, Tier
from services.router.core.index import IndexConfig, KvIndex

EVENT_BLOCKS = 16  # blocks per BlockStored: one 512-token prefill chunk at 32 tokens a block
SYSTEM_BLOCKS = 64  # the system prompt every worker holds


class Workload:
    """The hashes each worker holds, as chains, reproducible from a seed."""

    def __init__(self, blocks: int, workers: int, prompt_blocks: int, seed: int) -> None:
        rng = random.Random(seed)
        self.rng = rng
        self.workers = [WorkerId(f"w{i:02d}") for i in range(workers)]
        self.system = [self.fresh() for _ in range(SYSTEM_BLOCKS)]
        self.prompt = self.system + [self.fresh() for _ in range(prompt_blocks - SYSTEM_BLOCKS)]
        self.half = len(self.prompt) // 2
        # Per worker, chains (system prompt + conversation); worker 0 holds the whole prompt,
        # worker 1 its first half.
        self.chains: dict[WorkerId, list[list[BlockHash]]] = {w: [] for w in self.workers}
        self.chains[self.workers[0]].append(self.prompt)
        if workers > 1:
            self.chains[self.workers[1]].append(self.prompt[: self.half])
        distinct = SYSTEM_BLOCKS + len(self.prompt) - SYSTEM_BLOCKS
        per_worker = max(1, (blocks - distinct) // workers)
        for w in self.workers:
            have = sum(len(c) - SYSTEM_BLOCKS for c in self.chains[w])
            first = True
            while have < per_worker:
                n = min(per_worker - have, rng.randint(16, 2048))
                chain = [self.fresh() for _ in range(n)]
                self.chains[w].append(self.system + chain if first else chain)
                first = False
                have += n

    def fresh(self) -> BlockHash:
        return BlockHash(self.rng.getrandbits(64))

    def batches(self) -> Iterator[KvEventBatch]:
        """Every worker's steps, interleaved round-robin, as the adapter would see them."""
        seqs = dict.fromkeys(self.workers, 0)
        steps = {w: self._steps(w) for w in self.workers}
        while steps:
            for w in list(steps):
                events = next(steps[w], None)
                if events is None:
                    del steps[w]
                    continue
                seqs[w] += 1
                yield KvEventBatch(w, "e1", seqs[w], events)

    def _steps(self, w: WorkerId) -> Iterator[tuple[BlockStored, ...]]:
        for chain in self.chains[w]:
            parent = None
            for i in range(0, len(chain), EVENT_BLOCKS):
                run = tuple(chain[i : i + EVENT_BLOCKS])
                events = [BlockStored(run, parent, Tier.GPU, 32)]
                if run[0] % 10 == 0 and run[0] not in self.system:  # ~10%: offloaded too
                    events.append(BlockStored(run, parent, Tier.CPU, 32))
                parent = run[-1]
                yield tuple(events)


def stores(ev: KvEvent) -> TypeGuard[BlockStored]:
    return isinstance(ev, BlockStored)


def percentile(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


def timed(fn: Callable[[], object], reps: int) -> list[float]:
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1e3)
    return out


def clock(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def build(wl: Workload, cfg: IndexConfig) -> tuple[KvIndex, float, int]:
    index = KvIndex(cfg)
    batches = list(wl.batches())
    events = sum(len(ev.block_hashes) for b in batches for ev in b.events if stores(ev))
    gc.collect()
    t0 = time.perf_counter()
    for b in batches:
        index.apply(b)
    return index, time.perf_counter() - t0, events


def measure_memory(args: argparse.Namespace, cfg: IndexConfig) -> tuple[int, int, int]:
    """Real bytes the index keeps (hash ints included), by tracemalloc, in a separate build."""
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    wl = Workload(args.blocks, args.workers, args.prompt_blocks, args.seed)
    index = KvIndex(cfg)
    for b in wl.batches():
        index.apply(b)
    del wl, b
    gc.collect()
    used = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    st = index.stats()
    return used, st.blocks, st.estimated_bytes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--blocks", type=int, default=1_000_000)
    ap.add_argument("--workers", type=int, default=64)
    ap.add_argument("--prompt-blocks", type=int, default=6100)
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-memory", action="store_true", help="skip the tracemalloc build")
    args = ap.parse_args()
    cfg = IndexConfig(max_blocks=max(2 * args.blocks, 1))

    wl = Workload(args.blocks, args.workers, args.prompt_blocks, args.seed)
    index, fill_s, fill_events = build(wl, cfg)
    st = index.stats()
    w0, w1 = wl.workers[0], wl.workers[min(1, args.workers - 1)]

    # Single-block events (decode: one block fills per step), then removals of 16.
    one = [
        KvEventBatch(w0, "e1", index.view(w0).seq + 1 + i, (BlockStored((wl.fresh(),), None),))
        for i in range(100_000)
    ]
    t0 = time.perf_counter()
    for b in one:
        index.apply(b)
    one_s = time.perf_counter() - t0
    seq = index.view(w0).seq
    hashes = [ev.block_hashes[0] for b in one for ev in b.events if stores(ev)]
    rem = [
        KvEventBatch(w0, "e1", seq + 1 + i, (BlockRemoved(tuple(hashes[j : j + 16])),))
        for i, j in enumerate(range(0, len(hashes), 16))
    ]
    t0 = time.perf_counter()
    for b in rem:
        index.apply(b)
    rem_s = time.perf_counter() - t0

    print(
        f"index: {st.blocks:,} blocks, {st.entries:,} entries (worker x tier holdings), "
        f"{args.workers} workers; python {sys.version.split()[0]}\n"
    )
    print("| ingest | block events | seconds | block events/s |")
    print("|---|---|---|---|")
    print(
        f"| fill: BlockStored x{EVENT_BLOCKS}, 1 batch per worker step | {fill_events:,} "
        f"| {fill_s:.2f} | {fill_events / fill_s:,.0f} |"
    )
    print(
        f"| BlockStored x1, 1 batch each | {len(one):,} | {one_s:.2f} | {len(one) / one_s:,.0f} |"
    )
    print(
        f"| BlockRemoved x16, 1 batch each | {len(hashes):,} | {rem_s:.2f} "
        f"| {len(hashes) / rem_s:,.0f} |"
    )

    prompt = wl.prompt
    partial = prompt[: wl.half] + [wl.fresh() for _ in range(len(prompt) - wl.half)]
    miss = [wl.fresh() for _ in range(len(prompt))]
    cases: list[tuple[str, Callable[[], object]]] = [
        (
            "full hit on one worker (+1 half, +all on 64-block system prompt)",
            lambda: index.match(prompt),
        ),
        ("full hit, candidates = [that worker]", lambda: index.match(prompt, [w0])),
        ("partial hit (first half) on two workers", lambda: index.match(partial)),
        ("miss (first block unknown)", lambda: index.match(miss)),
    ]
    res = index.match(prompt)
    assert res[w0].blocks == len(prompt) and res[w1].blocks == wl.half, res.get(w0)
    assert not index.match(miss)
    # A full collection of the benchmark's own million event objects is not the index's cost.
    gc.collect()
    gc.freeze()
    print(f"\n| match() of a {len(prompt):,}-block prompt | p50 ms | p99 ms | workers returned |")
    print("|---|---|---|---|")
    for name, fn in cases:
        fn()
        times = timed(fn, args.reps)
        got = fn()
        assert isinstance(got, dict)
        print(
            f"| {name} | {percentile(times, 0.5):.3f} | {percentile(times, 0.99):.3f} | {len(got)} |"
        )

    # Resync and leave. A worker that must lose all its blocks gets a fresh slot; the old one
    # is swept: one snapshot of the dict's keys per pass, then a few keys per apply().
    snap_events = tuple(
        BlockStored(tuple(c[i : i + 256]), None)
        for c in wl.chains[w1]
        for i in range(0, len(c), 256)
    )
    snap_blocks = sum(len(e.block_hashes) for e in snap_events)
    step = IndexConfig().sweep_keys_per_apply
    resync = KvEventBatch(w1, "e1", 10**9, snap_events, snapshot=True)
    ops = [
        (
            f"resync: snapshot batch of one worker ({snap_blocks:,} blocks; retires its old slot)",
            clock(lambda: index.apply(resync)),
        ),
        ("sweep() until done (one pass, its keys snapshot included)", clock(index.sweep)),
        ("drop_worker (retires the slot)", clock(lambda: index.drop_worker(wl.workers[2]))),
        ("first sweep step after it: the pass's keys snapshot", clock(lambda: index.sweep(step))),
        (f"a sweep step ({step:,} keys; every apply() does one)", clock(lambda: index.sweep(step))),
        (f"sweep() until done ({index.stats().blocks:,} blocks)", clock(index.sweep)),
    ]
    print("\n| operation | ms |")
    print("|---|---|")
    for name, ms in ops:
        print(f"| {name} | {ms:.1f} |")

    if not args.no_memory:
        del index, wl, one, rem, hashes
        gc.collect()
        used, blocks, est = measure_memory(args, cfg)
        print("\n| memory (tracemalloc) | bytes | per block | per million blocks |")
        print("|---|---|---|---|")
        print(
            f"| measured ({blocks:,} blocks) | {used:,} | {used / blocks:.1f} | {used / blocks * 1e6 / 2**20:,.1f} MiB |"
        )
        print(
            f"| stats().estimated_bytes | {est:,} | {est / blocks:.1f} | {est / blocks * 1e6 / 2**20:,.1f} MiB |"
        )


if __name__ == "__main__":
    main()
