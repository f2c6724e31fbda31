"""The router's decision for one long agentic prompt: hashing + index match + scoring.

    .venv/bin/python benchmarks/router_decision.py [--workers 64] [--index-blocks 1000000]

Builds a KV index of ``--index-blocks`` distinct blocks spread over ``--workers`` workers (fed
as KV event batches, as the router's event streams feed it), with one worker holding most of a
195K-token prompt. Then times, over repeats, what the router does per request before it calls a
worker: hash the prompt's blocks as vLLM does (a new session: every block; a session turn that
extends the previous prompt by 2K tokens: only the new blocks), match the index, and run the
scheduler profile. Prints a markdown table of p50/p90 in milliseconds, plus index ingest rate
and memory.

``--nodes N`` adds node kvmanagers: the workers are split over N nodes, each node's store (a
kvmanager's blocks of the workers' layout) holds as many filler blocks as a worker, half on cpu,
half on disk, and the first node's store also holds the whole prompt on cpu.

``--past-bound`` routes (and finishes) requests before the timing so that the prefix holder's
recent routed volume is twice every other worker's: a profile's ``volume-bound`` filter then
finds it past the bound on every decision and runs its check (with ``move_slack_s``, the
ttft-cost estimate over every candidate, which the scorer then reuses) instead of returning
at once.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvmesh.discovery.keys import WorkerId, WorkerRecord
from kvmesh.kv.events import BlockHash, BlockStored, KvEventBatch, Tier
from kvmesh.kv.hashing import HashConfig, SessionHasher, block_hashes
from services.router.core.index import KvIndex, StoreId, store_id
from services.router.core.routing import make_policy
from services.router.core.types import LoadSnapshot, RouteDecision, RouteRequest
from services.router.core.workers import WorkerSet

BLOCK = 32


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--workers", type=int, default=64)
    ap.add_argument("--index-blocks", type=int, default=1_000_000)
    ap.add_argument("--prompt-tokens", type=int, default=195_000)
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--profile", default="precise-sticky")
    ap.add_argument("--nodes", type=int, default=0, help="node kvmanagers (0: none)")
    ap.add_argument(
        "--past-bound",
        action="store_true",
        help="route requests first so the prefix holder is past a volume-bound filter's bound",
    )
    a = ap.parse_args()
    rng = random.Random(7)
    cfg = HashConfig(block_size=BLOCK)

    prompt = [rng.randrange(150_000) for _ in range(a.prompt_tokens)]
    prompt_hashes = block_hashes(prompt, cfg)
    ids = [WorkerId(f"w{i:02d}") for i in range(a.workers)]

    # The index: each worker's filler chains, plus the prompt's first 90% on worker 7.
    index = KvIndex()
    batches: list[KvEventBatch] = []
    chain = 512
    chains_per_worker = -(-a.index_blocks // (a.workers * chain))  # ceil: at least index-blocks
    for wid in ids:
        events = []
        for _ in range(chains_per_worker):
            hs = tuple(BlockHash(rng.getrandbits(64)) for _i in range(chain))
            events.append(BlockStored(hs, None, block_size=BLOCK))
        batches.append(KvEventBatch(wid, "e", 1, tuple(events), snapshot=True))
    held = prompt_hashes[: int(len(prompt_hashes) * 0.9)]
    batches.append(
        KvEventBatch(ids[7], "e", 2, (BlockStored(tuple(held), None, block_size=BLOCK),))
    )
    stores: list[tuple[StoreId, KvEventBatch]] = []
    for n in range(a.nodes):
        events = []
        for k in range(chains_per_worker):
            hs = tuple(BlockHash(rng.getrandbits(64)) for _i in range(chain))
            events.append(BlockStored(hs, None, Tier.CPU if k % 2 else Tier.DISK, BLOCK))
        if n == 0:
            events.append(BlockStored(tuple(prompt_hashes), None, Tier.CPU, BLOCK))
        sid = store_id(f"kvm{n}", "00112233aabbccdd")
        stores.append((sid, KvEventBatch(f"kvm{n}", "e", 1, tuple(events), snapshot=True)))
    n_events = sum(len(e.block_hashes) for b in batches for e in b.events)
    n_events += sum(len(e.block_hashes) for _, b in stores for e in b.events)
    start = time.perf_counter()
    for b in batches:
        index.apply(b)
    for sid, b in stores:
        index.apply_store(sid, b)
    ingest_s = time.perf_counter() - start
    for i, wid in enumerate(ids):  # worker i is on node i * nodes // workers
        if stores:
            index.link(wid, stores[i * len(stores) // len(ids)][0])
    stats = index.stats()

    workers = WorkerSet()
    for wid in ids:
        rec = WorkerRecord(worker_id=wid, address="x", model="m", model_path="", block_size=BLOCK)
        workers.apply_put(rec)
        workers.set_load(
            wid, LoadSnapshot(running_requests=rng.randrange(4), kv_cache_usage=rng.random())
        )
    policy = make_policy(a.profile, index=index, rng=rng)
    candidates = workers.candidates("m")
    if a.past_bound:
        for k, wid in enumerate(ids * 2 + [ids[7]] * 2):
            req = RouteRequest(f"pre{k}", "m", prompt_tokens=2_000)
            policy.on_routed(req, RouteDecision(wid, a.profile, "pre"))
            policy.on_finished(req, wid)

    def decide(
        hasher: SessionHasher, session: str, tokens: list[int]
    ) -> tuple[float, float, float]:
        t0 = time.perf_counter()
        hashed = hasher.hash(session, tokens)
        t1 = time.perf_counter()
        index.match(hashed.hashes)
        t2 = time.perf_counter()
        route = RouteRequest(
            "r", "m", session_id=session, block_hashes=hashed.hashes, prompt_tokens=len(tokens)
        )
        decision = policy.pick(route, candidates)
        t3 = time.perf_counter()
        assert decision.worker_id == ids[7], decision
        # hash, match alone, whole decision (hash + pick: the match inside pick, not twice)
        return t1 - t0, t2 - t1, (t1 - t0) + (t3 - t2)

    cold, turn = [], []
    for r in range(a.repeats):
        hasher = SessionHasher(cfg)
        cold.append(decide(hasher, f"s{r}", prompt))
        extended = prompt + [rng.randrange(150_000) for _ in range(2_000)]
        turn.append(decide(hasher, f"s{r}", extended))

    def col(rows: list[tuple[float, float, float]], k: int) -> str:
        xs = sorted(x[k] * 1e3 for x in rows)
        return f"{statistics.median(xs):.2f} / {xs[int(0.9 * (len(xs) - 1))]:.2f}"

    print(
        f"workers={a.workers} index blocks={stats.blocks:,} prompt={a.prompt_tokens:,} tokens "
        f"({len(prompt_hashes):,} blocks) profile={a.profile} repeats={a.repeats} "
        f"nodes={a.nodes} past_bound={a.past_bound}\n"
    )
    print("| case | hash p50 / p90 ms | index match p50 / p90 ms | whole decision p50 / p90 ms |")
    print("|---|---|---|---|")
    print(f"| new session (cold) | {col(cold, 0)} | {col(cold, 1)} | {col(cold, 2)} |")
    print(f"| session turn, +2K tokens | {col(turn, 0)} | {col(turn, 1)} | {col(turn, 2)} |")
    print(
        f"\nindex ingest: {n_events:,} block events in {ingest_s:.2f} s = "
        f"{n_events / ingest_s:,.0f} events/s; estimated memory {stats.estimated_bytes / 1e6:.0f} MB "
        f"({stats.estimated_bytes / max(stats.blocks, 1) * 1e6 / 1e6:.0f} B/block, "
        f"{stats.estimated_bytes / max(stats.blocks, 1):.0f} MB per million blocks)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
