"""The router's Prometheus metrics: requests by status, routing decisions by profile and the
plugin that decided, predicted vs served cache hits, time to first token, inter-token latency,
and the state of every worker's KV event stream.

Counters and histograms are updated on the event loop by the servicer; the KV stream and index
gauges are refreshed on the loop by ``refresh_kv`` (the HTTP thread never reads live router
state, which the loop mutates).
"""

from __future__ import annotations

import time
from collections.abc import Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kvmesh.discovery.keys import WorkerId
from kvmesh.metrics import DECISION_BUCKETS_S, ITL_BUCKETS_S, TTFT_BUCKETS_S

from .core.index import KvIndex
from .core.index_types import ViewState
from .core.types import RouteDecision
from .kvsync import KvStreamStats


class RouterMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = r = registry or CollectorRegistry()
        self.requests = Counter(
            "kvmesh_router_requests",
            "Generate calls ended, by model and gRPC status code (OK, INVALID_ARGUMENT, ...).",
            ["model", "code"],
            registry=r,
        )
        self.decisions = Counter(
            "kvmesh_router_routing_decisions",
            "Scheduling decisions by profile and reason: the scorer whose weighted margin over "
            "the runner-up was largest, or tie-break / only-candidate / the picker's name.",
            ["profile", "reason"],
            registry=r,
        )
        self.decision_seconds = Histogram(
            "kvmesh_router_routing_decision_seconds",
            "Time one scheduling decision took (filters, scorers, picker; index lookup included).",
            ["profile"],
            buckets=DECISION_BUCKETS_S,
            registry=r,
        )
        self.retries = Counter(
            "kvmesh_router_retries",
            "Requests sent to another worker after one was unavailable before the first token.",
            registry=r,
        )
        self.prompt_tokens = Counter(
            "kvmesh_router_prompt_tokens", "Prompt tokens routed.", ["model"], registry=r
        )
        self.predicted_cached_tokens = Counter(
            "kvmesh_router_predicted_cached_tokens",
            "Prompt tokens the chosen worker held per the KV index when it was picked.",
            ["model"],
            registry=r,
        )
        self.cached_tokens = Counter(
            "kvmesh_router_cached_prompt_tokens",
            "Prompt tokens the workers reported served from cache (usage.cached_prompt_tokens).",
            ["model"],
            registry=r,
        )
        self.ttft_seconds = Histogram(
            "kvmesh_router_time_to_first_token_seconds",
            "From the request's arrival at the router to its first output token.",
            ["model"],
            buckets=TTFT_BUCKETS_S,
            registry=r,
        )
        self.itl_seconds = Histogram(
            "kvmesh_router_inter_token_latency_seconds",
            "Time between consecutive streamed output messages after the first, per token.",
            ["model"],
            buckets=ITL_BUCKETS_S,
            registry=r,
        )
        self.in_flight = Gauge(
            "kvmesh_router_in_flight_requests", "Generate calls in progress.", registry=r
        )
        self.kv_index_blocks = Gauge(
            "kvmesh_router_kv_index_blocks", "Distinct block hashes in the KV index.", registry=r
        )
        self.kv_stream_live = Gauge(
            "kvmesh_router_kv_stream_live",
            "1 while the worker's KV event stream is open and caught up, else 0.",
            ["worker"],
            registry=r,
        )
        self.kv_view_exact = Gauge(
            "kvmesh_router_kv_view_exact",
            "1 while the index's view of the worker is exact; 0 when degraded (gap, restart, "
            "lost stream) until it resyncs.",
            ["worker"],
            registry=r,
        )
        self.kv_event_age_seconds = Gauge(
            "kvmesh_router_kv_event_age_seconds",
            "Seconds since the worker's last KV event batch arrived (-1: none yet).",
            ["worker"],
            registry=r,
        )
        self.kv_event_batches = Gauge(
            "kvmesh_router_kv_event_batches",
            "KV event batches received from the worker since its stream was opened (snapshots "
            "included).",
            ["worker"],
            registry=r,
        )
        self.kv_resyncs = Gauge(
            "kvmesh_router_kv_event_resyncs",
            "Snapshots asked of the worker because a batch could not be applied (gap, restart).",
            ["worker"],
            registry=r,
        )
        self._kv_workers: set[WorkerId] = set()

    # ---- per request (on the loop) --------------------------------------------------------
    def decided(self, decision: RouteDecision, seconds: float) -> None:
        self.decisions.labels(decision.policy, decision.reason).inc()
        self.decision_seconds.labels(decision.policy).observe(seconds)

    def routed(self, model: str, prompt_tokens: int, predicted_cached_tokens: int) -> None:
        self.prompt_tokens.labels(model).inc(prompt_tokens)
        if predicted_cached_tokens > 0:
            self.predicted_cached_tokens.labels(model).inc(predicted_cached_tokens)

    def ended(self, model: str, code: str) -> None:
        self.requests.labels(model or "unknown", code).inc()

    # ---- KV streams (on the loop, every few seconds) --------------------------------------
    def refresh_kv(self, streams: Mapping[WorkerId, KvStreamStats], index: KvIndex) -> None:
        now = time.monotonic()
        self.kv_index_blocks.set(index.block_count)
        for wid in self._kv_workers - streams.keys():
            for g in (
                self.kv_stream_live,
                self.kv_view_exact,
                self.kv_event_age_seconds,
                self.kv_event_batches,
                self.kv_resyncs,
            ):
                g.remove(wid)
        self._kv_workers = set(streams)
        for wid, s in streams.items():
            self.kv_stream_live.labels(wid).set(1.0 if s.live else 0.0)
            self.kv_view_exact.labels(wid).set(
                1.0 if index.view(wid).state is ViewState.EXACT else 0.0
            )
            self.kv_event_age_seconds.labels(wid).set(
                now - s.last_batch_s if s.last_batch_s else -1.0
            )
            self.kv_event_batches.labels(wid).set(s.batches)
            self.kv_resyncs.labels(wid).set(s.resyncs)
