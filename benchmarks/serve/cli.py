"""``kvmesh bench serve``: kvmesh against plain ``vllm serve`` under vLLM's own load client.

    kvmesh bench serve --model tiny
    kvmesh bench serve --model smollm2 --num-prompts 16 --output-len 64
    kvmesh bench serve --model tiny --targets kvmesh-n,kvmesh-n-rr --kvmanager-cpu-bytes 0 \\
        --dataset prefix_repetition --kv-cache-bytes 8MiB --prefix-len 1024 --num-prefixes 16

Starts each target in turn on the same engine settings (eager, prefix caching, block size,
context, KV cache bytes), drives it with ``vllm bench serve`` (HTTP, ``/v1/completions``) and
with ``benchmarks.serve.grpc_load`` (the same requests through kvmesh's gRPC API), stops it, and
goes on to the next; ``--rounds R`` repeats the whole alternation and reports medians. Targets:

- ``vllm``: ``vllm serve`` on one engine (the baseline every ratio is taken against);
- ``kvmesh-1``: ``kvmesh up --workers 1`` as it starts by default (node kvmanager on; the
  router and the worker in processes of their own);
- ``kvmesh-1-node``: the same with the worker in the router's process (``kvmesh node``,
  ``--colocate on``);
- ``kvmesh-1-no-kvmanager``: ``kvmesh-1`` without the node kvmanager (no KV connector in the
  engine: what the KV tiers cost the engine's step);
- ``kvmesh-1-unbound``: ``kvmesh-1`` with ``--no-cpu-binding`` (no core of its own for the
  engine: vLLM's own binding);
- ``kvmesh-n``: ``--workers N`` with the router's default profile;
- ``kvmesh-n-rr``: the same with ``--policy round-robin`` (a Kubernetes Service).

Also counts the CPU seconds each process spent during each run (from /proc), and prints them
per request and per output token: on a GPU node that CPU is what kvmesh takes from vLLM's own
scheduler process.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from kvmesh.units import parse_bytes

from .run import Load, run_load
from .targets import EngineSettings, TargetSpec, start_kvmesh, start_vllm

TARGETS = (
    "vllm",
    "kvmesh-1",
    "kvmesh-1-node",
    "kvmesh-1-no-kvmanager",
    "kvmesh-1-unbound",
    "kvmesh-n",
    "kvmesh-n-rr",
)
ROLES = ("router", "worker", "engine", "kvmanager", "vllm-api", "node")


def target_specs(names: list[str], workers: int, kvmanager_cpu_bytes: int) -> list[TargetSpec]:
    specs = {
        "vllm": TargetSpec("vllm", "vllm"),
        "kvmesh-1": TargetSpec("kvmesh-1", "kvmesh", 1, kvmanager_cpu_bytes=kvmanager_cpu_bytes),
        "kvmesh-1-node": TargetSpec(
            "kvmesh-1-node", "kvmesh", 1, kvmanager_cpu_bytes=kvmanager_cpu_bytes, colocate=True
        ),
        "kvmesh-1-no-kvmanager": TargetSpec(
            "kvmesh-1-no-kvmanager", "kvmesh", 1, kvmanager_cpu_bytes=0
        ),
        "kvmesh-1-unbound": TargetSpec(
            "kvmesh-1-unbound",
            "kvmesh",
            1,
            kvmanager_cpu_bytes=kvmanager_cpu_bytes,
            bind_cpus=False,
        ),
        "kvmesh-n": TargetSpec(
            f"kvmesh-{workers}", "kvmesh", workers, kvmanager_cpu_bytes=kvmanager_cpu_bytes
        ),
        "kvmesh-n-rr": TargetSpec(
            f"kvmesh-{workers}-rr",
            "kvmesh",
            workers,
            policy="round-robin",
            kvmanager_cpu_bytes=kvmanager_cpu_bytes,
        ),
    }
    unknown = [n for n in names if n not in specs]
    if unknown:
        raise SystemExit(f"--targets: unknown {unknown}; choose from {', '.join(TARGETS)}")
    return [specs[n] for n in names]


def loads(a: argparse.Namespace) -> list[Load]:
    out = []
    for dataset in a.dataset:
        for rate in a.rates:
            for frontend in a.frontends:
                out.append(
                    Load(
                        dataset=dataset,
                        frontend=frontend,
                        concurrency=a.concurrency,
                        request_rate=rate,
                        num_prompts=a.num_prompts,
                        input_len=a.input_len,
                        output_len=a.output_len,
                        prefix_len=a.prefix_len,
                        suffix_len=a.suffix_len,
                        num_prefixes=a.num_prefixes,
                    )
                )
    return out


def _median(rows: list[dict[str, Any]], key: str) -> float:
    return statistics.median(float(r[key]) for r in rows)


def summarize(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (target, frontend, load): medians over rounds, CPU per request and token."""
    groups: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
    for r in results:
        groups.setdefault((r["target"], r["frontend"], r["load"]), []).append(r)
    rows = []
    for (target, frontend, load), rs in groups.items():
        row: dict[str, Any] = {"target": target, "frontend": frontend, "load": load}
        for key in (
            "request_throughput", "output_throughput", "mean_ttft_ms", "median_ttft_ms",
            "p99_ttft_ms", "mean_tpot_ms", "completed", "failed",
        ):  # fmt: skip
            row[key] = _median(rs, key)
        row["rounds"] = len(rs)
        for role in ROLES:
            per_req = [r["cpu_s"][role] / max(r["completed"], 1) for r in rs if role in r["cpu_s"]]
            per_tok = [
                r["cpu_s"][role] / max(r["total_output_tokens"], 1)
                for r in rs
                if role in r["cpu_s"]
            ]
            if per_req:
                row[f"cpu_ms_per_req_{role}"] = 1000 * statistics.median(per_req)
                row[f"cpu_us_per_token_{role}"] = 1e6 * statistics.median(per_tok)
        rows.append(row)
    base = {(r["load"]): r for r in rows if r["target"] == "vllm" and r["frontend"] == "http"}
    for row in rows:
        b = base.get(row["load"])
        if b is not None and b["request_throughput"] > 0:
            row["throughput_vs_vllm"] = row["request_throughput"] / b["request_throughput"]
            row["ttft_p50_vs_vllm"] = row["median_ttft_ms"] / max(b["median_ttft_ms"], 1e-9)
    return rows


def format_table(rows: list[dict[str, Any]]) -> str:
    head = (
        "| target | api | load | req/s | out tok/s | TTFT mean / p50 / p99 ms | TPOT ms | failed "
        "| req/s vs vllm | TTFT p50 vs vllm | CPU us/token: router / worker / engine / kvmanager "
        "(node: router + worker in one process; vllm: api / engine) |\n"
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---|\n"
    )
    lines = []
    for r in rows:
        if r["target"] == "vllm":
            cpu = " / ".join(
                f"{r.get(f'cpu_us_per_token_{k}', 0):.0f}" for k in ("vllm-api", "engine")
            )
        else:
            cpu = " / ".join(f"{r.get(f'cpu_us_per_token_{k}', 0):.0f}" for k in _kvmesh_roles(r))
            if "cpu_us_per_token_node" in r:
                cpu = f"node {cpu}"
        ratio = r.get("throughput_vs_vllm")
        tratio = r.get("ttft_p50_vs_vllm")
        lines.append(
            f"| {r['target']} | {r['frontend']} | {r['load']} | {r['request_throughput']:.2f} "
            f"| {r['output_throughput']:.0f} | {r['mean_ttft_ms']:.0f} / "
            f"{r['median_ttft_ms']:.0f} / {r['p99_ttft_ms']:.0f} | {r['mean_tpot_ms']:.1f} "
            f"| {r['failed']:.0f} | {'' if ratio is None else f'{ratio:.2f}x'} "
            f"| {'' if tratio is None else f'{tratio:.2f}x'} | {cpu} |"
        )
    per_req = [
        "",
        "CPU per request, ms (router / worker / engine / kvmanager; vllm: api / engine):",
        "",
        "| target | api | load | ms per request |",
        "|---|---|---|---|",
    ]
    for r in rows:
        roles = ("vllm-api", "engine") if r["target"] == "vllm" else _kvmesh_roles(r)
        cpu = " / ".join(f"{r.get(f'cpu_ms_per_req_{k}', 0):.1f}" for k in roles)
        if "cpu_ms_per_req_node" in r:
            cpu = f"node {cpu}"
        per_req.append(f"| {r['target']} | {r['frontend']} | {r['load']} | {cpu} |")
    return head + "\n".join(lines) + "\n" + "\n".join(per_req) + "\n"


def _kvmesh_roles(row: dict[str, Any]) -> tuple[str, ...]:
    """A kvmesh row's processes: router, worker, engine, kvmanager; colocated: node (the
    router and the worker in one process), engine, kvmanager."""
    if "cpu_us_per_token_node" in row:
        return ("node", "engine", "kvmanager")
    return ("router", "worker", "engine", "kvmanager")


def _rate(text: str) -> float:
    return math.inf if text in ("inf", "") else float(text)


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve",
        help="kvmesh vs vllm serve under vLLM's own load client (HTTP and gRPC)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", default="tiny", help="tiny, smollm2 or a model dir (default tiny)")
    p.add_argument(
        "--targets",
        type=lambda s: s.split(","),
        default=list(TARGETS),
        help=f"comma-separated, run in this order (default {','.join(TARGETS)})",
    )
    p.add_argument("--workers", type=int, default=2, help="N of kvmesh-n (default 2)")
    p.add_argument(
        "--dataset",
        type=lambda s: s.split(","),
        default=["random", "prefix_repetition"],
        help="vllm bench serve datasets, comma-separated (default random,prefix_repetition)",
    )
    p.add_argument(
        "--frontends",
        type=lambda s: s.split(","),
        default=["http", "grpc"],
        help="http (vllm bench serve on /v1/completions), grpc (kvmesh only) (default both)",
    )
    p.add_argument("--concurrency", type=int, default=8, help="--max-concurrency (default 8)")
    p.add_argument(
        "--rates",
        type=lambda s: [_rate(x) for x in s.split(",")],
        default=[math.inf],
        help="request rates to sweep, req/s or inf, comma-separated (default inf)",
    )
    p.add_argument("--num-prompts", type=int, default=48)
    p.add_argument("--input-len", type=int, default=512, help="random: prompt tokens")
    p.add_argument("--output-len", type=int, default=128, help="output tokens per request")
    p.add_argument("--prefix-len", type=int, default=256, help="prefix_repetition: prefix tokens")
    p.add_argument("--suffix-len", type=int, default=256, help="prefix_repetition: suffix tokens")
    p.add_argument("--num-prefixes", type=int, default=10, help="prefix_repetition: prefixes")
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument(
        "--dtype",
        default="auto",
        help="vLLM --dtype for every target (auto; float32 where bf16 is slow)",
    )
    p.add_argument(
        "--kv-cache-bytes", type=parse_bytes, default=256 << 20, help="per engine (256MiB)"
    )
    p.add_argument(
        "--kvmanager-cpu-bytes",
        type=parse_bytes,
        default=1 << 30,
        help="kvmesh targets' node kvmanager CPU tier, as kvmesh up (1GiB; 0: none)",
    )
    p.add_argument("--rounds", type=int, default=1, help="repeat the alternation (medians)")
    p.add_argument("--vllm-port", type=int, default=8100)
    p.add_argument("--out-dir", type=Path, default=None, help="result files (default: a temp dir)")
    p.add_argument("--json", action="store_true", help="print the rows as JSON too")
    p.set_defaults(func=cmd_serve)


def cmd_serve(a: argparse.Namespace) -> int:
    from kvmesh.models import resolve_model

    model = resolve_model(a.model)
    served = model.name.rsplit("-", 1)[0] if a.model in ("tiny", "smollm2") else model.name
    out_dir = a.out_dir or Path(tempfile.mkdtemp(prefix="kvmesh-bench-serve-"))
    out_dir.mkdir(parents=True, exist_ok=True)
    engine = EngineSettings(
        max_model_len=a.max_model_len, kv_cache_bytes=a.kv_cache_bytes, dtype=a.dtype
    )
    specs = target_specs(a.targets, a.workers, a.kvmanager_cpu_bytes)
    plan = loads(a)
    results: list[dict[str, Any]] = []
    print(f"bench serve: model {model}, results in {out_dir}", file=sys.stderr, flush=True)
    for rnd in range(a.rounds):
        for spec in specs:
            if spec.kind == "vllm":
                target = start_vllm(spec, model, served, engine, a.vllm_port, out_dir)
            else:
                target = start_kvmesh(spec, model, served, engine, out_dir)
            try:
                for load in plan:
                    if load.frontend == "grpc" and spec.kind == "vllm":
                        continue
                    r = run_load(target, load, model, out_dir)
                    r.update(target=spec.label, frontend=load.frontend, load=load.name)
                    results.append(r)
                    print(
                        f"round {rnd + 1} {spec.label} {load.frontend} {load.name}: "
                        f"{r['request_throughput']:.2f} req/s, TTFT p50 "
                        f"{r['median_ttft_ms']:.0f} ms, failed {r['failed']}",
                        file=sys.stderr,
                        flush=True,
                    )
            finally:
                target.stop()
    rows = summarize(results)
    (out_dir / "summary.json").write_text(json.dumps(rows, indent=1))
    print(format_table(rows), end="")
    if a.json:
        print(json.dumps(rows))
    return 0
