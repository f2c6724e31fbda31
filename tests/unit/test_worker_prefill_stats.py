"""The engine's measured prefill work reaches the router: vLLM's per-request stats summed by the
worker's stat logger, carried by WorkerLoad fields 8-9, read back into the router's snapshot."""

from __future__ import annotations

import pytest
from vllm.v1.engine import FinishReason
from vllm.v1.metrics.stats import FinishedRequestStats, IterationStats

from services.router.pool import load_from_pb
from services.worker.core import EngineLoad
from services.worker.servicer import load_to_pb
from services.worker.stats import StatsSink


def finished(
    prompt: int, cached: int, prefill_s: float, generated: int = 0, decode_s: float = 0.0
) -> FinishedRequestStats:
    return FinishedRequestStats(
        FinishReason.LENGTH, num_prompt_tokens=prompt, num_cached_tokens=cached,
        prefill_time=prefill_s, num_generation_tokens=generated, decode_time=decode_s,
    )  # fmt: skip


def test_the_stat_logger_sums_computed_tokens_and_prefill_seconds():
    sink = StatsSink()
    it = IterationStats()
    it.finished_requests = [
        finished(1000, 200, 0.4),
        finished(64, 64, 0.01),  # all cached: computed nothing, says nothing of the rate
        finished(500, 0, 0.0),  # no prefill time (aborted before its first token)
    ]
    sink.record(None, it)
    it2 = IterationStats()
    it2.finished_requests = [finished(300, 100, 0.1)]
    sink.record(None, it2)
    assert sink.prefill_tokens == 800 + 200
    assert sink.prefill_s == pytest.approx(0.5)


def test_worker_load_carries_the_prefill_counters_to_the_router():
    load = EngineLoad(running_requests=2, prefill_computed_tokens=12345, prefill_s=1.5)
    snap = load_from_pb(load_to_pb(load, in_flight=3, worker_id="w"))
    assert (snap.prefill_computed_tokens, snap.prefill_s) == (12345, 1.5)
    assert snap.running_requests == 2 and snap.in_flight_requests == 3


def test_the_stat_logger_sums_decode_tokens_and_decode_seconds():
    """vLLM's decode_time runs from a request's first token to its last: the tokens after the
    first are what it covers."""
    sink = StatsSink()
    it = IterationStats()
    it.finished_requests = [
        finished(100, 0, 0.1, generated=65, decode_s=0.64),
        finished(100, 0, 0.1, generated=1, decode_s=0.0),  # one token: nothing decoded
        finished(100, 0, 0.0, generated=0),  # aborted before its first token
        finished(100, 0, 0.1, generated=11, decode_s=0.25),
    ]
    sink.record(None, it)
    assert sink.decode_tokens == 64 + 10
    assert sink.decode_s == pytest.approx(0.89)


def test_worker_load_carries_the_decode_timing_to_the_router():
    load = EngineLoad(decode_tokens=4321, decode_s=12.5)
    snap = load_from_pb(load_to_pb(load, in_flight=0, worker_id="w"))
    assert (snap.decode_tokens, snap.decode_s) == (4321, 12.5)
