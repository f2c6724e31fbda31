"""The worker's vLLM-named metrics (services/worker/vllm_metrics.py) carry vLLM 0.32's own names,
labels and buckets (checked against the installed vLLM's PrometheusStatLogger and bucket
module, not a copy), a request's phases split as vLLM splits them (``Timing.phases``), and the
worker's ``*_total`` metrics are Prometheus counters. No engine is started."""

from __future__ import annotations

import inspect
from dataclasses import astuple

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from vllm.v1.metrics import buckets as vllm_buckets
from vllm.v1.metrics.loggers import PrometheusStatLogger

from kvmesh import metrics as kvmesh_metrics
from services.router.metrics import RouterMetrics
from services.worker.core import EngineLoad, FinishReason, RequestPhases, Timing
from services.worker.metrics import WorkerMetrics
from services.worker.vllm_metrics import VllmMetrics


def families(registry: CollectorRegistry) -> dict[str, tuple[str, list]]:  # type: ignore[type-arg]
    text = generate_latest(registry).decode()
    return {f.name: (f.type, f.samples) for f in text_string_to_metric_families(text)}


@pytest.mark.parametrize(
    ("ours", "theirs"),
    [
        ("VLLM_REQUEST_LATENCY_BUCKETS_S", "REQUEST_LATENCY_BUCKETS"),
        ("VLLM_TTFT_BUCKETS_S", "TIME_TO_FIRST_TOKEN_BUCKETS"),
        ("VLLM_ITL_BUCKETS_S", "INTER_TOKEN_LATENCY_BUCKETS"),
    ],
)
def test_buckets_are_vllms(ours, theirs):
    assert getattr(kvmesh_metrics, ours) == getattr(vllm_buckets, theirs)


BUCKETS_OF = {  # vLLM's bucket family of each histogram (loggers.py)
    "vllm:time_to_first_token_seconds": vllm_buckets.TIME_TO_FIRST_TOKEN_BUCKETS,
    "vllm:inter_token_latency_seconds": vllm_buckets.INTER_TOKEN_LATENCY_BUCKETS,
    "vllm:request_time_per_output_token_seconds": vllm_buckets.INTER_TOKEN_LATENCY_BUCKETS,
    "vllm:e2e_request_latency_seconds": vllm_buckets.REQUEST_LATENCY_BUCKETS,
    "vllm:request_queue_time_seconds": vllm_buckets.REQUEST_LATENCY_BUCKETS,
    "vllm:request_inference_time_seconds": vllm_buckets.REQUEST_LATENCY_BUCKETS,
    "vllm:request_prefill_time_seconds": vllm_buckets.REQUEST_LATENCY_BUCKETS,
    "vllm:request_decode_time_seconds": vllm_buckets.REQUEST_LATENCY_BUCKETS,
}


def test_names_types_labels_and_buckets_are_vllms():
    r = CollectorRegistry()
    m = VllmMetrics(r, "tiny")
    m.refresh(EngineLoad(prefix_cache_queried_tokens=3, prefix_cache_hit_tokens=1))
    source = inspect.getsource(PrometheusStatLogger)
    fams = families(r)
    assert set(BUCKETS_OF) <= set(fams)
    for name, (kind, samples) in fams.items():
        if name.endswith("_created"):  # prometheus_client's creation times (vLLM turns them off)
            continue
        assert f'name="{name}"' in source, f"{name} is not one of vLLM's names"
        assert kind == source_kind(source, name), name
        for s in samples:
            assert s.labels["model_name"] == "tiny" and s.labels["engine"] == "0", (name, s)
        if kind == "histogram":
            bounds = [float(s.labels["le"]) for s in samples if s.name.endswith("_bucket")]
            assert bounds[:-1] == list(BUCKETS_OF[name]), name
    reasons = {s.labels["finished_reason"] for s in fams["vllm:request_success"][1]}
    assert reasons == {"stop", "length", "abort"}  # exported from the start, as vLLM does


def source_kind(source: str, name: str) -> str:
    """gauge / counter / histogram: the class vLLM makes ``name`` with."""
    before = source[: source.index(f'name="{name}"')]
    last = max(("gauge", "counter", "histogram"), key=lambda k: before.rfind(f"_{k}_cls("))
    return last


def test_finished_counts_once_per_request():
    r = CollectorRegistry()
    m = VllmMetrics(r, "tiny")
    t = Timing(arrived_s=10.0, scheduled_s=10.5, first_token_s=11.0, finished_s=13.0)
    m.finished(FinishReason.LENGTH, 7, 5, t)
    m.finished(FinishReason.LENGTH, 3, 1, t)
    m.finished(FinishReason.STOP, 2, 2, None)
    labels = {"model_name": "tiny", "engine": "0"}

    def get(name: str, **extra: str) -> float | None:
        return r.get_sample_value(name, {**labels, **extra})

    assert get("vllm:request_success_total", finished_reason="length") == 2
    assert get("vllm:request_success_total", finished_reason="stop") == 1
    assert get("vllm:request_success_total", finished_reason="abort") == 0
    assert get("vllm:prompt_tokens_total") == 12
    assert get("vllm:e2e_request_latency_seconds_count") == 2  # the untimed one is not
    assert get("vllm:e2e_request_latency_seconds_sum") == pytest.approx(6.0)
    assert get("vllm:request_queue_time_seconds_sum") == pytest.approx(1.0)
    assert get("vllm:request_prefill_time_seconds_sum") == pytest.approx(1.0)
    assert get("vllm:request_decode_time_seconds_sum") == pytest.approx(4.0)
    assert get("vllm:request_inference_time_seconds_sum") == pytest.approx(5.0)
    # decode over the tokens after the first: 2 s / 4, and 0 for a one-token request
    assert get("vllm:request_time_per_output_token_seconds_sum") == pytest.approx(0.5)
    assert get("vllm:request_time_per_output_token_seconds_count") == 2


@pytest.mark.parametrize(
    ("timing", "want"),
    [
        pytest.param(
            Timing(10.0, 10.5, 11.0, 13.0), RequestPhases(3.0, 0.5, 0.5, 2.0), id="all-phases"
        ),
        pytest.param(Timing(10.0, None, None, 12.0), RequestPhases(2.0, 2.0), id="never-scheduled"),
        pytest.param(
            Timing(10.0, 10.5, None, 12.0), RequestPhases(2.0, 0.5, 1.5, 0.0), id="no-token"
        ),
        pytest.param(
            Timing(10.0, 9.9, 11.0, 12.0), RequestPhases(2.0, 0.0, 1.0, 1.0), id="skewed-clock"
        ),
        pytest.param(Timing(10.0), RequestPhases(), id="not-finished"),
    ],
)
def test_phases(timing, want):
    got = timing.phases()
    assert astuple(got) == pytest.approx(astuple(want))
    assert got.e2e_s == pytest.approx(got.queue_s + got.prefill_s + got.decode_s)


def test_worker_totals_are_counters():
    r = CollectorRegistry()
    m = WorkerMetrics(r, model="tiny")
    m.prefix_queried.set(40)
    m.prefix_hits.set(32)
    m.kv_event_cut_off.set(2)
    fams = families(r)
    wrong = {n: k for n, (k, s) in fams.items() if any(x.name.endswith("_total") for x in s)}
    assert wrong and all(k == "counter" for k in wrong.values()), wrong
    assert fams["kvmesh_worker_prefix_cache_hit_tokens"][0] == "counter"
    assert r.get_sample_value("kvmesh_worker_prefix_cache_hit_tokens_total") == 32
    assert r.get_sample_value("kvmesh_worker_kv_event_subscribers_cut_off_total") == 2


def test_router_request_metrics_by_model():
    m = RouterMetrics()
    m.finished("tiny", "length", 4, 2.0, 0.25, (0.5, 0.75, 1.0))
    m.finished("tiny", "stop", 1, 1.0, 0.0, (0.0, 0.5, 0.0))
    r = m.registry

    def get(name: str, **labels: str) -> float | None:
        return r.get_sample_value(name, {"model": "tiny", **labels})

    assert get("kvmesh_router_request_success_total", finished_reason="length") == 1
    assert get("kvmesh_router_request_success_total", finished_reason="stop") == 1
    assert get("kvmesh_router_generation_tokens_total") == 5
    assert get("kvmesh_router_e2e_request_latency_seconds_sum") == pytest.approx(3.0)
    # the router's part before the worker plus the engine's queue
    assert get("kvmesh_router_request_queue_time_seconds_sum") == pytest.approx(0.75)
    assert get("kvmesh_router_request_prefill_time_seconds_sum") == pytest.approx(1.25)
    assert get("kvmesh_router_request_decode_time_seconds_sum") == pytest.approx(1.0)
    le = [
        float(s.labels["le"])
        for s in families(r)["kvmesh_router_e2e_request_latency_seconds"][1]
        if s.name.endswith("_bucket")
    ]
    assert le[:-1] == list(vllm_buckets.REQUEST_LATENCY_BUCKETS)
