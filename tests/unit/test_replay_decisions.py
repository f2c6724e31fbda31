"""Decision traces of a replay (benchmarks/replay/decisions.py): what the driver and the real
scheduler record per request, that tracing changes no decision, and ``heaviest``'s reading of
a trace on a hand-built one with a known answer."""

from __future__ import annotations

import argparse
import json

import pytest

from benchmarks.replay.agentic import AgenticConfig, agentic_sessions
from benchmarks.replay.cli import run, trace_path
from benchmarks.replay.decisions import DecisionTrace, heaviest, read, summary_lines
from benchmarks.replay.driver import replay
from benchmarks.replay.mesh import Link, MeshConfig
from benchmarks.replay.policies import RoundRobin
from benchmarks.replay.router_policy import RouterPolicy
from services.router.core.scheduler.framework import Scheduler
from services.worker.sim.model import SimWorkerConfig

from .test_replay_driver import CFG, HAND

MESH = MeshConfig(workers_per_node=1, cpu_blocks=64, peer=Link(1e-4), peer_min_gain_blocks=1)


def _replay_traced(reqs, policy, trace, workers=2, config=CFG, mesh=MESH):
    """``reqs`` through the real router core ``policy``, its index fed the replay's events."""
    return replay(
        reqs,
        policy,
        workers=workers,
        config=config,
        mesh=mesh,
        on_kv_events=policy.on_kv_events,
        on_tier_events=policy.on_tier_events,
        trace=trace,
    )


def test_the_driver_records_placement_load_and_where_each_prompt_was_served():
    trace = DecisionTrace()
    rep = replay(HAND, RoundRobin(), workers=2, config=CFG, mesh=MESH, trace=trace)
    rows = trace.rows
    assert [r["worker"] for r in rows] == [0, 1, 0, 1]
    assert [r["input_tokens"] for r in rows] == [13, 13, 17, 9]
    # Worker's tokens so far over the fleet's mean so far: 0 (none yet), 0/6.5, 13/13, 13/21.5.
    assert [r["load_before"] for r in rows] == [0.0, 0.0, 1.0, round(13 / 21.5, 4)]
    assert [r["reusable_all_tokens"] for r in rows] == [0, 12, 12, 0]
    # The second fetched its 3 blocks from node 0 (a peer); the third hit its own GPU.
    assert rows[1]["served"] == {"gpu": 0, "cpu": 0, "disk": 0, "peer": 12}
    assert rows[2]["served"] == {"gpu": 12, "cpu": 0, "disk": 0, "peer": 0}
    assert [r["computed"] for r in rows] == [13, 1, 5, 9]
    served = {k: sum(r["served"][k] for r in rows) for k in ("gpu", "cpu", "disk", "peer")}
    assert served == dict(rep.tier_tokens)
    assert rows[1]["ttft_s"] == pytest.approx(0.0022)  # 1.2 ms fetch + 1 ms prefill
    assert "cands" not in rows[0]  # a baseline has no scheduler to trace


def test_the_scheduler_records_each_candidates_cost_terms_prefix_and_volume():
    trace = DecisionTrace()
    policy = RouterPolicy("precise-cost", 2, workers_per_node=1, trace=trace)
    assert isinstance(policy.scheduler, Scheduler) and policy.scheduler.on_cycle is not None
    _replay_traced(HAND, policy, trace)
    for row in trace.rows:
        cands = row["cands"]
        assert [c["w"] for c in cands] == [0, 1] and row["dropped"] == []
        for c in cands:
            terms = c["q"] + c["f"] + c["p"] + c["d"] + c["i"]
            assert c["ttft"] == pytest.approx(terms, abs=1e-3)
        chosen = next(c for c in cands if c["w"] == row["worker"])
        assert chosen["score"] == max(c["score"] for c in cands)  # ties: the picker's choice
        assert row["deciding"]
    second = trace.rows[1]
    holder = trace.rows[0]["worker"]
    other = 1 - holder
    by = {c["w"]: c for c in second["cands"]}
    assert by[holder]["gpu"] == 3 and by[other]["gpu"] == 0
    # 3 blocks are under ttft-cost's 4-block peer minimum: the other would recompute them.
    assert by[holder]["f"] == by[other]["f"] == 0.0
    assert by[holder]["p"] < by[other]["p"] and by[holder]["ttft"] < by[other]["ttft"]
    # The routed-volume count over the candidates' mean: the first request's worker holds it all.
    assert by[holder]["vol"] == pytest.approx(2.0) and by[other]["vol"] == 0.0


PC_CHEAP = """name: pc-cheap
filters: [serving, model, role, {type: volume-bound, params: {move_slack_s: 0.25}}]
scorers:
  - {type: routed-volume, name: bound-volume, weight: 0, params: {half_life_requests: 16000}}
  - {type: ttft-cost, weight: 1.0}
  - {type: precise-prefix, weight: 2.0}
  - {type: routed-volume, weight: 4.5, params: {half_life_requests: 400, yield_to_prefix: 0.3}}
  - {type: active-context, weight: 5.5}
picker: max-score
"""


def test_tracing_changes_no_decision(tmp_path):
    path = tmp_path / "pc-cheap.yaml"
    path.write_text(PC_CHEAP)
    reqs = list(agentic_sessions(AgenticConfig(seed=0, sessions=4, block_size=16)))[:120]
    cfg = SimWorkerConfig(capacity_blocks=16384)
    mesh = MeshConfig(workers_per_node=2, cpu_blocks=32768)

    def run_once(trace: DecisionTrace | None) -> tuple:
        policy = RouterPolicy(str(path), 4, workers_per_node=2, trace=trace)
        rep = _replay_traced(reqs, policy, trace, workers=4, config=cfg, mesh=mesh)
        return rep.worker_input_tokens, rep.cached_all_tokens, rep.ttft_mean_s, policy.reasons

    trace = DecisionTrace()
    assert run_once(None) == run_once(trace)
    rows = trace.rows
    assert len(rows) == 120 and all(len(r["cands"]) == 4 for r in rows)
    # The bound's count over its mean, as the filter read it: the chosen worker's share.
    assert any(c["vol"] > 1.1 for r in rows for c in r["cands"])


def test_the_filters_drops_are_recorded(tmp_path):
    # A hard bound at the mean: after the first request, its worker is past it and dropped.
    path = tmp_path / "bound.yaml"
    path.write_text(
        "name: bound\n"
        "filters: [serving, model, role, {type: volume-bound, params: {max_over_mean: 1.0}}]\n"
        "scorers:\n"
        "  - {type: routed-volume, weight: 1.0}\n"
        "  - {type: ttft-cost, weight: 1.0}\n"
        "  - {type: precise-prefix, weight: 1.0}\n"
        "picker: max-score\n"
    )
    trace = DecisionTrace()
    policy = RouterPolicy(str(path), 2, workers_per_node=1, trace=trace)
    _replay_traced(HAND, policy, trace)
    first, second = trace.rows[:2]
    assert first["dropped"] == []
    assert second["dropped"] == [first["worker"]] and second["worker"] != first["worker"]
    dropped = next(c for c in second["cands"] if c["w"] == first["worker"])
    assert dropped["score"] is None and dropped["gpu"] == 3  # its prefix, turned away
    assert second["deciding"] == "only-candidate"


def test_heaviest_names_the_requests_placed_past_the_bound():
    def row(n, w, tokens, **extra):
        return {"n": n, "t_s": float(n), "input_tokens": tokens, "worker": w, "load_before": 0.0,
                **extra}  # fmt: skip

    rows = [row(0, 0, 10), row(1, 1, 10), row(2, 0, 10), row(3, 1, 2)]
    big = {
        "deciding": "precise-prefix",
        "cands": [
            {"w": 0, "vol": 1.3, "gpu": 5, "cpu": 0, "ttft": 0.2},
            {"w": 1, "vol": 0.7, "gpu": 0, "cpu": 5, "ttft": 0.3},
        ],
    }
    rows.append(row(4, 0, 20, **big))  # worker 0 at 20 of a 16 mean: past 1.1
    got = heaviest(rows, 1.1)
    assert got["worker"] == 0 and got["load"] == pytest.approx(40 / 26)
    assert got["excess_tokens"] == pytest.approx(40 - 1.1 * 26)
    # Request 2 came with worker 0 at 10 against a 10 mean (not past); request 4 at 20 vs 16.
    assert [p["n"] for p in got["past_bound"]] == [4]
    p = got["past_bound"][0]
    assert (p["deciding"], p["vol"], p["gpu_blocks"]) == ("precise-prefix", 1.3, 5)
    assert p["alt"] == {"w": 1, "vol": 0.7, "gpu_blocks": 0, "cpu_blocks": 5, "ttft": 0.3}
    assert got["trajectory"][-1] == (5, round(40 / 26, 3))
    text = "\n".join(summary_lines(got))
    assert "heaviest worker 0" in text and "n=4" in text


def test_the_cli_writes_a_trace_per_policy(tmp_path, capsys):
    assert trace_path("t.jsonl", "precise-cost", 1).name == "t.jsonl"
    assert trace_path("d/t.jsonl", "/x/pc-cheap.yaml", 2).as_posix() == "d/t-pc-cheap.jsonl"
    out = tmp_path / "t.jsonl"
    args = _args(trace_decisions=str(out), policy="precise-cost,round-robin")
    assert run(args) == 0
    rows = read(tmp_path / "t-precise-cost.jsonl")
    assert len(rows) == 40 and all("cands" in r and "served" in r for r in rows)
    assert len(read(tmp_path / "t-round-robin.jsonl")) == 40
    reported = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert sum(reported[0]["worker_input_tokens"]) == sum(r["input_tokens"] for r in rows)
    assert run(_args(trace_decisions=str(out), dp_ranks=2)) == 2  # not traced there


def _args(**over: object) -> argparse.Namespace:
    a = argparse.Namespace(
        trace="agentic", limit=40, sessions=4, seed=0, workers=4, capacity_blocks=16384,
        block_size=16, policy="precise-cost", speed=None, cpu_blocks=32768, disk_blocks=0,
        workers_per_node=2, cpu_s_per_token=1.4e-5, disk_s_per_token=4.15e-5,
        peer_s_per_token=2.2e-5, no_peer_fetch=False, json=True, trace_decisions=None,
        dp_ranks=1, dp_pick="least-loaded", retention_blocks=0,
    )  # fmt: skip
    for k, v in over.items():
        setattr(a, k, v)
    return a
