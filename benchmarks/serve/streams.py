"""``kvmesh bench streams``: thousands of concurrent streams through one router, and what the
router adds to their latency.

    kvmesh bench streams --streams 3000 --workers 8

Starts simulated workers (services/worker/sim: a simulator, not an engine; slowed down with
``--sim-speedup`` so that thousands of streams fit this machine's cores) and a router, as
``kvmesh up`` does, then runs the same load twice, alternating: straight to the workers
(``Worker.Generate``, requests spread round robin) and through the router (``Router.Generate``).
Each of ``--streams`` concurrent streams sends token ids (a prompt of its own) and reads
``--max-tokens`` tokens; the driver (``benchmarks.serve.streams_load``, a process of its own)
reports TTFT and inter-token latency percentiles. The router's added latency is the difference
of the two runs' percentiles; its CPU per token and per request is counted from /proc.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from kvmesh.launcher import Mesh, MeshSpec, child_env
from kvmesh.profiling import ENV

from .targets import REPO, cpu_seconds


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "streams",
        help="thousands of concurrent streams through one router vs straight to the workers",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--streams", type=int, default=3000, help="concurrent streams (3000)")
    p.add_argument("--workers", type=int, default=8, help="simulated workers (8)")
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument(
        "--sim-speedup", type=float, default=0.05, help="simulated time per real time (0.05)"
    )
    p.add_argument("--router-processes", type=int, default=1)
    p.add_argument(
        "--policy", default="", help="the router's --policy (default: its default profile)"
    )
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--out-dir", type=Path, default=None)
    p.add_argument(
        "--profile-dir",
        type=Path,
        default=None,
        help="run the router and workers under cProfile, writing DIR/<service>-<pid>.pstats "
        "(kvmesh.profiling); costs them ~1.5-2x CPU, so figures of such a run are not comparable",
    )
    p.set_defaults(func=cmd_streams)


def _drive(target: str, address: str, a: argparse.Namespace, out: Path) -> dict[str, Any]:
    cmd = [
        sys.executable, "-m", "benchmarks.serve.streams_load",
        "--target", target, "--address", address,
        "--streams", str(a.streams),
        "--prompt-tokens", str(a.prompt_tokens),
        "--max-tokens", str(a.max_tokens),
        "--out", str(out),
    ]  # fmt: skip
    subprocess.run(cmd, check=True, cwd=REPO, env={**os.environ, **child_env()})
    result: dict[str, Any] = json.loads(out.read_text())
    return result


def cmd_streams(a: argparse.Namespace) -> int:
    out_dir = a.out_dir or Path(tempfile.mkdtemp(prefix="kvmesh-bench-streams-"))
    out_dir.mkdir(parents=True, exist_ok=True)
    per_worker = -(-a.streams // a.workers)
    sim_args = (
        "--engine", "simulated",
        "--sim-speedup", str(a.sim_speedup),
        "--sim-max-running", str(per_worker),
        "--sim-capacity-blocks", str(per_worker * (a.prompt_tokens // 32 + 2) * 2),
    )  # fmt: skip
    spec = MeshSpec(
        model_path=Path("(simulated)"),
        served_model_name="sim",
        workers=a.workers,
        max_model_len=4096,
        kvmanager_cpu_bytes=0,
        bind_cpus=False,  # simulated workers compute nothing
        router_processes=a.router_processes,
        router_policy=a.policy,
        worker_args=sim_args,
        log_dir=out_dir / "mesh",
        env={ENV: str(a.profile_dir.resolve())} if a.profile_dir else {},
    )
    rows = []
    with Mesh(spec) as mesh:
        assert mesh.router is not None
        workers = ",".join(w.ready["address"] for w in mesh.workers)
        router_pids = [mesh.router.proc.pid]
        for rnd in range(a.rounds):
            for target, address in (("direct", workers), ("router", mesh.router_address)):
                before = cpu_seconds(router_pids)
                r = _drive(target, address, a, out_dir / f"{target}-{rnd}.json")
                r["router_cpu_s"] = cpu_seconds(router_pids) - before
                r["target"] = target
                rows.append(r)
                print(
                    f"round {rnd + 1} {target}: {r['completed']}/{r['requests']} streams, "
                    f"TTFT p50/p99 {r['ttft_p50_ms']:.1f}/{r['ttft_p99_ms']:.1f} ms, "
                    f"ITL p99 {r['itl_p99_ms']:.1f} ms",
                    file=sys.stderr,
                    flush=True,
                )
    print(format_table(rows, a), end="")
    (out_dir / "summary.json").write_text(json.dumps(rows, indent=1))
    return 0


def format_table(rows: list[dict[str, Any]], a: argparse.Namespace) -> str:
    head = (
        f"{a.streams} concurrent streams, {a.workers} simulated workers, "
        f"{a.prompt_tokens}-token prompts, {a.max_tokens} tokens each, router policy "
        f"{a.policy or '(default)'}\n\n"
        "| path | streams done | failed | peak concurrent | TTFT p50 / p99 ms | "
        "ITL p50 / p99 ms | tokens/s | router CPU us/token | router CPU ms/request | streams per worker min / max |\n"
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n"
    )
    lines = []
    for r in rows:
        tokens = max(r["tokens"], 1)
        lines.append(
            f"| {r['target']} | {r['completed']} | {r['failed']} | {r['peak_concurrent']} "
            f"| {r['ttft_p50_ms']:.1f} / {r['ttft_p99_ms']:.1f} "
            f"| {r['itl_p50_ms']:.1f} / {r['itl_p99_ms']:.1f} | {r['tokens_per_s']:.0f} "
            f"| {1e6 * r['router_cpu_s'] / tokens:.0f} "
            f"| {1e3 * r['router_cpu_s'] / max(r['completed'], 1):.2f} "
            f"| {r.get('per_worker_min', '')} / {r.get('per_worker_max', '')} |"
        )
    direct = [r for r in rows if r["target"] == "direct"]
    routed = [r for r in rows if r["target"] == "router"]
    tail = ""
    if direct and routed:
        d, g = direct[-1], routed[-1]
        tail = (
            f"\nadded by the router: TTFT p50 {g['ttft_p50_ms'] - d['ttft_p50_ms']:+.1f} ms, "
            f"p99 {g['ttft_p99_ms'] - d['ttft_p99_ms']:+.1f} ms; ITL p50 "
            f"{g['itl_p50_ms'] - d['itl_p50_ms']:+.1f} ms, p99 "
            f"{g['itl_p99_ms'] - d['itl_p99_ms']:+.1f} ms\n"
        )
    return head + "\n".join(lines) + "\n" + tail
