"""``kvmesh bench disagg``: prefill/decode disaggregation, two parts.

    kvmesh bench disagg                                  # sim part: both workloads, one table
    kvmesh bench disagg --workloads agentic --sessions 16 --json
    kvmesh bench disagg --placements joint --workers-per-node 4
    kvmesh bench disagg --parts handoff                  # real vLLM (CPU, tiny model), < 2 min

sim      simulated workers (services/worker/sim, SimWorkerConfig defaults: an 8B model on an
         H100-class GPU) behind the real router core (KV index, precise-prefix profile,
         DisaggHandler): aggregated (N workers of role both), always-disaggregated (threshold 1)
         and selective (each --thresholds value) on P prefill + N-P decode workers, for an
         agentic workload (benchmarks/replay/agentic.py sessions) and a chat workload (short
         prompts, longer answers). Each disaggregated mode runs once per --placements value:
         independent (decode pick, then prefill pick) and joint (the pair of least cost,
         services/router/core/placement.py). Workers sit --workers-per-node to a node, the
         prefill workers spread over the nodes. The hand-off moves the blocks the decode
         worker lacks: free within a node (one kvmanager), at --transfer-gbps between nodes;
         then they load into its KV cache at the simulator's load_s_per_token. The router's
         PlacementConfig is calibrated to the simulation (bandwidth, KV bytes and prefill time
         per token); --queued-request-s and --decode-slack set its two policy knobs.
handoff  a 1 prefill + 1 decode vLLM mesh (kvmesh.launcher.Mesh): TTFT through the router, the
         prefill call (kvmesh_router_prefill_seconds) and the rest (hand-off + decode's first
         token), per block; beside the same prompts on the same mesh's decode worker aggregated.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace

PARTS = ("sim", "handoff")


def register(bench_subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Adds ``disagg`` under the ``bench`` parser's subcommands."""
    from services.router.core.placement import PlacementConfig
    from services.worker.sim.model import SimWorkerConfig

    from .sim import PLACEMENTS
    from .workloads import WORKLOADS

    d = SimWorkerConfig()
    pd = PlacementConfig()
    p = bench_subparsers.add_parser(
        "disagg",
        help="prefill/decode disaggregation: aggregated vs always vs selective; hand-off time",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--parts", default="sim", help="comma-separated: " + ", ".join(PARTS))
    p.add_argument("--workloads", default=",".join(WORKLOADS), help="sim: agentic, chat")
    p.add_argument("--sessions", type=int, default=16, help="agentic: main sessions")
    p.add_argument("--chat-requests", type=int, default=4000, help="chat: requests (40/s)")
    p.add_argument("--workers", type=int, default=8, help="sim: workers in every mesh")
    p.add_argument("--prefill-workers", type=int, default=4, help="sim: of them, role prefill")
    p.add_argument(
        "--thresholds", default="1024,4096", help="sim: selective threshold_tokens, one row each"
    )
    p.add_argument("--profile", default="precise-prefix", help="sim: router scheduler profile")
    p.add_argument(
        "--placements",
        default=",".join(PLACEMENTS),
        help="sim: disaggregated rows per placement (" + ", ".join(PLACEMENTS) + ")",
    )
    p.add_argument(
        "--workers-per-node", type=int, default=2, help="sim: workers sharing a node/kvmanager"
    )
    p.add_argument(
        "--queued-request-s",
        type=float,
        default=pd.queued_request_s,
        help="sim, joint: the router's PlacementConfig.queued_request_s",
    )
    p.add_argument(
        "--decode-slack",
        type=float,
        default=pd.decode_slack,
        help="sim, joint: the router's PlacementConfig.decode_slack",
    )
    p.add_argument(
        "--transfer-gbps", type=float, default=10.0, help="sim: hand-off between nodes, 1e9 B/s"
    )
    p.add_argument(
        "--load-gbps",
        type=float,
        default=131_072 / d.load_s_per_token / 1e9,
        help="sim: loading handed-over KV into the decode worker, 1e9 B/s (stalls its step)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--prompts", type=int, default=6, help="handoff: prompts per case")
    p.add_argument("--prompt-tokens", type=int, default=1800, help="handoff: prompt length")
    p.add_argument("--json", action="store_true", help="one JSON object per row")
    p.set_defaults(func=run)


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def parse_list(text: str, allowed: tuple[str, ...], flag: str) -> list[str]:
    got = [x.strip() for x in text.split(",") if x.strip()]
    bad = [x for x in got if x not in allowed]
    if bad or not got:
        raise SystemExit(f"{flag}: unknown {bad or text!r}; choose from {', '.join(allowed)}")
    return got


def setups(
    workers: int,
    prefill: int,
    thresholds: list[int],
    profile: str,
    placements: tuple[str, ...] = ("independent",),
    workers_per_node: int = 2,
) -> list:  # type: ignore[type-arg]
    """The rows of one run: aggregated, then always and selective per threshold, each once per
    placement (side by side)."""
    from .sim import MeshSetup

    base = MeshSetup(
        "aggregated", workers, prefill, profile=profile, workers_per_node=workers_per_node
    )
    out = [base]
    for mode, t in [("always", base.threshold_tokens)] + [("selective", t) for t in thresholds]:
        out += [replace(base, mode=mode, threshold_tokens=t, placement=p) for p in placements]
    return out


def run(a: argparse.Namespace) -> int:
    from services.router.core.placement import PlacementConfig
    from services.worker.sim.model import SimWorkerConfig

    from .sim import KV_BYTES_PER_TOKEN, PLACEMENTS, format_table, simulate
    from .workloads import WORKLOADS, requests_of

    parts = parse_list(a.parts, PARTS, "--parts")
    started = time.perf_counter()
    if "sim" in parts:
        cfg = replace(SimWorkerConfig(), load_s_per_token=KV_BYTES_PER_TOKEN / (a.load_gbps * 1e9))
        thresholds = [int(x) for x in a.thresholds.split(",") if x.strip()]
        placements = tuple(parse_list(a.placements, PLACEMENTS, "--placements"))
        # The router's cost model, calibrated to the simulation (an operator measures these).
        placement = PlacementConfig(
            network_gbps=a.transfer_gbps,
            kv_bytes_per_token=KV_BYTES_PER_TOKEN,
            prefill_s_per_token=cfg.prefill_s_per_token,
            queued_request_s=a.queued_request_s,
            decode_slack=a.decode_slack,
        )
        head = (
            f"sim: {a.workers} workers ({a.prefill_workers} prefill + "
            f"{a.workers - a.prefill_workers} decode when disaggregated), "
            f"{a.workers_per_node} per node, profile {a.profile}, "
            f"SimWorkerConfig({', '.join(f'{k}={v}' for k, v in _fields(cfg).items())}), "
            f"KV {KV_BYTES_PER_TOKEN} B/token, hand-off free within a node, "
            f"{a.transfer_gbps} GB/s between nodes, selective thresholds {thresholds}, "
            f"placements {list(placements)} (joint: queued_request_s {a.queued_request_s}, "
            f"decode_slack {a.decode_slack}, prefill_s_per_token {cfg.prefill_s_per_token})"
        )
        _log(head)
        reports = []
        for wl in parse_list(a.workloads, WORKLOADS, "--workloads"):
            size = a.sessions if wl == "agentic" else a.chat_requests
            reqs = requests_of(wl, seed=a.seed, size=size, block_size=cfg.block_size)
            for s in setups(
                a.workers,
                a.prefill_workers,
                thresholds,
                a.profile,
                placements,
                a.workers_per_node,
            ):
                r = simulate(
                    reqs,
                    s,
                    config=cfg,
                    transfer_bytes_per_s=a.transfer_gbps * 1e9,
                    workload=wl,
                    seed=a.seed,
                    placement=placement,
                )
                _log(f"{wl} {r.mode}: {r.requests} requests in {r.wall_s:.1f} wall s")
                reports.append(r)
                if a.json:
                    print(json.dumps(r.as_dict()), flush=True)
        if not a.json:
            print(f"\n{head}\n\n{format_table(reports)}\n")
    if "handoff" in parts:
        from . import handoff

        rows = handoff.run(handoff.HandoffConfig(a.prompts, a.prompt_tokens), _log)
        if a.json:
            for row in rows:
                print(json.dumps(row), flush=True)
        else:
            print(handoff.format_table(rows))
    _log(f"took {time.perf_counter() - started:.0f} s")
    return 0


def _fields(obj: object) -> dict[str, object]:
    from dataclasses import fields

    return {f.name: getattr(obj, f.name) for f in fields(obj)}  # type: ignore[arg-type]
