"""Per-request decision traces of a replay (``kvmesh bench replay --trace-decisions FILE``).

One JSON object a line, one per request in arrival order, joined from three places:

- the driver, when it places the request (``routed``): ``n``, ``t_s`` (arrival), ``input_tokens``,
  ``session``, ``worker`` (its slot), ``load_before`` (the worker's input tokens so far over the
  fleet's mean so far: the figure the report's max/mean load reads at the end) and
  ``reusable_all_tokens`` (the longest prefix held anywhere when it arrived);
- the scheduler, through ``Scheduler.on_cycle`` (``cycle_record``, router profiles only):
  ``deciding`` (the scorer with the largest margin over the runner-up, or the tie-break),
  ``runner_up`` (slot), ``dropped`` (slots the filters removed) and, per candidate offered
  (``cands``, slot order): ``w`` (slot), ``vol`` (its routed-volume count over the candidates'
  mean: what ``volume-bound`` bounds), ``gpu`` / ``cpu`` / ``disk`` (its matched prefix in blocks
  per tier), ``ttft`` (the ttft-cost estimate, s) and its terms ``q`` / ``f`` / ``p`` / ``d`` /
  ``i`` (queue, fetch, prefill, displace, in flight), ``score`` (its weighted total; None when
  dropped);
- the driver once the request is done (``served``): ``served`` (prompt tokens from gpu / cpu /
  disk / peer), ``computed`` (the rest) and ``ttft_s`` (simulated).

Off unless asked for: the driver and the policy test one ``None`` per request. ``heaviest``
reads a trace back and says what put the most loaded worker past a bound (the issue-12 ninth
pass); ``python -m benchmarks.replay.decisions FILE`` prints it.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from kvmesh.discovery.keys import WorkerId
from services.router.core.scheduler.plugins import CycleContext
from services.router.core.scheduler.ttft import TtftCostScorer, TtftTerms
from services.router.core.types import RouteDecision
from services.router.core.workers import WorkerView
from services.worker.sim.model import SimResult

from .traces import ReplayRequest


class DecisionTrace:
    """Collects one row per request (module doc); ``write`` saves them as JSON lines."""

    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []

    def _row(self, n: int) -> dict[str, Any]:
        while len(self.rows) <= n:
            self.rows.append({"n": len(self.rows)})
        return self.rows[n]

    def routed(
        self,
        n: int,
        t_s: float,
        request: ReplayRequest,
        worker: int,
        worker_input: Sequence[int],
        reusable_all_tokens: int,
    ) -> None:
        """Request ``n`` goes to ``worker``; ``worker_input``: tokens per worker before it."""
        mean = sum(worker_input) / len(worker_input)
        self._row(n).update(
            t_s=round(t_s, 3),
            input_tokens=request.input_tokens,
            session=request.session_id,
            worker=worker,
            load_before=round(worker_input[worker] / mean, 4) if mean else 0.0,
            reusable_all_tokens=reusable_all_tokens,
        )

    def decided(self, n: int, record: Mapping[str, Any]) -> None:
        self._row(n).update(record)

    def served(self, r: SimResult, tiers: tuple[int, int, int, int], arrival_s: float) -> None:
        gpu, cpu, disk, peer = tiers
        row = self._row(int(r.request_id))
        row["served"] = {"gpu": gpu, "cpu": cpu, "disk": disk, "peer": peer}
        row["computed"] = max(r.prompt_tokens - r.cached_tokens, 0)
        if r.first_token_s is not None:
            row["ttft_s"] = round(r.first_token_s - arrival_s, 4)

    def write(self, path: str | Path) -> None:
        with open(path, "w", encoding="utf-8") as f:
            for row in self.rows:
                f.write(json.dumps(row, separators=(",", ":")) + "\n")


def cycle_record(
    ctx: CycleContext,
    offered: Sequence[WorkerView],
    decision: RouteDecision,
    slot: Mapping[WorkerId, int],
) -> dict[str, Any]:
    """What a scheduling cycle saw, per candidate offered (module doc). Called from
    ``Scheduler.on_cycle``: before ``on_routed``, so the counts are the decision's. The cost
    terms are the profile's cost source's estimate over every offered candidate again (its
    prefix match and measured rates are the cycle's: the same figures, term by term; those the
    filters dropped before any estimate are matched and estimated here)."""
    e = decision.explanation
    ids = [v.record.worker_id for v in offered]
    eligible = set(e.worker_ids) if e is not None else set(ids)
    totals: dict[str, float] = {}
    if e is not None and e.columns:
        for k, wid in enumerate(e.worker_ids):
            totals[wid] = sum(col[k] for col in e.columns)
    vs = ctx.volume_source
    vols = [vs.routed_volume(w) for w in ids] if vs is not None else []
    mean = sum(vols) / len(vols) if vols else 0.0
    if len(eligible) < len(ids) and not (ctx.costs and all(w in ctx.costs[1] for w in ids)):
        # The filters dropped candidates before anything matched or estimated them: the cycle's
        # memos cover the eligible ones only. A context of its own over every one offered (an
        # index match is read only; the rates' reports are the cycle's).
        ctx = CycleContext(
            ctx.request,
            offered,
            ctx.ledger,
            ctx.prefix_source,
            ctx.volume_source,
            ctx.cost_source,
        )
    terms: list[TtftTerms] = []
    src = ctx.cost_source
    if isinstance(src, TtftCostScorer):
        src.estimate(ctx, offered, terms)
    matches = ctx.prefix()
    cands = []
    for k, wid in enumerate(ids):
        c: dict[str, Any] = {"w": slot[wid]}
        if vols:
            c["vol"] = round(vols[k] / mean, 4) if mean else 0.0
        m = matches.get(wid)
        c["gpu"], c["cpu"], c["disk"] = (
            (m.gpu_blocks, m.cpu_blocks, m.disk_blocks) if m is not None else (0, 0, 0)
        )
        if terms:
            t = terms[k]
            c["q"], c["f"], c["p"], c["d"], c["i"] = (
                round(x, 4)
                for x in (t.queue_s, t.fetch_s, t.prefill_s, t.displace_s, t.in_flight_s)
            )
            c["ttft"] = round(t.queue_s + t.fetch_s + t.prefill_s + t.displace_s + t.in_flight_s, 4)
        c["score"] = round(totals[wid], 4) if wid in totals else None
        cands.append(c)
    return {
        "deciding": decision.reason,
        "runner_up": slot[e.runner_up] if e is not None and e.runner_up is not None else None,
        "dropped": [slot[w] for w in ids if w not in eligible],
        "cands": cands,
    }


def read(path: str | Path) -> list[dict[str, Any]]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def heaviest(
    rows: Sequence[Mapping[str, Any]], bound: float = 1.1, workers: int | None = None
) -> dict[str, Any]:
    """The most loaded worker of a trace (whole-run input tokens, as the report's max/mean
    load) and the requests routed to it while its running share was already past ``bound``
    x the fleet's running mean: each one's size, why it went there (deciding scorer, its
    routed-volume count against the bound, the prefix it held) and the best other
    candidate's estimate and prefix (what a move would have cost and lost)."""
    n_workers = workers or 1 + max(r["worker"] for r in rows)
    totals = [0] * n_workers
    for r in rows:
        totals[r["worker"]] += r["input_tokens"]
    mean = sum(totals) / n_workers
    top = max(range(n_workers), key=lambda w: totals[w])
    past: list[dict[str, Any]] = []
    trajectory = []
    running = [0] * n_workers
    step = max(len(rows) // 10, 1)
    for k, r in enumerate(rows):
        w = r["worker"]
        before = running[w]
        run_mean = sum(running) / n_workers
        if w == top and run_mean > 0 and before > bound * run_mean:
            past.append(_why(r, top))
        running[w] += r["input_tokens"]
        if (k + 1) % step == 0 or k + 1 == len(rows):
            m = sum(running) / n_workers
            trajectory.append((k + 1, round(running[top] / m, 3) if m else 0.0))
    return {
        "worker": top,
        "load": totals[top] / mean if mean else 0.0,
        "excess_tokens": totals[top] - bound * mean,
        "requests": sum(1 for r in rows if r["worker"] == top),
        "trajectory": trajectory,
        "past_bound": past,
    }


def _why(r: Mapping[str, Any], top: int) -> dict[str, Any]:
    """One request placed on ``top`` while past the bound: its figures and the best other."""
    cands = {c["w"]: c for c in r.get("cands", ())}
    me = cands.get(top, {})
    others = [c for w, c in cands.items() if w != top and "ttft" in c]
    alt = min(others, key=lambda c: c["ttft"], default=None)
    out: dict[str, Any] = {
        "n": r["n"],
        "t_s": r["t_s"],
        "input_tokens": r["input_tokens"],
        "load_before": r["load_before"],
        "deciding": r.get("deciding"),
        "vol": me.get("vol"),
        "gpu_blocks": me.get("gpu"),
        "cpu_blocks": me.get("cpu"),
        "ttft": me.get("ttft"),
        "served": r.get("served"),
        "computed": r.get("computed"),
    }
    if alt is not None:
        out["alt"] = {
            "w": alt["w"],
            "vol": alt.get("vol"),
            "gpu_blocks": alt["gpu"],
            "cpu_blocks": alt["cpu"],
            "ttft": alt["ttft"],
        }
    return out


def summary_lines(result: Mapping[str, Any], block_size: int = 16) -> Iterable[str]:
    """``heaviest``'s answer as text lines."""
    yield (
        f"heaviest worker {result['worker']}: load {result['load']:.3f}, "
        f"{result['requests']} requests, excess over the bound {result['excess_tokens']:.0f} "
        "tokens"
    )
    yield "running share by request count: " + ", ".join(
        f"{n}:{x}" for n, x in result["trajectory"]
    )
    past = result["past_bound"]
    yield f"{len(past)} requests placed while past the bound ({sum(p['input_tokens'] for p in past)} tokens):"
    for p in past:
        alt = p.get("alt") or {}
        yield (
            f"  n={p['n']} t={p['t_s']:.0f}s in={p['input_tokens']} load={p['load_before']:.3f} "
            f"by={p['deciding']} vol={p['vol']} gpu={p['gpu_blocks']} cpu={p['cpu_blocks']} "
            f"ttft={p['ttft']} served={p['served']} | best other w={alt.get('w')} "
            f"vol={alt.get('vol')} gpu={alt.get('gpu_blocks')} cpu={alt.get('cpu_blocks')} "
            f"ttft={alt.get('ttft')}"
        )


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="What put a replay's heaviest worker past a bound")
    p.add_argument("trace", nargs="+", help="--trace-decisions JSONL files")
    p.add_argument("--bound", type=float, default=1.1, help="max/mean share (default 1.1)")
    a = p.parse_args(argv)
    for path in a.trace:
        print(f"== {path}")
        for line in summary_lines(heaviest(read(path), a.bound)):
            print(line)


if __name__ == "__main__":
    main()
