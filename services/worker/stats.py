"""The worker's vLLM stat loggers (``AsyncLLM(stat_loggers=...)``): ``StatsSink`` keeps the
latest scheduler stats, cumulative prefix-cache, prefill and speculative decoding counters and
the KV connector's load reports for the worker's load stream and /metrics; a stand-in keeps
vLLM from adding a Prometheus logger of its own that nobody serves."""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any

from vllm.v1.metrics.loggers import PrometheusStatLogger, StatLoggerBase
from vllm.v1.metrics.stats import IterationStats, MultiModalCacheStats, SchedulerStats
from vllm.v1.spec_decode.metrics import SpecDecodingStats

from .connector.plan import LOAD_REPORTS_STAT, LoadReport
from .core import SpecDecodeCounts

log = logging.getLogger(__name__)

MAX_LOAD_REPORTS = 65536  # load reports kept for requests not finished yet (oldest dropped)


class _UnexportedPrometheus(PrometheusStatLogger):
    """Takes the place of the Prometheus stat logger vLLM always adds unless given one: that one
    fills vLLM's global registry, which no worker exports (the worker's /metrics serves its own
    registry, vLLM's names included: ``vllm_metrics.py``), at ~10 us of the worker's CPU per
    output token (cProfile of ``kvmesh node`` under ``vllm bench serve``). Records nothing."""

    def __init__(self, vllm_config: object, engine_indexes: list[int] | None = None) -> None:
        self.engine_indexes = engine_indexes or [0]

    def record(self, *args: object, **kwargs: object) -> None:
        pass

    def record_admission_rejection(self, reason: str) -> None:
        pass

    def record_sleep_state(self, sleep: int = 0, level: int = 0) -> None:
        pass

    def log_engine_initialized(self) -> None:
        pass

    def log(self) -> None:
        pass


def stat_loggers(sink_factory: Callable[..., StatLoggerBase], vllm_prometheus: bool) -> list[Any]:
    """The stat logger factories given to AsyncLLM: the worker's sink, and unless
    ``vllm_prometheus`` the stand-in that keeps vLLM from adding its own Prometheus logger."""
    return [sink_factory] if vllm_prometheus else [sink_factory, _UnexportedPrometheus]


class StatsSink(StatLoggerBase):
    """A vLLM stat logger that keeps the latest scheduler stats and cumulative prefix cache
    counters (vLLM's are per-step deltas), and tells listeners after each update. Also keeps the
    KV connector's load reports (request id -> ``LoadReport``) until ``take_report``."""

    def __init__(self) -> None:  # vLLM's factory signature is satisfied by a closure
        self.latest = SchedulerStats()
        self.queried_tokens = 0
        self.hit_tokens = 0
        self.preemptions = 0
        self.prefill_tokens = 0  # prompt tokens computed by finished requests
        self.prefill_s = 0.0  # their prefill times (scheduled -> first token)
        self.generation_tokens = 0  # tokens emitted (per step: 1 + accepted drafts a request)
        self.decode_tokens = 0  # finished requests' tokens after their first
        self.decode_s = 0.0  # their decode times (first token -> last token)
        self.spec = SpecDecodeCounts()  # speculative decoding, summed over steps
        self.updates = 0
        self.listeners: list[Callable[[], None]] = []
        self.load_reports: OrderedDict[str, LoadReport] = OrderedDict()
        self.connector: dict[str, int] = {}  # the KV connector's counters, summed over intervals

    def take_report(self, request_id: str) -> LoadReport | None:
        """The connector's load report of a request, forgotten once taken."""
        return self.load_reports.pop(request_id, None)

    def connector_counts(self) -> tuple[tuple[str, int], ...]:
        return tuple(sorted(self.connector.items()))

    def _add_counts(self, connector_stats: Mapping[str, Any] | None) -> None:
        """The interval's connector counters (vLLM hands each interval's once) into the totals."""
        if not connector_stats:
            return
        totals = self.connector
        for name, n in connector_stats.items():
            if isinstance(n, int) and not isinstance(n, bool) and name != LOAD_REPORTS_STAT:
                totals[name] = totals.get(name, 0) + n

    def _keep_reports(self, connector_stats: Mapping[str, Any] | None) -> None:
        raw = connector_stats.get(LOAD_REPORTS_STAT) if connector_stats else None
        if not isinstance(raw, Mapping):
            return
        reports = self.load_reports
        for rid, value in raw.items():
            report = LoadReport.from_dict(value)
            if report is not None and isinstance(rid, str):
                reports[rid] = report  # a later one (the load failed) replaces the first
                reports.move_to_end(rid)
        while len(reports) > MAX_LOAD_REPORTS:  # requests that never came back for theirs
            reports.popitem(last=False)

    def record(
        self,
        scheduler_stats: SchedulerStats | None,
        iteration_stats: IterationStats | None,
        mm_cache_stats: MultiModalCacheStats | None = None,
        engine_idx: int = 0,
    ) -> None:
        if iteration_stats is not None:  # vLLM's vllm:num_preemptions counts these
            self.preemptions += iteration_stats.num_preempted_reqs
            for f in iteration_stats.finished_requests:  # the engine's own prefill timing
                computed = f.num_prompt_tokens - f.num_cached_tokens
                if computed > 0 and f.prefill_time > 0:
                    self.prefill_tokens += computed
                    self.prefill_s += f.prefill_time
                decoded = f.num_generation_tokens - 1  # the engine's decode timing
                if decoded > 0 and f.decode_time > 0:
                    self.decode_tokens += decoded
                    self.decode_s += f.decode_time
            self.generation_tokens += iteration_stats.num_generation_tokens
        if scheduler_stats is None:
            return
        self.latest = scheduler_stats
        if scheduler_stats.spec_decoding_stats is not None:
            self.spec = _add_spec(self.spec, scheduler_stats.spec_decoding_stats)
        self._keep_reports(scheduler_stats.kv_connector_stats)
        self._add_counts(scheduler_stats.kv_connector_stats)
        pc = scheduler_stats.prefix_cache_stats
        if pc is not None:  # same counting as vLLM's Prometheus counters
            self.queried_tokens += pc.queries
            self.hit_tokens += pc.hits
        self.updates += 1
        for listener in self.listeners:
            try:
                listener()
            except Exception:
                log.exception("load listener failed")

    def log_engine_initialized(self) -> None:
        pass


def _add_spec(total: SpecDecodeCounts, step: SpecDecodingStats) -> SpecDecodeCounts:
    """``total`` plus one step's speculative decoding stats."""
    per_pos = list(total.accepted_per_position)
    step_pos = step.num_accepted_tokens_per_pos
    if len(per_pos) < len(step_pos):
        per_pos += [0] * (len(step_pos) - len(per_pos))
    for i, n in enumerate(step_pos):
        per_pos[i] += n
    return SpecDecodeCounts(
        drafts=total.drafts + step.num_drafts,
        draft_tokens=total.draft_tokens + step.num_draft_tokens,
        accepted_tokens=total.accepted_tokens + step.num_accepted_tokens,
        accepted_per_position=tuple(per_pos),
    )
