"""The worker's vLLM stat loggers: its own sink, and no Prometheus logger of vLLM's filling a
registry nobody serves (unless asked for with ``vllm_prometheus``)."""

from __future__ import annotations

import prometheus_client
from vllm.v1.metrics.loggers import PrometheusStatLogger, StatLoggerManager
from vllm.v1.metrics.stats import IterationStats, SchedulerStats

from services.worker.config import EngineConfig
from services.worker.stats import StatsSink, stat_loggers


def manager(vllm_prometheus: bool, sink: StatsSink) -> StatLoggerManager:
    return StatLoggerManager(
        vllm_config=object(),  # type: ignore[arg-type]  # read only by vLLM's own loggers
        custom_stat_loggers=stat_loggers(lambda _config, _index=0: sink, vllm_prometheus),
        enable_default_loggers=False,
    )


def test_by_default_vllm_adds_no_prometheus_logger_and_the_sink_still_records() -> None:
    assert EngineConfig().vllm_prometheus is False
    sink = StatsSink()
    m = manager(False, sink)
    real = [
        lg
        for lg in m.stat_loggers
        if isinstance(lg, PrometheusStatLogger) and type(lg) is PrometheusStatLogger
    ]
    assert real == []
    before = prometheus_client.REGISTRY.get_sample_value("vllm:generation_tokens_total")
    it = IterationStats()
    it.num_generation_tokens = 5
    m.record(SchedulerStats(), it)
    assert sink.generation_tokens == 5
    assert sink.updates == 1
    assert prometheus_client.REGISTRY.get_sample_value("vllm:generation_tokens_total") == before


def test_asked_for_vllm_keeps_its_own_prometheus_logger() -> None:
    assert len(stat_loggers(lambda _c, _i=0: StatsSink(), True)) == 1  # vLLM then adds its own
