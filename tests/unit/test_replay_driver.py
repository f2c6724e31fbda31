"""The replay driver: metric definitions on a hand-built trace with known answers, KV events in
order, and the baselines' behaviour on generated sessions."""

from __future__ import annotations

import pytest

from benchmarks.replay.agentic import AgenticConfig, agentic_sessions
from benchmarks.replay.driver import ClusterView, format_table, replay
from benchmarks.replay.policies import (
    LeastLoaded,
    OracleLeastWork,
    OracleLongestPrefix,
    RoundRobin,
)
from benchmarks.replay.traces import ReplayRequest
from kvmesh.kv.events import BlockHash, BlockRemoved, BlockStored
from services.worker.sim.model import SimWorkerConfig

CFG = SimWorkerConfig(
    capacity_blocks=64,
    block_size=4,
    step_s=0.0,
    decode_s_per_seq=0.0,
    decode_s_per_context_token=0.0,
    prefill_s_per_token=1e-3,
    attention_s_per_token_pair=0.0,
)


def r(t: float, blocks: tuple[int, ...], tokens: int) -> ReplayRequest:
    return ReplayRequest(t, "", tuple(BlockHash(b) for b in blocks), tokens, 1)


HAND = [
    r(0, (1, 2, 3), 13),
    r(10, (1, 2, 3), 13),  # cached on the first worker only
    r(20, (1, 2, 3, 4), 17),  # its first 3 blocks are everywhere by now
    r(30, (7, 8), 9),  # new
]


def test_metrics_on_a_hand_built_trace_round_robin():
    rep = replay(HAND, RoundRobin(), workers=2, config=CFG)
    assert rep.requests == 4 and rep.input_tokens == 52
    assert rep.cached_tokens == 12  # only the third request, back on worker 0
    assert rep.reusable_tokens == 24  # second: 12 on worker 0; third: 12 on both
    assert rep.reusable_captured_tokens == 12
    assert rep.ceiling_tokens == 24
    assert rep.worker_input_tokens == (30, 22)
    assert rep.load_balance == pytest.approx(30 / 26)
    # computed: worker 0 13 + 5 (the third's 12 cached), worker 1 13 + 9
    assert rep.worker_computed_tokens == (18, 22)
    assert rep.computed_balance == pytest.approx(22 / 20)
    assert rep.ttft_p50_s == pytest.approx(0.009)  # of 13, 13, 5 and 9 uncached tokens
    assert rep.ttft_p99_s == pytest.approx(0.013)
    assert rep.ttft_mean_s == pytest.approx(0.010)
    assert rep.capture_rate == pytest.approx(0.5) and rep.policy == "round-robin"


def test_metrics_on_a_hand_built_trace_oracle():
    rep = replay(HAND, OracleLongestPrefix(), workers=2, config=CFG)
    assert (rep.cached_tokens, rep.reusable_tokens, rep.reusable_captured_tokens) == (24, 24, 24)
    assert rep.worker_input_tokens == (52, 0)  # ties go to the least loaded, then the first
    assert rep.load_balance == pytest.approx(2.0)
    assert rep.virtual_s == pytest.approx(30.009)


def test_kv_events_arrive_in_order_and_describe_each_cache():
    held: dict[int, set[BlockHash]] = {0: set(), 1: set()}
    fleet = []

    def on_events(i, events):
        for e in events:
            if isinstance(e, BlockStored):
                held[i].update(e.block_hashes)
            elif isinstance(e, BlockRemoved):
                held[i].difference_update(e.block_hashes)

    def route(req: ReplayRequest, view: ClusterView) -> int:
        fleet[:] = view.workers
        for i, w in enumerate(view.workers):  # the events said what is cached, up to now
            assert held[i] == w.cached_blocks()
        return int(req.arrival_s) % 2

    small = SimWorkerConfig(capacity_blocks=6, block_size=4, step_s=0.001)
    trace = [r(0.5 * i, (i % 3 * 10 + 1, i % 3 * 10 + 2, i), 13) for i in range(1, 20)]
    replay(trace, route, workers=2, config=small, on_kv_events=on_events)
    assert all(held[i] == w.cached_blocks() for i, w in enumerate(fleet))


def test_bad_policies_and_unordered_traces_are_refused():
    with pytest.raises(ValueError, match="chose worker 5"):
        replay(HAND, lambda req, view: 5, workers=2, config=CFG)
    with pytest.raises(ValueError, match="arrival order"):
        replay(list(reversed(HAND)), RoundRobin(), workers=2, config=CFG)


def test_pacing_follows_the_wall_clock():
    rep = replay(HAND, RoundRobin(), workers=2, config=CFG, pace=1000.0)  # 30 s in 30 ms
    assert rep.wall_s >= 0.03


SESSIONS = AgenticConfig(
    sessions=12,
    start_window_s=120.0,
    system_prompt_tokens=2_000,
    first_prompt_tokens=(2_000, 6_000),
    window_tokens=32_000,
    early_end_tokens=(16_000, 32_000),
    burst_probability=0.2,
)


@pytest.fixture(scope="module")
def sessions():
    return list(agentic_sessions(SESSIONS))


def test_the_oracle_captures_what_round_robin_misses(sessions):
    cfg = SimWorkerConfig(capacity_blocks=16_384)  # one worker could hold every session
    reports = [
        replay(sessions, policy(), workers=16, config=cfg)
        for policy in (OracleLongestPrefix, OracleLeastWork, RoundRobin, LeastLoaded)
    ]
    oracle, cost, rr, least = reports
    assert oracle.capture_rate >= 0.97 and cost.capture_rate >= 0.95
    assert oracle.hit_rate > 0.95 * oracle.ceiling
    assert rr.capture_rate < 0.5 and rr.hit_rate < 0.5 * oracle.hit_rate
    assert least.capture_rate < 0.8
    assert rr.load_balance < 1.2 < oracle.load_balance  # the oracle ignores load
    assert all(rep.ceiling == oracle.ceiling for rep in reports)  # a property of the trace
    table = format_table(reports)
    assert table.count("\n") == 5 and "oracle-prefix" in table
