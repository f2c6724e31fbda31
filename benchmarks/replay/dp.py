"""Replay with data-parallel ranked workers (``kvmesh bench replay --dp-ranks R``): W workers of
R ranks each, every rank a simulated engine with its own KV cache (what vLLM's internal data
parallelism is: one front end, R engine cores), under two ways of routing:

- **per rank** (kvmesh, docs/engine.md#data-parallel-ranks): each (worker, rank) is a target of
  its own; the index learns each rank's KV events, the scheduler scores each rank's prefix and
  load, and the call names the rank. In the replay that is the router core over W x R targets.
- **per worker** (llm-d's index is per pod): the router sees W targets; a worker's index entry
  is what any of its ranks holds (the union of its ranks' KV events, a block removed only when
  no rank holds it: the most a per-worker index can know), its load the sum of its ranks'; the
  worker's front end then puts the request on a rank of its own choosing, not knowing prefixes
  (``--dp-pick``: least-loaded as vLLM's ``DPLBAsyncMPClient``, 4 x waiting + running, lowest
  rank on a tie; or round-robin).

Both run the same scheduler profile on the same simulated ranks and the same trace; the report
is per rank (hit rate, load max/mean over ranks) and per worker (load max/mean over workers).
"""

from __future__ import annotations

import argparse
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, replace

from kvmesh.kv.events import AllBlocksCleared, BlockHash, BlockRemoved, BlockStored, KvEvent
from services.worker.sim.model import SimLoad, SimulatedWorker, SimWorkerConfig

from .driver import ClusterView, ReplayReport, replay
from .router_policy import RouterPolicy
from .traces import ReplayRequest

PICKS = ("least-loaded", "round-robin")


class _Group:
    """A worker's ranks as one simulated worker, as a per-worker router sees it."""

    def __init__(self, ranks: Sequence[SimulatedWorker]) -> None:
        self.ranks = ranks
        self.config = ranks[0].config

    def load(self) -> SimLoad:
        loads = [r.load() for r in self.ranks]
        return SimLoad(
            running=sum(x.running for x in loads),
            waiting=sum(x.waiting for x in loads),
            kv_usage=sum(x.kv_usage for x in loads) / len(loads),
            in_flight_tokens=sum(x.in_flight_tokens for x in loads),
            pending_prefill_tokens=sum(x.pending_prefill_tokens for x in loads),
            prefix_queried_tokens=sum(x.prefix_queried_tokens for x in loads),
            prefix_hit_tokens=sum(x.prefix_hit_tokens for x in loads),
            prefill_computed_tokens=sum(x.prefill_computed_tokens for x in loads),
            prefill_s=sum(x.prefill_s for x in loads),
            generation_tokens=sum(x.generation_tokens for x in loads),
            decode_tokens=sum(x.decode_tokens for x in loads),
            decode_s=sum(x.decode_s for x in loads),
        )

    def is_active(self, request_id: str) -> bool:
        return any(r.is_active(request_id) for r in self.ranks)

    def has_first_token(self, request_id: str) -> bool:
        return any(r.has_first_token(request_id) for r in self.ranks)


class PerWorkerPolicy:
    """The router core over W whole workers; each worker's front end picks the rank."""

    def __init__(
        self, profile: str, workers: int, ranks: int, pick: str = "least-loaded", seed: int = 0
    ) -> None:
        if pick not in PICKS:
            raise ValueError(f"--dp-pick must be one of {', '.join(PICKS)}, not {pick!r}")
        self.name = f"{profile} per worker ({pick})"
        self.inner = RouterPolicy(profile, workers, seed=seed)
        self._ranks = ranks
        self._pick = pick
        self._next = [0] * workers
        self._held: list[Counter[BlockHash]] = [Counter() for _ in range(workers)]
        self._rank_held: list[set[BlockHash]] = [set() for _ in range(workers * ranks)]

    def on_kv_events(self, rank_slot: int, events: Sequence[KvEvent]) -> None:
        """A rank's events, merged into its worker's: stored when any rank stores it, removed
        when the last rank holding it removes it."""
        w = rank_slot // self._ranks
        held, mine = self._held[w], self._rank_held[rank_slot]
        out: list[KvEvent] = []
        for ev in events:
            if isinstance(ev, BlockStored):
                for h in ev.block_hashes:
                    if h not in mine:
                        mine.add(h)
                        held[h] += 1
                out.append(ev)
            elif isinstance(ev, BlockRemoved):
                gone = []
                for h in ev.block_hashes:
                    if h in mine:
                        mine.discard(h)
                        held[h] -= 1
                        if held[h] <= 0:
                            del held[h]
                            gone.append(h)
                if gone:
                    out.append(BlockRemoved(tuple(gone), ev.tier))
            elif isinstance(ev, AllBlocksCleared):
                for h in mine:
                    held[h] -= 1
                    if held[h] <= 0:
                        del held[h]
                        out.append(BlockRemoved((h,)))
                mine.clear()
        if out:
            self.inner.on_kv_events(w, out)

    def __call__(self, request: ReplayRequest, view: ClusterView) -> int:
        r = self._ranks
        groups = [_Group(view.workers[i : i + r]) for i in range(0, len(view.workers), r)]
        hits = [max(view.prefix_hit_blocks[i : i + r]) for i in range(0, len(view.workers), r)]
        gview = ClusterView(view.now_s, groups, hits, in_fetch=view.in_fetch)  # type: ignore[arg-type]
        w = self.inner(request, gview)
        return w * r + self._choose(w, groups[w])

    def _choose(self, w: int, group: _Group) -> int:
        if self._pick == "round-robin":
            rank = self._next[w]
            self._next[w] = (rank + 1) % self._ranks
            return rank
        loads = [rank.load() for rank in group.ranks]
        return min(range(self._ranks), key=lambda i: (4 * loads[i].waiting + loads[i].running, i))


@dataclass(frozen=True, slots=True)
class DpRow:
    policy: str
    routing: str  # "per rank" or "per worker (<pick>)"
    report: ReplayReport
    ranks: int

    @property
    def worker_load_balance(self) -> float:
        t = self.report.worker_input_tokens
        per = [sum(t[i : i + self.ranks]) for i in range(0, len(t), self.ranks)]
        mean = sum(per) / len(per)
        return max(per) / mean if mean else 1.0


def run_pair(
    requests: Sequence[ReplayRequest],
    profile: str,
    workers: int,
    ranks: int,
    config: SimWorkerConfig,
    pick: str = "least-loaded",
    seed: int = 0,
) -> tuple[DpRow, DpRow]:
    """The same trace per rank and per worker on ``workers`` x ``ranks`` simulated ranks."""
    n = workers * ranks
    per_rank = RouterPolicy(profile, n, seed=seed)
    a = replay(
        requests, per_rank, workers=n, config=config, on_kv_events=per_rank.on_kv_events,
        policy_name=profile,
    )  # fmt: skip
    per_worker = PerWorkerPolicy(profile, workers, ranks, pick, seed)
    b = replay(
        requests, per_worker, workers=n, config=config, on_kv_events=per_worker.on_kv_events,
        policy_name=per_worker.name,
    )  # fmt: skip
    return DpRow(profile, "per rank", a, ranks), DpRow(profile, f"per worker ({pick})", b, ranks)


def format_rows(rows: Sequence[DpRow]) -> str:
    lines = [
        "| policy | routing | hit rate | ceiling | reusable captured | max/mean load (ranks) "
        "| max/mean load (workers) | TTFT p50 s | TTFT p99 s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        r = row.report
        lines.append(
            f"| {row.policy} | {row.routing} | {r.hit_rate:.1%} | {r.ceiling:.1%} "
            f"| {r.capture_rate:.1%} | {r.load_balance:.2f} | {row.worker_load_balance:.2f} "
            f"| {r.ttft_p50_s:.2f} | {r.ttft_p99_s:.2f} |"
        )
    return "\n".join(lines)


def run(a: argparse.Namespace, requests: Sequence[ReplayRequest]) -> int:
    """``kvmesh bench replay --dp-ranks R``: each policy per rank and per worker."""
    if a.cpu_blocks:
        raise SystemExit("kvmesh bench replay: --dp-ranks does not combine with --cpu-blocks yet")
    cfg = replace(SimWorkerConfig(), capacity_blocks=a.capacity_blocks, block_size=a.block_size)
    rows: list[DpRow] = []
    for name in [n.strip() for n in a.policy.split(",") if n.strip()]:
        rows.extend(run_pair(requests, name, a.workers, a.dp_ranks, cfg, a.dp_pick, a.seed))
    print(
        f"\ntrace={a.trace} workers={a.workers} x dp_ranks={a.dp_ranks} "
        f"capacity_blocks={a.capacity_blocks} per rank, block_size={a.block_size}\n"
    )
    print(format_rows(rows))
    return 0
