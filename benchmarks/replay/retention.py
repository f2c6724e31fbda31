"""Session retention in the replay (issue 18): node stores that keep live sessions' blocks, the
kvmanager's own pure retention core (``services/kvmanager/core/retention.py``) deciding which,
and the follow-up turns' outcome.

What it models (docs/agents.md#retention): when a session's turn is routed to a worker, the
router pins the turn's prompt chain on that worker's node for ``ttl_s`` (virtual time; a real
router pins when the turn ends, a few seconds later: TTLs are minutes). A pinned block leaves a
node's CPU tier only after every unpinned one, and then for the disk tier (a retained disk
block is never dropped); the node's retention budget (``budget_blocks``) releases the least
recently active session first. With ``budget_blocks=0`` the stores are plain LRU
(``mesh.NodeStore``), and the same tracker counts the baseline.

A *follow-up* turn is a session's turn after its first; it is *fully cached* when the prefix
its previous turn sent (that turn's prompt blocks) is served to it from its engine, its node's
tiers or a peer (the fetch plan at routing). Reported: follow-ups fully cached / all, and the
TTFT p99 of follow-ups and of first turns (new sessions: what retention must not starve).

    kvmesh bench replay --trace agentic --workers 8 --cpu-blocks 20000 --disk-blocks 40000 \\
        --retention-blocks 20000 --retention-ttl-s 600
"""

from __future__ import annotations

import argparse
import heapq
import json
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

from kvmesh.kv.events import BlockHash, BlockRemoved, BlockStored, KvEvent, Tier
from services.kvmanager.core.retention import Retention, SessionKey
from services.worker.sim.model import SimResult

from .mesh import FetchPlan, NodeStore, TierSink
from .traces import ReplayRequest, mix64, quantile

_KEY = "replay"  # one layout


class RetainingNodeStore(NodeStore):
    """A node store whose ``retained`` blocks are evicted after every other one (CPU: to the
    disk tier only; disk: never). The retention budget keeps them well under the capacities."""

    def __init__(
        self, cpu_blocks: int, disk_blocks: int, block_size: int, sink: TierSink | None = None
    ) -> None:
        super().__init__(cpu_blocks, disk_blocks, block_size, sink)
        self.retained: set[BlockHash] = set()

    def _victims(self, tier: dict[BlockHash, None], n: int, retained_ok: bool) -> list[BlockHash]:
        out: list[BlockHash] = []
        kept: list[BlockHash] = []
        for h in tier:
            if len(out) >= n:
                break
            (kept if h in self.retained else out).append(h)
        if retained_ok and len(out) < n:
            out += kept[: n - len(out)]
        return out

    def _shrink(self) -> list[KvEvent]:
        out: list[KvEvent] = []
        over = len(self.cpu) - self._cpu_cap
        if over <= 0:
            return out
        demoted = self._victims(self.cpu, over, retained_ok=bool(self._disk_cap))
        for h in demoted:
            del self.cpu[h]
        out.append(BlockRemoved(tuple(demoted), Tier.CPU))
        if not self._disk_cap:
            return out
        for h in demoted:
            self.disk[h] = None
        out.append(BlockStored(tuple(demoted), None, Tier.DISK, self._bs))
        over = len(self.disk) - self._disk_cap
        if over > 0:
            dropped = self._victims(self.disk, over, retained_ok=False)
            for h in dropped:
                del self.disk[h]
            out.append(BlockRemoved(tuple(dropped), Tier.DISK))
        return out


@dataclass(frozen=True, slots=True)
class RetentionReport:
    budget_blocks: int
    ttl_s: float
    follow_ups: int
    fully_cached: int
    follow_up_ttft_p99_s: float
    first_turn_ttft_p99_s: float
    sessions_released_for_budget: int
    sessions_expired: int

    @property
    def kept_rate(self) -> float:
        return self.fully_cached / self.follow_ups if self.follow_ups else 0.0


class ReplayRetention:
    """The replay's hooks: ``store`` builds the node stores, ``routed`` pins a turn and judges
    it, ``finished`` sums up after the replay (``result``)."""

    def __init__(self, budget_blocks: int, ttl_s: float = 600.0) -> None:
        self.budget_blocks = budget_blocks
        self.ttl_s = ttl_s
        self._nodes: list[Retention] = []
        self._prev: dict[str, tuple[int, int]] = {}  # session -> (node, prompt blocks)
        self._follow: dict[str, bool] = {}  # request id -> fully cached (follow-ups only)
        self._first: set[str] = set()
        self.result: RetentionReport | None = None

    def store(
        self, cpu_blocks: int, disk_blocks: int, block_size: int, sink: TierSink | None
    ) -> NodeStore:
        if not self.budget_blocks:
            self._nodes.append(Retention(0))
            return NodeStore(cpu_blocks, disk_blocks, block_size, sink)
        cap = disk_blocks or cpu_blocks
        if self.budget_blocks > cap // 2:
            raise ValueError(
                f"retention budget {self.budget_blocks} blocks is over half the node's "
                f"{'disk' if disk_blocks else 'CPU'} tier ({cap} blocks)"
            )
        s = RetainingNodeStore(cpu_blocks, disk_blocks, block_size, sink)
        self._nodes.append(
            Retention(
                self.budget_blocks,
                max_ttl_s=self.ttl_s,
                retain=lambda b: s.retained.add(b.block_hash),
                release=lambda b: s.retained.discard(b.block_hash),
            )
        )
        return s

    def routed(
        self, rid: str, req: ReplayRequest, node: int, plan: FetchPlan, now_s: float
    ) -> None:
        if not req.session_id:
            return
        prev = self._prev.get(req.session_id)
        if prev is None:
            self._first.add(rid)
        else:
            self._follow[rid] = plan.blocks >= prev[1]
        self._prev[req.session_id] = (node, len(req.block_hashes))
        for r in self._nodes:
            r.expire(now_s)
        if self.budget_blocks:
            self._nodes[node].pin(
                SessionKey("", req.session_id), _KEY, 1, req.block_hashes, self.ttl_s, now_s
            )

    def finished(self, results: Sequence[SimResult], arrival: dict[str, float]) -> None:
        """The replay ended: ``result`` says what retention did."""
        self.result = self._report(results, arrival)

    def _report(self, results: Sequence[SimResult], arrival: dict[str, float]) -> RetentionReport:
        follow: list[float] = []
        first: list[float] = []
        for r in results:
            if r.first_token_s is None:
                continue
            ttft = r.first_token_s - arrival.get(r.request_id, r.arrival_s)
            if r.request_id in self._follow:
                follow.append(ttft)
            elif r.request_id in self._first:
                first.append(ttft)
        return RetentionReport(
            budget_blocks=self.budget_blocks,
            ttl_s=self.ttl_s,
            follow_ups=len(self._follow),
            fully_cached=sum(self._follow.values()),
            follow_up_ttft_p99_s=quantile(follow, 0.99),
            first_turn_ttft_p99_s=quantile(first, 0.99),
            sessions_released_for_budget=sum(r.stats.released_for_budget for r in self._nodes),
            sessions_expired=sum(r.stats.expired for r in self._nodes),
        )


def background(
    rps: float, tokens: int, block_size: int, until_s: float, seed: int = 0
) -> Iterator[ReplayRequest]:
    """One-shot requests without a session (batch jobs, other tenants' traffic): unique prompts
    of ``tokens`` at ``rps``, evenly spaced, for ``until_s`` seconds. They churn the caches."""
    n_blocks = tokens // block_size
    for i in range(int(rps * until_s)):
        base = mix64((seed << 40) ^ (i << 20) ^ 0xB6)
        hashes = tuple(BlockHash(mix64(base + j)) for j in range(n_blocks))
        yield ReplayRequest(i / rps, "", hashes, tokens, 100)


def run(a: argparse.Namespace) -> int:
    """``kvmesh bench replay --retention-blocks N``: each policy with plain LRU node stores,
    then with retention of N blocks per node, on the same trace and mesh."""
    from services.worker.sim.model import SimWorkerConfig

    from .cli import _requests, mesh_config
    from .driver import replay
    from .policies import BUILTIN
    from .router_policy import RouterPolicy

    mesh = mesh_config(a)
    if mesh is None:
        raise SystemExit("--retention-blocks needs node tiers (--cpu-blocks)")
    cfg = replace(SimWorkerConfig(), capacity_blocks=a.capacity_blocks, block_size=a.block_size)
    rows = []
    for name in [n.strip() for n in a.policy.split(",") if n.strip()]:
        for budget in (0, a.retention_blocks):
            hooks = ReplayRetention(budget, a.retention_ttl_s)
            on_kv = on_tier = None
            policy: Any
            if name in BUILTIN:
                policy = BUILTIN[name]()
            else:
                policy = RouterPolicy(
                    name, a.workers, seed=a.seed, workers_per_node=mesh.workers_per_node
                )
                on_kv, on_tier = policy.on_kv_events, policy.on_tier_events
            reqs: Iterable[ReplayRequest] = _requests(a)
            if a.background_rps > 0:
                bg = background(
                    a.background_rps, a.background_tokens, a.block_size, a.background_s, a.seed
                )
                reqs = heapq.merge(reqs, bg, key=lambda r: r.arrival_s)
            report = replay(
                reqs,
                policy,
                workers=a.workers,
                config=cfg,
                on_kv_events=on_kv,
                policy_name=name,
                mesh=mesh,
                on_tier_events=on_tier,
                retention=hooks,
            )
            assert hooks.result is not None
            r = hooks.result
            row = {
                "policy": name,
                "retention_blocks": budget,
                "ttl_s": r.ttl_s,
                "follow_ups": r.follow_ups,
                "follow_ups_fully_cached": r.kept_rate,
                "hit_rate_all": report.hit_rate_all,
                "ttft_p99_s": report.ttft_p99_s,
                "follow_up_ttft_p99_s": r.follow_up_ttft_p99_s,
                "first_turn_ttft_p99_s": r.first_turn_ttft_p99_s,
                "released_for_budget": r.sessions_released_for_budget,
                "expired": r.sessions_expired,
                "wall_s": report.wall_s,
            }
            rows.append(row)
            if a.json:
                print(json.dumps(row), flush=True)
    if not a.json:
        print(
            f"\ntrace={a.trace} sessions={a.sessions} workers={a.workers} "
            f"capacity_blocks={a.capacity_blocks} block_size={a.block_size} nodes of "
            f"{mesh.workers_per_node} workers, cpu_blocks={mesh.cpu_blocks} "
            f"disk_blocks={mesh.disk_blocks} retention ttl={a.retention_ttl_s:g} s, background "
            f"{a.background_rps:g} req/s of {a.background_tokens} tokens for {a.background_s:g} s\n"
        )
        print(
            "| policy | retention blocks/node | follow-ups fully cached | all-tier hit "
            "| TTFT p99 s | follow-up TTFT p99 s | first-turn TTFT p99 s | released (budget) "
            "| expired |\n|---|---|---|---|---|---|---|---|---|"
        )
        for row in rows:
            print(
                f"| {row['policy']} | {row['retention_blocks'] or 'off (LRU)'} "
                f"| {row['follow_ups_fully_cached']:.1%} of {row['follow_ups']} "
                f"| {row['hit_rate_all']:.1%} | {row['ttft_p99_s']:.2f} "
                f"| {row['follow_up_ttft_p99_s']:.2f} | {row['first_turn_ttft_p99_s']:.2f} "
                f"| {row['released_for_budget']} | {row['expired']} |"
            )
    return 0
