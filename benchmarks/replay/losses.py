"""Where a profile loses reusable tokens on a replay: each request classed by what its session did
(first turn, stayed on its worker, moved) and by whether the worker it went to held more of its
prefix on its GPU when it arrived than was served when it was admitted (its blocks evicted while
it waited in the engine's queue).

    .venv/bin/python -m benchmarks.replay.losses --policy precise-cost --sessions 64 --workers 8 \\
        --capacity-blocks 32768 --cpu-blocks 131072

Lost = the longest prefix held anywhere (any engine or node store) at arrival, less what was
served from any tier or peer (the all-tier captured measure of ``kvmesh bench replay``).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from services.worker.sim.model import SimWorkerConfig

from . import driver
from .agentic import AgenticConfig, agentic_sessions
from .mesh import MeshConfig
from .router_policy import RouterPolicy
from .traces import MOONCAKE_TRACE, ReplayRequest, load_mooncake


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--policy", default="precise-cost")
    p.add_argument("--sessions", type=int, default=64, help="agentic sessions; 0: Mooncake")
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--capacity-blocks", type=int, default=32768)
    p.add_argument("--cpu-blocks", type=int, default=131072)
    p.add_argument("--workers-per-node", type=int, default=4)
    a = p.parse_args(argv)
    cfg = replace(SimWorkerConfig(), capacity_blocks=a.capacity_blocks)
    bs = cfg.block_size
    mesh = MeshConfig(workers_per_node=a.workers_per_node, cpu_blocks=a.cpu_blocks)
    if a.sessions:
        reqs: list[ReplayRequest] = list(agentic_sessions(AgenticConfig(sessions=a.sessions)))
    else:
        reqs = list(load_mooncake(MOONCAKE_TRACE, bs, None))
    policy = RouterPolicy(a.policy, a.workers, workers_per_node=a.workers_per_node)
    seen: dict[str, tuple[str, bool, int]] = {}  # request id -> (class, moved, gpu hit there)
    last: dict[str, int] = {}

    def route(req: ReplayRequest, view: driver.ClusterView) -> int:
        i = policy(req, view)
        prev = last.get(req.session_id) if req.session_id else None
        if req.session_id:
            last[req.session_id] = i
        kind = "first" if prev is None else ("moved" if prev != i else "stayed")
        seen[str(len(seen))] = (kind, prev is not None and prev != i, view.prefix_hit_blocks[i])
        return i

    kept: dict[str, Any] = {}
    report_fn = driver._report

    def keep(*args: Any) -> driver.ReplayReport:
        kept["results"], kept["reusable_all"] = args[2], args[4]
        return report_fn(*args)

    driver._report = keep  # type: ignore[assignment]
    try:
        rep = driver.replay(
            iter(reqs),
            route,
            workers=a.workers,
            config=cfg,
            on_kv_events=policy.on_kv_events,
            mesh=mesh,
            on_tier_events=policy.on_tier_events,
            policy_name=a.policy,
        )
    finally:
        driver._report = report_fn  # type: ignore[assignment]
    rows: dict[str, list[int]] = {}
    for r in kept["results"]:
        kind, _moved, hit = seen[r.request_id]
        held = kept["reusable_all"][int(r.request_id)]
        lost = held - min(r.cached_tokens, held)
        evicted = hit * bs > r.cached_tokens
        row = rows.setdefault(kind + (", evicted while queued" if evicted else ""), [0, 0, 0])
        row[0] += 1
        row[1] += held
        row[2] += lost
    total = sum(r[1] for r in rows.values()) or 1
    print(
        f"{a.policy}: all-tier hit {rep.hit_rate_all:.1%}, all-tier captured "
        f"{rep.capture_rate_all:.1%}, max/mean load {rep.load_balance:.2f}, "
        f"TTFT p99 {rep.ttft_p99_s:.0f} s\n"
    )
    print("| requests | n | reusable M tokens | lost M tokens | lost, % of all reusable |")
    print("|---|---|---|---|---|")
    for kind, (n, held, lost) in sorted(rows.items()):
        print(f"| {kind} | {n} | {held / 1e6:.1f} | {lost / 1e6:.2f} | {lost / total:.2%} |")


if __name__ == "__main__":
    main()
