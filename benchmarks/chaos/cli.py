"""``kvmesh bench chaos``: faults under load on a real mesh, and what the clients saw.

    kvmesh bench chaos --model tiny --scenarios all

Starts a mesh on this machine as ``kvmesh up`` does (real etcd, real vLLM workers, the node
kvmanager), runs K concurrent multi-turn greedy sessions over gRPC and over the OpenAI HTTP
front door (benchmarks/chaos/sessions.py) once with no fault, then once per scenario
(benchmarks/chaos/faults.py), and prints for each scenario and API: turns sent, ok, failed
before the first token, failed mid-stream, resumed, hung, p99 latency against the no-fault
run, and how many greedy outputs are identical to the no-fault run's for the same turn.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kvmesh.etcd_server import free_port
from kvmesh.launcher import Mesh, MeshSpec, stop_child

from .faults import PD_SCENARIOS, SCENARIOS, Fleet, Timing
from .sessions import (
    FAILED_BEFORE_FIRST,
    FAILED_MID,
    HUNG,
    OK,
    LoadResult,
    LoadSpec,
    TurnResult,
    run_load,
)


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "chaos",
        help="faults under load (kill/stop workers, kvmanager, etcd) and what clients saw",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", default="tiny", help="a built-in model name or a model directory")
    p.add_argument(
        "--scenarios", default="all", help=f"comma-separated, or all: {', '.join(SCENARIOS)}"
    )
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--routers", type=int, default=2, help="routers (the router scenarios need 2)")
    p.add_argument(
        "--disagg",
        action="store_true",
        help="a P/D mesh (1 prefill + 2 decode workers, prompts disaggregated); scenarios: "
        + ", ".join(PD_SCENARIOS),
    )
    p.add_argument("--sessions", type=int, default=4, help="concurrent sessions per API")
    p.add_argument("--turns", type=int, default=6, help="turns before a session starts over")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--apis", default="grpc,http")
    p.add_argument("--warmup-s", type=float, default=4.0)
    p.add_argument("--settle-s", type=float, default=6.0)
    p.add_argument("--pause-s", type=float, default=10.0)
    p.add_argument("--out-dir", type=Path, default=None)
    p.set_defaults(func=cmd_chaos)


@dataclass(frozen=True, slots=True)
class Row:
    scenario: str
    api: str
    sent: int
    ok: int
    failed_before_first: int
    failed_mid: int
    resumed: int
    hung: int
    p99_ms: float
    baseline_p99_ms: float
    identical: int
    compared: int
    # resumed turns (gRPC): prompt tokens prefilled again, as a share of their prompts
    recomputed_share: float = 0.0
    errors: tuple[str, ...] = ()


def served_name(model: str) -> str:
    return Path(model).name


def _share(turns: list[TurnResult]) -> float:
    resumed = [t for t in turns if t.resumes > 0 and t.prompt_tokens > 0]
    prompt = sum(t.prompt_tokens for t in resumed)
    return sum(t.recomputed_tokens for t in resumed) / prompt if prompt else 0.0


def _p99_ms(values: list[float]) -> float:
    return 1000 * float(np.percentile(values, 99)) if values else 0.0


def summarize(scenario: str, run: LoadResult, baseline: LoadResult, api: str) -> Row:
    """One scenario's outcome on one API, its outputs compared turn by turn with the no-fault
    run's (greedy: the same turn of the same session must give the same output)."""
    turns = [t for t in run.turns if t.key[0] == api]
    base = {k: t for k, t in baseline.by_key().items() if k[0] == api and t.outcome == OK}
    count = {
        o: sum(t.outcome == o for t in turns) for o in (OK, FAILED_BEFORE_FIRST, FAILED_MID, HUNG)
    }
    compared = [t for t in turns if t.outcome == OK and t.key in base]
    return Row(
        scenario=scenario,
        api=api,
        sent=len(turns),
        ok=count[OK],
        failed_before_first=count[FAILED_BEFORE_FIRST],
        failed_mid=count[FAILED_MID],
        resumed=sum(t.resumes > 0 for t in turns),
        hung=count[HUNG],
        p99_ms=_p99_ms([t.latency_s for t in turns if t.outcome == OK]),
        baseline_p99_ms=_p99_ms([t.latency_s for t in base.values()]),
        identical=sum(t.output == base[t.key].output for t in compared),
        compared=len(compared),
        recomputed_share=_share(turns),
        errors=tuple(sorted({t.error for t in turns if t.error}))[:3],
    )


def format_table(rows: list[Row]) -> str:
    lines = [
        "| scenario | api | sent | ok | failed before 1st token | failed mid-stream | resumed | "
        "hung | p99 ms (no fault) | greedy outputs identical | resumed: prompt recomputed |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r.scenario} | {r.api} | {r.sent} | {r.ok} | {r.failed_before_first} "
            f"| {r.failed_mid} | {r.resumed} | {r.hung} | {r.p99_ms:.0f} ({r.baseline_p99_ms:.0f}) "
            f"| {r.identical} / {r.compared} "
            f"| {f'{100 * r.recomputed_share:.1f}%' if r.resumed and r.api == 'grpc' else '-'} |"
        )
    errors = [f"- {r.scenario} {r.api}: {e}" for r in rows for e in r.errors]
    return (
        "\n".join(lines) + "\n" + ("\nerrors seen:\n" + "\n".join(errors) + "\n" if errors else "")
    )


async def _run(fleet: Fleet, a: argparse.Namespace, names: list[str]) -> list[Row]:
    scenarios = PD_SCENARIOS if a.disagg else SCENARIOS
    spec = LoadSpec(
        sessions=a.sessions, turns=a.turns, max_tokens=a.max_tokens, model=served_name(a.model)
    )
    timing = Timing(warmup_s=a.warmup_s, settle_s=a.settle_s, pause_s=a.pause_s)
    apis = tuple(a.apis.split(","))

    async def load(scenario: str) -> LoadResult:
        fault = scenarios.get(scenario)

        def until() -> asyncio.Task[Any]:
            if fault is None:  # the no-fault run: as long as the longest scenario's load
                return asyncio.create_task(
                    asyncio.sleep(timing.warmup_s + timing.settle_s + 2 * timing.pause_s)
                )
            return asyncio.create_task(fault(fleet, timing))

        return await run_load(fleet.grpc_addresses, fleet.http_base_urls, spec, until, apis)

    baseline = await load("none")
    rows = [summarize("none", baseline, baseline, api) for api in apis]
    print(format_table(rows), file=sys.stderr, flush=True)
    for name in names:
        run = await load(name)
        new = [summarize(name, run, baseline, api) for api in apis]
        print(format_table(new), file=sys.stderr, flush=True)
        rows += new
    return rows


def cmd_chaos(a: argparse.Namespace) -> int:
    from kvmesh.models import resolve_model

    scenarios = PD_SCENARIOS if a.disagg else SCENARIOS
    names = list(scenarios) if a.scenarios == "all" else a.scenarios.split(",")
    unknown = [n for n in names if n not in scenarios]
    if unknown:
        raise SystemExit(f"unknown scenario(s) {unknown}; choose from {', '.join(scenarios)}")
    out_dir = a.out_dir or Path(tempfile.mkdtemp(prefix="kvmesh-bench-chaos-"))
    out_dir.mkdir(parents=True, exist_ok=True)
    spec = MeshSpec(
        model_path=resolve_model(a.model),
        served_model_name=served_name(a.model),
        workers=0 if a.disagg else a.workers,
        prefill_workers=1 if a.disagg else 0,
        decode_workers=2 if a.disagg else 0,
        # prompts from 256 tokens on (every first turn) are prefilled on the prefill worker
        router_args=("--disagg-threshold-tokens", "200") if a.disagg else (),
        max_model_len=4096,
        kv_cache_bytes=64 << 20,
        kvmanager_cpu_bytes=256 << 20,
        # float32: greedy outputs compared across runs are then a check of the KV path; in
        # bf16 a different batch or a recompute instead of a load can flip a near-tie
        worker_args=("--dtype", "float32"),
        # fixed: a restarted kvmanager comes back where the workers' connectors look
        kvmanager_args=("--port", str(free_port())),
        log_dir=out_dir / "mesh",
        router_port=free_port(),  # fixed: a restarted router comes back where clients look
        router_http_port=free_port(),
    )
    with Mesh(spec) as mesh:
        fleet = Fleet.start(mesh, a.routers)
        try:
            rows = asyncio.run(_run(fleet, a, names))
        finally:
            for child in fleet.routers[1:]:
                stop_child(child, grace_s=10.0)
    print(
        f"{a.sessions} sessions per API, {a.turns} turns each, {a.max_tokens} tokens a turn, "
        f"{'1 prefill + 2 decode' if a.disagg else a.workers} workers, {a.routers} routers\n"
    )
    print(format_table(rows), end="")
    (out_dir / "summary.json").write_text(json.dumps([asdict(r) for r in rows], indent=1))
    return 0
