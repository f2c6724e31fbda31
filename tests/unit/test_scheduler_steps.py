"""The work in flight priced as engine step time (scheduler/steps.py) and its place in the
ttft-cost scorer: pure, with known answers."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from services.router.core.scheduler import InFlightLedger
from services.router.core.scheduler.prefix import PreciseParams, PrecisePrefixScorer
from services.router.core.scheduler.steps import StepRates, in_flight_s
from services.router.core.scheduler.ttft import TtftCostScorer, TtftParams
from services.router.core.types import LoadSnapshot
from services.router.core.workers import WorkerView

from .scheduler_fakes import BLOCK, FakeIndex, ctx_for, gpu, request, view


@pytest.mark.parametrize(
    ("name", "args", "want"),
    [
        ("idle", (0, 0, 100, 1e-3, 1e-6, 10, 5.0), 0.0),
        # 2 requests, 1000 context tokens: 0.002 + 0.001 s a step; 25 prefill tokens at 10 a
        # step is 3 steps, plus 5 decode steps
        ("busy", (2, 1000, 25, 1e-3, 1e-6, 10, 5.0), 0.003 * 8),
        # a cached prompt still rides its decode steps
        ("cached", (1, 1000, 0, 0.0, 1e-6, 10, 4.0), 0.001 * 4),
        ("negative counts read as none", (-3, -5, -1, 1e-3, 1e-6, 10, 5.0), 0.0),
    ],
    ids=lambda x: x if isinstance(x, str) else "",
)
def test_in_flight_s(name, args, want):
    assert in_flight_s(*args) == pytest.approx(want)


def test_context_makes_a_worker_cost_more_even_when_nothing_is_left_to_prefill():
    """The hot-prefix worker: everything it runs was cached, yet its steps are long."""
    hot = in_flight_s(6, 600_000, 500, 1e-4, 4e-8, 8192, 256.0)
    cold = in_flight_s(1, 20_000, 20_000, 1e-4, 4e-8, 8192, 256.0)
    assert hot > cold > 0.0


def _report(tokens: int, at_s: float, running: int) -> LoadSnapshot:
    return LoadSnapshot(running_requests=running, generation_tokens=tokens, reported_s=at_s)


def test_step_rates_default_until_enough_samples():
    r = StepRates(1e-4, 4e-8, min_sample_tokens=10, min_samples=3)
    assert r.rates() == (1e-4, 4e-8)
    r.observe("w", _report(0, 1.0, 4), 0)
    r.observe("w", _report(5, 2.0, 4), 0)  # under min_sample_tokens: waits
    assert r.rates() == (1e-4, 4e-8)


def test_step_rates_fit_a_known_step_model():
    """Reports generated from step = 0.006 + 0.0002 n + 5e-8 ctx are fitted back exactly."""
    rng = random.Random(1)
    r = StepRates(1.0, 1.0, min_sample_tokens=1, min_samples=8)
    at = {f"w{i}": 1.0 for i in range(4)}
    tokens = dict.fromkeys(at, 0)
    for wid in at:
        r.observe(wid, _report(0, 1.0, 1), 0)
    for _ in range(60):
        wid = rng.choice(list(at))
        n, ctx = rng.randint(1, 40), rng.randint(0, 400_000)
        step = 0.006 + 0.0002 * n + 5e-8 * ctx
        steps = rng.randint(5, 50)
        at[wid] += step * steps
        tokens[wid] += n * steps  # one token per running request per step
        r.observe(wid, _report(tokens[wid], at[wid], n), ctx)
    seq_s, ctx_s = r.rates()
    assert seq_s == pytest.approx(0.0002, rel=1e-6)
    assert ctx_s == pytest.approx(5e-8, rel=1e-6)


def test_step_rates_separate_the_prefill_chunks_from_the_context():
    """Steps that also carry prefill chunks: the fit gives the prefill its own slope, so the
    context's is the decode's alone."""
    rng = random.Random(2)
    r = StepRates(1.0, 1.0, min_samples=8)
    for _ in range(80):
        n, ctx, pre = rng.randint(1, 40), rng.randint(0, 400_000), rng.randint(0, 50_000)
        r.add_sample(n, ctx, 0.006 + 0.0002 * n + 5e-8 * ctx + 3e-6 * pre, pre)
    assert r.rates() == pytest.approx((0.0002, 5e-8), rel=1e-6)


def test_step_rates_keep_defaults_when_samples_do_not_determine_the_slopes():
    r = StepRates(1e-4, 4e-8, min_samples=2)
    for _ in range(10):  # always the same n and context: no slope can be told
        r.add_sample(4, 1000, 0.01)
    assert r.rates() == (1e-4, 4e-8)


def test_step_rates_restart_and_unknown_times():
    r = StepRates(1e-4, 4e-8, min_sample_tokens=1, min_samples=1)
    r.observe("w", _report(100, 0.0, 2), 0)  # no report time: ignored
    r.observe("w", _report(100, 5.0, 2), 0)
    r.observe("w", _report(10, 6.0, 2), 0)  # counter went back: starts over, no sample
    assert r.rates() == (1e-4, 4e-8)


TOKENS = 8 * BLOCK + 4


def _scorer(params: TtftParams, matches):
    idx = FakeIndex(matches)
    return PrecisePrefixScorer("p", PreciseParams(), idx), TtftCostScorer("t", params, idx)


def test_ttft_cost_counts_the_cached_context_in_flight():
    """Two workers hold the prompt; w0 runs three other requests of 10K cached tokens each, w1
    nothing. Without the in-flight term they tie (nothing to prefill on either); with it w1 is
    cheaper by exactly what w0's steps carry."""
    p = TtftParams(
        prefill_s_per_token=1e-3,
        floor_s=0.01,
        seq_step_s=1e-3,
        context_step_s_per_token=1e-6,
        step_tokens=100,
        decode_steps=10.0,
        learn_step_rates=False,
        in_flight=True,
    )
    ledger = InFlightLedger()
    for i in range(3):
        ledger.routed(f"r{i}", "w0", 10_000, 0)
    cands: list[WorkerView] = [view("w0"), view("w1")]
    matches = {"w0": gpu(8), "w1": gpu(8)}
    source, scorer = _scorer(p, matches)
    ctx = ctx_for(request(8, prompt_tokens=TOKENS), cands, source, ledger)
    got = scorer.estimate(ctx, cands)
    tail = 4 * 1e-3  # the 4 tokens past the 8 cached blocks
    w0_step = 3 * 1e-3 + 30_000 * 1e-6
    assert got == pytest.approx([tail + w0_step * (1 + 10), tail])
    source, off = _scorer(TtftParams(**{**_fields(p), "in_flight": False}), matches)
    ctx = ctx_for(request(8, prompt_tokens=TOKENS), cands, source, ledger)
    assert off.estimate(ctx, cands) == pytest.approx([tail, tail])


def _fields(p: TtftParams) -> dict:
    return {k: getattr(p, k) for k in p.__dataclass_fields__}


def test_ttft_cost_counts_requests_the_worker_reports():
    """Another router's requests show up only in the worker's report: counted by request."""
    p = TtftParams(
        floor_s=0.01, seq_step_s=1e-3, context_step_s_per_token=0.0, decode_steps=9.0,
        learn_step_rates=False, in_flight=True,
    )  # fmt: skip
    busy = view("w0", in_flight=50)
    source, scorer = _scorer(p, {})
    cands = [busy, view("w1")]
    ctx = ctx_for(request(8, prompt_tokens=TOKENS), cands, source, InFlightLedger())
    got = scorer.estimate(ctx, cands)
    assert got[0] - got[1] == pytest.approx(50 * 1e-3 * (1 + 9))


@pytest.mark.parametrize(
    "bad",
    [{"seq_step_s": -1.0}, {"context_step_s_per_token": -1e-9}, {"step_tokens": 0},
     {"decode_steps": -1.0}],
)  # fmt: skip
def test_params_rejected(bad):
    from kvmesh.errors import InvalidArgument

    with pytest.raises(InvalidArgument):
        TtftParams(**bad)


def test_decode_steps_learned_from_output_per_finished_request():
    r = StepRates(1e-4, 4e-8, decode_steps=256.0, min_finished=4)
    r.observe("w0", _report(1000, 0.0, 2), 0)  # the first report only sets the counter
    r.observe("w1", _report(0, 0.0, 2), 0)
    for _ in range(3):
        r.finished()
    assert r.decode_steps() == 256.0  # fewer than min_finished so far
    r.observe("w0", _report(1300, 0.0, 2), 0)
    r.observe("w1", _report(100, 0.0, 2), 0)
    r.finished()
    assert r.decode_steps() == pytest.approx(400 / 4)
    r.observe("w0", _report(1500, 0.0, 2), 0)
    for _ in range(4):
        r.finished()
    assert r.decode_steps() == pytest.approx(100 + 0.125 * (50 - 100))


def test_ttft_cost_learns_its_step_rates_from_the_reports_it_scores_with():
    """Cycles over workers whose reports say step = 0.004 + 0.001 n + 2e-7 ctx: the scorer's
    fitted rates come from those reports and the ledger's context, not the configured ones."""
    p = TtftParams(in_flight=True, seq_step_s=1.0, context_step_s_per_token=1.0)
    source, scorer = _scorer(p, {})
    rng = random.Random(3)
    state = {f"w{i}": [0, 1.0] for i in range(3)}  # generation tokens, report time
    for cycle in range(60):
        ledger = InFlightLedger()
        cands = []
        for wid, st in state.items():
            n, ctx = rng.randint(1, 30), rng.randint(1, 200) * 1000
            for k in range(n):
                ledger.routed(f"{wid}-{cycle}-{k}", wid, ctx // n, 0)
            steps = 40
            st[0] += n * steps
            st[1] += steps * (0.004 + 0.001 * n + 2e-7 * (ctx // n) * n)
            v = view(wid, running=n)
            v.load = replace(v.load, generation_tokens=st[0], reported_s=st[1])
            cands.append(v)
        scorer.estimate(ctx_for(request(8, prompt_tokens=TOKENS), cands, source, ledger), cands)
    seq_s, ctx_s = scorer.steps.rates()
    assert seq_s == pytest.approx(0.001, rel=0.05)
    assert ctx_s == pytest.approx(2e-7, rel=0.05)


def _timed(
    decode_tokens: int, decode_s: float, running: int, tokens: int = 0, at_s: float = 0.0
) -> LoadSnapshot:
    return LoadSnapshot(
        running_requests=running, generation_tokens=tokens, reported_s=at_s,
        decode_tokens=decode_tokens, decode_s=decode_s,
    )  # fmt: skip


def _fit_windows(timed: bool) -> tuple[float, float] | None:
    """Windows of a worker's life where ``n`` requests decode and ``m`` more are prefilling
    (vLLM counts both as running; the prefilling ones emit nothing), with idle gaps between
    bursts, and a step time of 0.006 + 0.0002 (n + m) + 5e-8 ctx. Reported with the engine's
    decode timing (``timed``) or with output tokens and report times only."""
    rng = random.Random(4)
    r = StepRates(1.0, 1.0, min_sample_tokens=1, min_samples=8)
    gen = dec = 0
    dec_s, at = 0.0, 1.0
    r.observe("w", _timed(1, 0.0, 1, 0, at) if timed else _report(0, at, 1), 0)
    for _ in range(80):
        n, m = rng.randint(1, 30), rng.randint(0, 30)
        ctx = rng.randint(0, 400_000) + 40_000 * m  # prefilling prompts are long ones
        step = 0.006 + 0.0002 * (n + m) + 5e-8 * ctx
        steps = rng.randint(5, 50)
        gen += n * steps
        dec += n * steps
        dec_s += n * steps * step  # each decoded token took one step
        at += steps * step + rng.uniform(0.0, 2.0)  # and the engine sat idle a while
        load = _timed(1 + dec, dec_s, n + m, gen, at) if timed else _report(gen, at, n + m)
        r.observe("w", load, ctx)
    return None if r.rates() == (1.0, 1.0) else r.rates()


def test_engine_decode_timing_fits_what_output_over_wall_time_cannot():
    """The engine's per-request decode timing gives the true step time; output over the time
    between reports counts the prefilling requests as decoding and the idle gaps as steps, so
    the old source's slopes are far off (or undetermined) on the same worker's life."""
    assert _fit_windows(timed=True) == pytest.approx((0.0002, 5e-8), rel=1e-6)
    old = _fit_windows(timed=False)
    assert old is None or not (
        old[0] == pytest.approx(0.0002, rel=0.5) and old[1] == pytest.approx(5e-8, rel=0.5)
    )


def test_engine_timed_samples_take_the_mean_of_the_window_and_start_over_on_restart():
    seen: list[tuple[float, float, float, float]] = []

    class Rec(StepRates):
        def add_sample(self, requests, context_tokens, step_s, prefill_tokens=0.0):
            seen.append((requests, context_tokens, step_s, prefill_tokens))

    r = Rec(1e-4, 4e-8, min_sample_tokens=100)
    r.observe("w", _timed(50, 1.0, 2), 0)  # the first report sets the counters
    r.observe("w", _timed(90, 1.2, 2), 10_000, 300)  # 40 tokens: waits for more
    r.observe("w", _timed(170, 1.6, 6), 30_000, 100)  # 120 since the first: one sample
    assert seen == [(4.0, 20_000.0, pytest.approx(0.6 / 120), 200.0)]
    r.observe("w", _timed(20, 0.1, 2), 0)  # the counter went back: its engine restarted
    r.observe("w", _timed(200, 0.1, 2), 0)  # no decode time over 180 tokens: no sample
    r.observe("w", _timed(400, 1.1, 3), 0)
    assert len(seen) == 2 and seen[1][2] == pytest.approx(1.0 / 200)
    assert r.timed_samples == 2


def test_the_first_engine_timed_report_starts_the_fit_over_and_the_sources_are_not_mixed():
    r = StepRates(1e-4, 4e-8, min_sample_tokens=1, min_samples=1)
    for i in range(5):  # output over wall time while no engine has finished a request
        r.add_sample(1 + i, 1000 * i, 0.01 + 0.001 * i)
    assert r.samples == 5
    r.observe("w0", _timed(10, 0.1, 2), 0)  # the first decode timing: older samples go
    assert r.samples == 0 and r.rates() == (1e-4, 4e-8)
    r.observe("w1", _report(0, 1.0, 2), 0)  # a worker without it: no samples now
    r.observe("w1", _report(500, 2.0, 2), 0)
    assert r.samples == 0
    r.observe("w0", _timed(30, 0.3, 2), 500)
    assert r.samples == 1 and r.timed_samples == 1
