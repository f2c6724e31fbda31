"""``kvmesh bench router-scale``: a router's request throughput with 1, 2, ... processes.

    kvmesh bench router-scale --processes 1,2 --rounds 2

``kvmesh router --processes N`` runs N whole routers on one port (SO_REUSEPORT; each its own
exact KV index, its own streams to the workers; services/router/procs.py). This starts fast
simulated workers (services/worker/sim: a simulator, not an engine, here run at ``--sim-speedup``
times real time so that the router, not the workers, is the bottleneck) and a router with each
process count in turn, alternating over ``--rounds``, and drives each with the closed-loop load
of ``benchmarks.serve.streams_load`` (``--concurrency`` streams over 32 client connections, each
sending its next token-id request as soon as the last ends, for ``--duration-s``). Prints one
table: requests/s in the steady window and its ratio to one process, TTFT, the router's CPU per
request, the CPU each router process used (how the kernel spread the connections) and what the
workers and the load client used, in cores.

What it can show depends on the cores: on a machine with C cores, the load client and the
workers take part of them, and N router processes can use at most what is left.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from kvmesh.launcher import Mesh, MeshSpec, child_env

from .targets import REPO, cpu_seconds


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "router-scale",
        help="a router's request throughput with 1, 2, ... processes on one port",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--processes", default="1,2", help="router process counts to compare (1,2)")
    p.add_argument("--workers", type=int, default=4, help="simulated workers (4)")
    p.add_argument("--concurrency", type=int, default=256, help="closed-loop streams (256)")
    p.add_argument("--duration-s", type=float, default=20.0, help="steady window, s (20)")
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--max-tokens", type=int, default=4)
    p.add_argument(
        "--sim-speedup", type=float, default=100.0, help="simulated time per real time (100)"
    )
    p.add_argument(
        "--policy", default="", help="the router's --policy (default: its default profile)"
    )
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out-dir", type=Path, default=None)
    p.set_defaults(func=cmd_router_scale)


def process_tree(pid: int) -> list[int]:
    """``pid`` and its descendants (read from /proc; the processes alive now)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        for task in Path(f"/proc/{p}/task").glob("*"):
            try:
                todo += [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                continue
    return out


def _load(address: str, a: argparse.Namespace, out: Path) -> subprocess.Popen[bytes]:
    cmd = [
        sys.executable, "-m", "benchmarks.serve.streams_load",
        "--target", "router", "--address", address,
        "--streams", str(a.concurrency),
        "--prompt-tokens", str(a.prompt_tokens),
        "--max-tokens", str(a.max_tokens),
        "--duration-s", str(a.duration_s),
        "--out", str(out),
    ]  # fmt: skip
    return subprocess.Popen(cmd, cwd=REPO, env={**os.environ, **child_env()})


def measure(mesh: Mesh, a: argparse.Namespace, out: Path) -> dict[str, Any]:
    """One closed-loop run against ``mesh``'s router: the load's result plus CPU seconds."""
    assert mesh.router is not None
    routers = [p for p in process_tree(mesh.router.proc.pid) if p != mesh.router.proc.pid]
    routers = routers or [mesh.router.proc.pid]  # one process: no supervisor
    workers = [p for w in mesh.workers for p in process_tree(w.proc.pid)]
    per_router = [cpu_seconds([p]) for p in routers]
    work0 = cpu_seconds(workers)
    start = time.perf_counter()
    load = _load(mesh.router_address, a, out)
    load_cpu = 0.0
    while load.poll() is None:  # the load's own CPU, read while it lives
        load_cpu = cpu_seconds([load.pid]) or load_cpu
        time.sleep(0.2)
    wall_s = time.perf_counter() - start
    if load.returncode != 0:
        raise SystemExit(f"the load exited with {load.returncode}")
    r: dict[str, Any] = json.loads(out.read_text())
    per_router = [cpu_seconds([p]) - b for p, b in zip(routers, per_router, strict=True)]
    r["router_cpu_s"] = sum(per_router)
    r["router_cores"] = [c / wall_s for c in per_router]
    r["workers_cores"] = (cpu_seconds(workers) - work0) / wall_s
    r["load_cores"] = load_cpu / wall_s
    return r


def cmd_router_scale(a: argparse.Namespace) -> int:
    counts = [int(x) for x in a.processes.split(",")]
    out_dir = a.out_dir or Path(tempfile.mkdtemp(prefix="kvmesh-bench-router-scale-"))
    out_dir.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    for rnd in range(a.rounds):
        for n in counts:
            sim = (
                "--engine", "simulated",
                "--sim-speedup", str(a.sim_speedup),
                "--sim-max-running", str(a.concurrency),
            )  # fmt: skip
            spec = MeshSpec(
                model_path=Path("(simulated)"),
                served_model_name="sim",
                workers=a.workers,
                max_model_len=8192,
                kvmanager_cpu_bytes=0,
                bind_cpus=False,  # simulated workers compute nothing
                router_processes=n,
                router_policy=a.policy,
                worker_args=sim,
                log_dir=out_dir / f"mesh-{n}-{rnd}",
            )
            with Mesh(spec) as mesh:
                r = measure(mesh, a, out_dir / f"load-{n}-{rnd}.json")
            r.update(processes=n, round=rnd)
            rows.append(r)
            print(
                f"round {rnd + 1} processes {n}: {r['steady_requests_per_s']:.0f} req/s, router "
                f"cores {'+'.join(f'{c:.2f}' for c in r['router_cores'])}, failed {r['failed']}",
                file=sys.stderr,
                flush=True,
            )
    (out_dir / "summary.json").write_text(json.dumps(rows, indent=1))
    print(format_table(rows, a), end="")
    return 0


def format_table(rows: list[dict[str, Any]], a: argparse.Namespace) -> str:
    """Medians over rounds, one row per process count."""
    head = (
        f"{a.concurrency} closed-loop streams for {a.duration_s:.0f} s, {a.workers} simulated "
        f"workers (x{a.sim_speedup:g} real time), {a.prompt_tokens}-token prompts, "
        f"{a.max_tokens} tokens each, {os.cpu_count()} cores, router policy "
        f"{a.policy or '(default)'}; medians of {a.rounds} rounds\n\n"
        "| router processes | req/s | vs 1 process | TTFT p50 / p99 ms | failed | router CPU "
        "ms/request | router cores (each process) | workers cores | load cores |\n"
        "|---:|---:|---:|---:|---:|---:|---|---:|---:|\n"
    )
    by_n: dict[int, list[dict[str, Any]]] = {}
    for r in rows:
        by_n.setdefault(r["processes"], []).append(r)

    def med(rs: list[dict[str, Any]], key: str) -> float:
        return statistics.median(float(r[key]) for r in rs)

    base = med(by_n[min(by_n)], "steady_requests_per_s") if by_n else 0.0
    lines = []
    for n, rs in sorted(by_n.items()):
        rps = med(rs, "steady_requests_per_s")
        cores = [statistics.median(c) for c in zip(*(r["router_cores"] for r in rs), strict=False)]
        cpu_ms = statistics.median(
            1e3 * r["router_cpu_s"] / max(int(r["completed"]), 1) for r in rs
        )
        lines.append(
            f"| {n} | {rps:.0f} | {rps / base if base else 0:.2f}x "
            f"| {med(rs, 'ttft_p50_ms'):.1f} / {med(rs, 'ttft_p99_ms'):.1f} "
            f"| {sum(int(r['failed']) for r in rs)} | {cpu_ms:.2f} "
            f"| {' + '.join(f'{c:.2f}' for c in cores)} = {sum(cores):.2f} "
            f"| {med(rs, 'workers_cores'):.2f} | {med(rs, 'load_cores'):.2f} |"
        )
    return head + "\n".join(lines) + "\n"
