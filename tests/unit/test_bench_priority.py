"""The priority-mix benchmark's pure parts (benchmarks/priority/workload.py): arrivals,
prompts that share a tenant's prefix, the per-tenant summary and Jain's index."""

from __future__ import annotations

import math

import pytest

from benchmarks.priority.workload import (
    AFTER_WAIT,
    ARRIVAL,
    FAILED,
    OK,
    REJECTED,
    Result,
    TenantLoad,
    format_rows,
    jain,
    percentile,
    served_between,
    summarize,
)

LOAD = TenantLoad("batch", 0, 64, 16, 8, rate_per_s=4.0, start_s=1.0, duration_s=2.0)


def test_arrivals_are_steady_over_the_window() -> None:
    assert LOAD.arrivals() == pytest.approx([1.0 + i / 4 for i in range(8)])
    assert TenantLoad("x", 0, 0, 1, 1, rate_per_s=0.0, duration_s=5).arrivals() == []


def test_prompts_share_the_tenants_prefix_and_differ_after_it() -> None:
    a, b = LOAD.prompt(1), LOAD.prompt(2)
    assert len(a) == len(b) == 80
    assert a[:64] == b[:64] and a[64:] != b[64:]
    assert LOAD.prompt(1) == a  # deterministic
    other = TenantLoad("flood", 0, 64, 16, 8, 1.0).prompt(1)
    assert other[:64] != a[:64]


def test_a_real_models_prompts_stay_inside_its_vocabulary() -> None:
    tiny = TenantLoad("batch", 0, 512, 512, 8, 1.0, vocab=1024)
    ids = tiny.prompt(3)
    assert len(ids) == 1024 and max(ids) < 1024 and min(ids) >= 1
    assert max(LOAD.prompt(3)) >= 1024  # the simulator's default draws from a larger one


def test_worker_flags_per_engine() -> None:
    import argparse
    from pathlib import Path

    from benchmarks.priority.cli import engine_args

    sim = argparse.Namespace(engine="simulated", sim_max_running=64, sim_speedup=0.25)
    assert engine_args(sim, 1) == [
        "--engine=simulated",
        "--sim-max-running=64",
        "--sim-speedup=0.25",
    ]
    real = argparse.Namespace(
        engine="vllm", model_path=Path("/m/tiny"), sim_max_running=64, pin_cpus=True
    )
    flags = engine_args(real, 3)
    assert flags[:4] == [
        "--engine=vllm",
        "--model=/m/tiny",
        "--max-model-len=2048",
        "--max-num-seqs=64",
    ]
    assert flags[4].startswith("--compute-cpus=")
    assert engine_args(argparse.Namespace(**{**vars(real), "pin_cpus": False}), 0)[4:] == []


def test_jain_and_percentile() -> None:
    assert jain([5.0, 5.0]) == 1.0
    assert jain([1.0, 0.0]) == 0.5
    assert math.isnan(jain([]))
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 99) == 4.0


def test_summary_per_tenant() -> None:
    results = [
        Result("a", 0.0, 1.0, OK, 0.1, prompt_tokens=100, cached_tokens=60),
        Result("a", 0.5, 1.5, OK, 0.3, prompt_tokens=100, cached_tokens=0),
        Result("a", 0.6, 0.602, REJECTED, detail=ARRIVAL),
        Result("a", 0.7, 5.0, REJECTED, detail=AFTER_WAIT),
        Result("b", 0.1, 20.0, FAILED, detail="DEADLINE_EXCEEDED"),
    ]
    a, b = summarize("burst", results, window_s=2.0)
    assert (a.tenant, a.sent, a.ok, a.rejected, a.rejected_after_wait) == ("a", 4, 2, 2, 1)
    assert a.uncached_tokens == 140 and a.ok_per_s == 1.0
    assert a.reject_p99_s == pytest.approx(0.002)  # refusals at arrival only
    assert a.ttft_p99_s == pytest.approx(0.3)
    assert (b.failed, b.ok) == (1, 0) and math.isnan(b.ttft_p50_s)
    assert served_between(results, "a", 0.0, 0.5) == 40  # the first answered by 0.1 s
    # Handed to the engine: the second one's first token came at 0.8 s after 0.4 s there.
    slow = Result("a", 0.2, 1.0, OK, 0.6, prompt_tokens=100, engine_queue_s=0.1,
                  engine_prefill_s=0.3)  # fmt: skip
    assert served_between([slow], "a", 0.0, 0.5) == 0
    assert served_between([slow], "a", 0.0, 0.5, handed_off=True) == 100
    table = format_rows([a, b])
    assert "| burst | a | 4 | 2 | 2 (1) | 0 | 100 ms | 300 ms |" in table
