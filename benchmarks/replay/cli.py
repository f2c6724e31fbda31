"""``kvmesh bench replay``: a request trace through the real router core against simulated
workers, one table row (or JSON object) per policy.

    kvmesh bench replay --trace mooncake --workers 16 --capacity-blocks 16384
    kvmesh bench replay --trace agentic --sessions 32 --policy precise-sticky,round-robin --json
    kvmesh bench replay --trace agentic --workers 8 --capacity-blocks 32768 \
        --cpu-blocks 131072 --workers-per-node 4      # with node kvmanager tiers and peers

Policies: the router's scheduler profiles (round-robin, random, least-loaded, approximate-prefix,
precise-prefix, precise-sticky, precise-balanced, precise-active, precise-cost, or a profile YAML
file), run with the real KV index fed by the simulated workers' KV events (and, with
--cpu-blocks, the node stores' tier events: benchmarks/replay/mesh.py); plus oracle-prefix and
oracle-cost, which read the simulated caches directly (upper bounds no real router can reach).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Iterable, Iterator
from dataclasses import replace
from pathlib import Path

from services.router.core.routing import POLICIES
from services.worker.sim.model import SimWorkerConfig

from .mesh import Link, MeshConfig

DEFAULT_POLICIES = (
    "round-robin,least-loaded,approximate-prefix,precise-prefix,precise-sticky,precise-balanced,"
    "precise-active,precise-cost"
)
ORACLES = ("oracle-prefix", "oracle-cost")


def register(subparsers: argparse._SubParsersAction) -> None:
    """Adds ``bench`` with its subcommands: ``replay`` (here), ``tiers``, ``disagg``, ``serve``."""
    from benchmarks import speculative as speculative_cli
    from benchmarks.chaos import cli as chaos_cli
    from benchmarks.disagg import cli as disagg_cli
    from benchmarks.priority import cli as priority_cli
    from benchmarks.serve import cli as serve_cli
    from benchmarks.serve import router_scale as router_scale_cli
    from benchmarks.serve import streams as streams_cli
    from benchmarks.tiers import cli as tiers_cli

    bench = subparsers.add_parser(
        "bench", help="benchmarks (replay a trace through the router; kvmanager tiers)"
    )
    sub = bench.add_subparsers(dest="bench_command", required=True)
    p = sub.add_parser(
        "replay",
        help="replay a request trace through the router core against simulated workers",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    d = SimWorkerConfig()
    p.add_argument(
        "--trace", default="mooncake", help="mooncake, agentic, or a Mooncake JSONL file"
    )
    p.add_argument("--limit", type=int, default=None, help="replay only the first N requests")
    p.add_argument("--sessions", type=int, default=32, help="agentic: concurrent main sessions")
    p.add_argument("--seed", type=int, default=0, help="agentic generator and tie-break seed")
    p.add_argument(
        "--workers", type=int, default=16, help="simulated workers (default %(default)s)"
    )
    p.add_argument(
        "--capacity-blocks", type=int, default=d.capacity_blocks, help="KV blocks per worker"
    )
    p.add_argument("--block-size", type=int, default=d.block_size, help="tokens per KV block")
    p.add_argument(
        "--policy",
        default=DEFAULT_POLICIES,
        help=f"comma-separated: {', '.join([*sorted(POLICIES), *ORACLES])}, or profile .yaml files",
    )
    p.add_argument(
        "--speed",
        type=float,
        default=None,
        help="pace at N x real time (default: as fast as possible)",
    )
    m = MeshConfig()
    p.add_argument(
        "--cpu-blocks",
        type=int,
        default=0,
        help="KV blocks of each node kvmanager's CPU tier (0, the default: no tiers, no peers)",
    )
    p.add_argument("--disk-blocks", type=int, default=0, help="... of its disk tier (0: none)")
    p.add_argument(
        "--workers-per-node", type=int, default=m.workers_per_node, help="(default %(default)s)"
    )
    p.add_argument(
        "--cpu-s-per-token",
        type=float,
        default=m.cpu.s_per_token,
        help="node CPU tier -> engine, s per token (default %(default)s: 0.28x the simulated "
        "prefill, as measured in BENCHMARKS.md)",
    )
    p.add_argument("--disk-s-per-token", type=float, default=m.disk.s_per_token, help="(0.83x)")
    p.add_argument(
        "--peer-s-per-token",
        type=float,
        default=m.peer.s_per_token,
        help="peer kvmanager -> engine, s per token (0.44x)",
    )
    p.add_argument("--no-peer-fetch", action="store_true", help="nodes do not fetch from peers")
    p.add_argument("--json", action="store_true", help="print one JSON object per policy")
    p.add_argument(
        "--trace-decisions",
        default=None,
        metavar="FILE",
        help="write one JSON line per request: placement, each candidate's routed volume, "
        "prefix and ttft-cost terms, the deciding scorer, where its prompt was served from "
        "(benchmarks/replay/decisions.py); with several policies, FILE gets each policy's name "
        "before its suffix",
    )
    p.add_argument(
        "--dp-ranks",
        type=int,
        default=1,
        help="data-parallel ranks per worker (each its own KV cache): every policy is run per "
        "rank and per worker (benchmarks/replay/dp.py); 1 (default): no ranks",
    )
    p.add_argument(
        "--dp-pick",
        default="least-loaded",
        choices=("least-loaded", "round-robin"),
        help="with --dp-ranks, per-worker routing: how the worker's front end picks the rank",
    )
    p.add_argument(
        "--retention-blocks",
        type=int,
        default=0,
        help="session retention: run each policy with plain LRU node stores and with this many "
        "blocks per node kept for live sessions (benchmarks/replay/retention.py); needs "
        "--cpu-blocks",
    )
    p.add_argument(
        "--retention-ttl-s", type=float, default=600.0, help="retention of a session, seconds"
    )
    p.add_argument(
        "--background-rps",
        type=float,
        default=0.0,
        help="with --retention-blocks: one-shot requests per second without a session mixed in",
    )
    p.add_argument("--background-tokens", type=int, default=8000, help="... their prompt tokens")
    p.add_argument("--background-s", type=float, default=1800.0, help="... for this long, s")
    p.set_defaults(func=run)
    tiers_cli.register(sub)
    disagg_cli.register(sub)
    serve_cli.add_parser(sub)
    streams_cli.add_parser(sub)
    router_scale_cli.add_parser(sub)
    chaos_cli.add_parser(sub)
    priority_cli.add_parser(sub)
    speculative_cli.add_parser(sub)


def _requests(a: argparse.Namespace) -> Iterable:  # type: ignore[type-arg]
    from .agentic import AgenticConfig, agentic_sessions
    from .traces import MOONCAKE_TRACE, load_mooncake

    if a.trace == "agentic":
        reqs: Iterable = agentic_sessions(  # type: ignore[type-arg]
            AgenticConfig(seed=a.seed, sessions=a.sessions, block_size=a.block_size)
        )
        if a.limit:
            reqs = (r for i, r in zip(range(a.limit), reqs, strict=False))
        return reqs
    path = MOONCAKE_TRACE if a.trace == "mooncake" else Path(a.trace)
    return load_mooncake(path, a.block_size, a.limit)


def _progress(reqs: Iterable, label: str, total: int | None) -> Iterator:  # type: ignore[type-arg]
    """Passes requests through, drawing a progress line on stderr."""
    n = 0
    for r in reqs:
        n += 1
        if (n % 100 == 0 and sys.stderr.isatty()) or n % 1000 == 0:
            done = f"{n}/{total}" if total else str(n)
            bar = ""
            if total:
                filled = int(30 * n / total)
                bar = "[" + "#" * filled + "." * (30 - filled) + "] "
            print(f"\r{label}: {bar}{done} requests", end="", file=sys.stderr, flush=True)
        yield r
    print(f"\r{label}: {n} requests replayed" + " " * 20, file=sys.stderr, flush=True)


def mesh_config(a: argparse.Namespace) -> MeshConfig | None:
    if not a.cpu_blocks:
        return None
    d = MeshConfig()
    return MeshConfig(
        workers_per_node=a.workers_per_node,
        cpu_blocks=a.cpu_blocks,
        disk_blocks=a.disk_blocks,
        cpu=Link(a.cpu_s_per_token, d.cpu.latency_s),
        disk=Link(a.disk_s_per_token, d.disk.latency_s),
        peer=Link(a.peer_s_per_token, d.peer.latency_s),
        peer_fetch=not a.no_peer_fetch,
    )


def trace_path(path: str, policy: str, policies: int) -> Path:
    """Where a policy's decision trace goes: ``path`` itself for one policy, else ``path``
    with the policy's name (a profile file's stem) before its suffix."""
    p = Path(path)
    if policies <= 1:
        return p
    return p.with_name(f"{p.stem}-{Path(policy).stem}{p.suffix}")


def run(a: argparse.Namespace) -> int:
    from .decisions import DecisionTrace
    from .driver import replay
    from .policies import BUILTIN
    from .router_policy import RouterPolicy

    if a.trace_decisions and (a.retention_blocks or a.dp_ranks > 1):
        print(
            "--trace-decisions traces plain replays only; drop --retention-blocks / --dp-ranks",
            file=sys.stderr,
        )
        return 2
    if a.retention_blocks:
        from . import retention

        return retention.run(a)
    if a.dp_ranks > 1:
        from . import dp

        return dp.run(a, list(_requests(a)))
    cfg = replace(SimWorkerConfig(), capacity_blocks=a.capacity_blocks, block_size=a.block_size)
    mesh = mesh_config(a)
    rows = []
    names = [n.strip() for n in a.policy.split(",") if n.strip()]
    for name in names:
        requests = list(_requests(a))
        on_kv = on_tier = None
        trace = DecisionTrace() if a.trace_decisions else None
        if name in ORACLES:
            policy = BUILTIN[name]()
        else:
            policy = RouterPolicy(
                name,
                a.workers,
                seed=a.seed,
                workers_per_node=mesh.workers_per_node if mesh else 0,
                trace=trace,
            )
            on_kv = policy.on_kv_events
            on_tier = policy.on_tier_events if mesh else None
        report = replay(
            _progress(requests, name, len(requests)),
            policy,
            workers=a.workers,
            config=cfg,
            on_kv_events=on_kv,
            pace=a.speed,
            policy_name=name,
            mesh=mesh,
            on_tier_events=on_tier,
            trace=trace,
        )
        if trace is not None:
            trace.write(trace_path(a.trace_decisions, name, len(names)))
        row = {
            "policy": name,
            "requests": report.requests,
            "input_tokens": report.input_tokens,
            "cached_tokens": report.cached_tokens,
            "reusable_tokens": report.reusable_tokens,
            "reusable_captured": report.reusable_captured_tokens,
            "hit_rate": report.hit_rate,
            "capture_rate": report.capture_rate,
            "ceiling": report.ceiling,
            "load_max_over_mean": report.load_balance,
            "computed_max_over_mean": report.computed_balance,
            "worker_input_tokens": list(report.worker_input_tokens),
            "worker_computed_tokens": list(report.worker_computed_tokens),
            "ttft_p50_s": report.ttft_p50_s,
            "ttft_p99_s": report.ttft_p99_s,
            "wall_s": report.wall_s,
            "hit_rate_all": report.hit_rate_all,
            "capture_rate_all": report.capture_rate_all,
            "tier_tokens": dict(report.tier_tokens),
        }
        if isinstance(policy, RouterPolicy) and policy.decision_s:
            ds = sorted(policy.decision_s)
            row["decision_p50_ms"] = statistics.median(ds) * 1e3
            row["decision_p99_ms"] = ds[int(0.99 * (len(ds) - 1))] * 1e3
            row["index_blocks"] = policy.index.stats().blocks
            steps = policy.step_rates()
            if steps is not None:
                row["step_rates"] = steps
        rows.append(row)
        if a.json:
            print(json.dumps(row), flush=True)
    if not a.json and mesh is not None:
        print(
            f"\ntrace={a.trace} workers={a.workers} capacity_blocks={a.capacity_blocks} "
            f"block_size={a.block_size} nodes of {mesh.workers_per_node} workers, "
            f"cpu_blocks={mesh.cpu_blocks} disk_blocks={mesh.disk_blocks} "
            f"peer_fetch={mesh.peer_fetch}\n"
        )
        print(
            "| policy | GPU hit | all-tier hit | ceiling | GPU captured | all-tier captured "
            "| served gpu/cpu/disk/peer % | max/mean load | TTFT p50 s | TTFT p99 s "
            "| decision p50 ms |\n|---|---|---|---|---|---|---|---|---|---|---|"
        )
        for r in rows:
            dec = f"{r['decision_p50_ms']:.2f}" if "decision_p50_ms" in r else "-"
            tt = r["tier_tokens"]
            total = sum(tt.values()) or 1
            split = "/".join(f"{100 * tt[k] / total:.0f}" for k in ("gpu", "cpu", "disk", "peer"))
            print(
                f"| {r['policy']} | {r['hit_rate']:.1%} | {r['hit_rate_all']:.1%} "
                f"| {r['ceiling']:.1%} | {r['capture_rate']:.1%} | {r['capture_rate_all']:.1%} "
                f"| {split} | {r['load_max_over_mean']:.2f} | {r['ttft_p50_s']:.2f} "
                f"| {r['ttft_p99_s']:.2f} | {dec} |"
            )
        _print_step_rates(rows)
    elif not a.json:
        print(
            f"\ntrace={a.trace} workers={a.workers} capacity_blocks={a.capacity_blocks} "
            f"block_size={a.block_size}\n"
        )
        print(
            "| policy | hit rate | ceiling | reusable captured | max/mean load | TTFT p50 s "
            "| TTFT p99 s | decision p50 ms |\n|---|---|---|---|---|---|---|---|"
        )
        for r in rows:
            dec = f"{r['decision_p50_ms']:.2f}" if "decision_p50_ms" in r else "-"
            print(
                f"| {r['policy']} | {r['hit_rate']:.1%} | {r['ceiling']:.1%} "
                f"| {r['capture_rate']:.1%} | {r['load_max_over_mean']:.2f} "
                f"| {r['ttft_p50_s']:.2f} | {r['ttft_p99_s']:.2f} | {dec} |"
            )
        _print_step_rates(rows)
    return 0


def _print_step_rates(rows: list[dict]) -> None:  # type: ignore[type-arg]
    """The step rates each ttft-cost profile with the in-flight term fitted (steps.py)."""
    for r in rows:
        st = r.get("step_rates")
        if st:
            print(
                f"{r['policy']}: step rates seq_step_s={st['seq_step_s']:.3g} "
                f"context_step_s_per_token={st['context_step_s_per_token']:.3g} "
                f"decode_steps={st['decode_steps']:.0f} (medians over the {st['fitted_decisions']} "
                f"of {st['decisions']} decisions that used a fit; {st['samples']} samples, "
                f"{st['timed_samples']} from engine decode timing)"
            )
