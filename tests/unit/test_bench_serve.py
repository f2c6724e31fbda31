"""kvmesh bench serve: the loads it asks vLLM's client for, and the table it prints."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from benchmarks.serve.cli import format_table, summarize, target_specs
from benchmarks.serve.grpc_load import Outcome, metrics
from benchmarks.serve.run import Load


@pytest.mark.parametrize("dataset", ["random", "prefix_repetition"])
def test_load_flags_parse_with_vllms_own_parser(dataset):
    from vllm.benchmarks.serve import add_cli_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    load = Load(dataset=dataset, frontend="http", request_rate=4.0, num_prompts=12)
    args = parser.parse_args(load.flags("tiny", Path("/models/tiny")))
    assert (args.dataset_name, args.num_prompts, args.max_concurrency) == (dataset, 12, 8)
    assert args.request_rate == 4.0 and args.ignore_eos and args.served_model_name == "tiny"
    assert args.seed == 0  # http; the grpc run of the same target draws other prompts
    if dataset == "random":
        assert (args.random_input_len, args.random_output_len) == (512, 128)
    else:
        assert args.prefix_repetition_num_prefixes == 10
    inf = parser.parse_args(Load(dataset=dataset, frontend="http").flags("t", Path("/t")))
    assert math.isinf(inf.request_rate)


def _result(target, frontend, rps, ttft, cpu):
    return {
        "target": target,
        "frontend": frontend,
        "load": "random c=8 rate=inf",
        "request_throughput": rps,
        "output_throughput": rps * 128,
        "mean_ttft_ms": ttft,
        "median_ttft_ms": ttft,
        "p99_ttft_ms": ttft,
        "mean_tpot_ms": 10.0,
        "completed": 48,
        "failed": 0,
        "total_output_tokens": 48 * 128,
        "cpu_s": cpu,
    }


def test_summary_takes_medians_over_rounds_and_ratios_to_vllm_over_http():
    results = [
        _result("vllm", "http", 4.0, 100.0, {"vllm-api": 2.0, "engine": 8.0}),
        _result("vllm", "http", 6.0, 80.0, {"vllm-api": 2.0, "engine": 8.0}),
        _result("vllm", "http", 5.0, 90.0, {"vllm-api": 2.0, "engine": 8.0}),
        _result("kvmesh-1", "grpc", 4.5, 99.0, {"router": 0.6144, "worker": 1.0, "engine": 8.0}),
    ]
    rows = {(r["target"], r["frontend"]): r for r in summarize(results)}
    base, mesh = rows["vllm", "http"], rows["kvmesh-1", "grpc"]
    assert base["rounds"] == 3 and base["request_throughput"] == 5.0
    assert mesh["throughput_vs_vllm"] == pytest.approx(0.9)
    assert mesh["ttft_p50_vs_vllm"] == pytest.approx(1.1)
    assert mesh["cpu_us_per_token_router"] == pytest.approx(100.0)  # 0.6144 s / 6144 tokens
    assert mesh["cpu_ms_per_req_worker"] == pytest.approx(1000 / 48)
    table = format_table(summarize(results))
    assert "| kvmesh-1 | grpc | random c=8 rate=inf | 4.50 |" in table and "0.90x" in table


def test_grpc_metrics_are_computed_as_vllm_bench_serve_does():
    ok = Outcome(ok=True, ttft_s=0.1, latency_s=1.1, output_tokens=11, itl_s=[0.1] * 10)
    failed = Outcome(error="UNAVAILABLE: gone")
    m = metrics([ok, ok, failed], duration_s=2.0)
    assert (m["completed"], m["failed"], m["total_output_tokens"]) == (2, 1, 22)
    assert m["request_throughput"] == 1.0 and m["output_throughput"] == 11.0
    assert m["mean_ttft_ms"] == pytest.approx(100.0)
    assert m["mean_tpot_ms"] == pytest.approx(100.0)  # (1.1 - 0.1) / (11 - 1)
    assert m["errors"] == ["UNAVAILABLE: gone"]


def test_targets_are_named_and_unknown_ones_refused():
    specs = target_specs(["vllm", "kvmesh-n-rr"], workers=3, kvmanager_cpu_bytes=0)
    assert [(s.label, s.kind, s.workers, s.policy) for s in specs] == [
        ("vllm", "vllm", 1, ""),
        ("kvmesh-3-rr", "kvmesh", 3, "round-robin"),
    ]
    with pytest.raises(SystemExit, match="unknown"):
        target_specs(["sglang"], 2, 0)


def test_grpc_and_http_runs_draw_different_prompts():
    # Run one after the other on one engine: the same seed would hit the prefix cache.
    assert Load("random", "http").seed != Load("random", "grpc").seed


def test_streams_table_says_what_the_router_added():
    import argparse

    from benchmarks.serve.streams import format_table

    def row(target, ttft50, ttft99, itl50, itl99, cpu_s):
        return {
            "target": target, "completed": 3000, "failed": 0, "peak_concurrent": 3000,
            "ttft_p50_ms": ttft50, "ttft_p99_ms": ttft99, "itl_p50_ms": itl50,
            "itl_p99_ms": itl99, "tokens_per_s": 900.0, "tokens": 24000, "router_cpu_s": cpu_s,
            "per_worker_min": 360 if target == "router" else 375,
            "per_worker_max": 390 if target == "router" else 375,
        }  # fmt: skip

    a = argparse.Namespace(streams=3000, workers=8, prompt_tokens=64, max_tokens=8, policy="")
    table = format_table(
        [row("direct", 100, 200, 10, 20, 0.0), row("router", 103, 209, 11, 22, 2.4)], a
    )
    assert (
        "| router | 3000 | 0 | 3000 | 103.0 / 209.0 | 11.0 / 22.0 | 900 | 100 | 0.80 | 360 / 390 |"
        in table
    )
    assert "router policy (default)" in table
    assert "TTFT p50 +3.0 ms, p99 +9.0 ms; ITL p50 +1.0 ms, p99 +2.0 ms" in table


def test_router_scale_table_medians_and_ratio_to_one_process():
    import argparse

    from benchmarks.serve.router_scale import format_table

    def row(n, rnd, rps, cores, completed=1000):
        return {
            "processes": n, "round": rnd, "steady_requests_per_s": rps, "completed": completed,
            "failed": 0, "ttft_p50_ms": 5.0, "ttft_p99_ms": 20.0,
            "router_cpu_s": sum(cores) * 10, "router_cores": cores,
            "workers_cores": 0.3, "load_cores": 0.4,
        }  # fmt: skip

    a = argparse.Namespace(
        concurrency=256, duration_s=20.0, workers=4, sim_speedup=100.0, prompt_tokens=512,
        max_tokens=4, policy="", rounds=2,
    )  # fmt: skip
    rows = [
        row(1, 0, 300, [0.9]), row(2, 0, 500, [0.8, 0.7]),
        row(1, 1, 320, [0.95]), row(2, 1, 540, [0.8, 0.8]),
    ]  # fmt: skip
    table = format_table(rows, a)
    # medians: 310 and 520 req/s; router CPU per request: 9.25 and 15.5 ms (cores x 10 s / 1000)
    assert "| 1 | 310 | 1.00x | 5.0 / 20.0 | 0 | 9.25 | 0.93 = 0.93 | 0.30 | 0.40 |" in table
    assert (
        "| 2 | 520 | 1.68x | 5.0 / 20.0 | 0 | 15.50 | 0.80 + 0.75 = 1.55 | 0.30 | 0.40 |" in table
    )


def test_process_tree_finds_children():
    import subprocess
    import sys

    from benchmarks.serve.router_scale import process_tree

    parent = subprocess.Popen(
        [sys.executable, "-c", "import subprocess,sys,time; "
         "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(30)']); "
         "print(c.pid, flush=True); time.sleep(30)"],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert parent.stdout is not None
        child = int(parent.stdout.readline())
        assert set(process_tree(parent.pid)) == {parent.pid, child}
    finally:
        for pid in process_tree(parent.pid):
            subprocess.run(["kill", str(pid)], check=False)
        parent.wait()
        parent.stdout.close()
