"""The router's Prometheus metrics: requests by status (gRPC, and HTTP at the OpenAI front
door), routing decisions by profile and the
plugin that decided, predicted vs served cache hits, time to first token, inter-token latency,
and the state of every worker's KV event stream and of every kvmanager tier event stream (one
per kvmanager and KV layout: a node store in the index).

Counters and histograms are updated on the event loop by the servicer; the KV stream and index
gauges are refreshed on the loop by ``refresh_kv`` (the HTTP thread never reads live router
state, which the loop mutates).
"""

from __future__ import annotations

import time
from collections.abc import Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kvmesh.discovery.keys import WorkerId
from kvmesh.metrics import (
    DECISION_BUCKETS_S,
    ITL_BUCKETS_S,
    TTFT_BUCKETS_S,
    VLLM_REQUEST_LATENCY_BUCKETS_S,
    EtcdGauges,
)

from .core.index import KvIndex
from .core.index_types import HolderId, StoreId, ViewState
from .core.node_stores import TierStream
from .core.types import RouteDecision
from .kvsync import KvStreamStats


class _StreamGauges:
    """The five gauges of a family of KV event streams, by the streams' labels. ``what``: the
    source ("worker"), ``stream``: its stream ("worker's KV event stream")."""

    def __init__(
        self, r: CollectorRegistry, prefix: str, what: str, stream: str, labels: list[str]
    ) -> None:
        self.live = Gauge(
            f"{prefix}_stream_live",
            f"1 while the {stream} is open and caught up, else 0.",
            labels,
            registry=r,
        )
        self.exact = Gauge(
            f"{prefix}_view_exact",
            f"1 while the index's view of the {what} is exact; 0 when degraded (gap, restart, "
            "lost stream) until it resyncs.",
            labels,
            registry=r,
        )
        self.age = Gauge(
            f"{prefix}_event_age_seconds",
            f"Seconds since the last batch of the {stream} arrived (-1: none yet).",
            labels,
            registry=r,
        )
        self.batches = Gauge(
            f"{prefix}_event_batches",
            f"Batches received on the {stream} since it was opened (snapshots included).",
            labels,
            registry=r,
        )
        self.resyncs = Gauge(
            f"{prefix}_event_resyncs",
            f"Snapshots asked of the {what} because a batch could not be applied (gap, restart).",
            labels,
            registry=r,
        )
        self._seen: set[tuple[str, ...]] = set()

    def refresh(
        self, rows: Mapping[tuple[str, ...], tuple[HolderId, KvStreamStats]], index: KvIndex
    ) -> None:
        now = time.monotonic()
        for labels in self._seen - rows.keys():
            for g in (self.live, self.exact, self.age, self.batches, self.resyncs):
                g.remove(*labels)
        self._seen = set(rows)
        for labels, (hid, s) in rows.items():
            self.live.labels(*labels).set(1.0 if s.live else 0.0)
            self.exact.labels(*labels).set(1.0 if index.view(hid).state is ViewState.EXACT else 0.0)
            self.age.labels(*labels).set(now - s.last_batch_s if s.last_batch_s else -1.0)
            self.batches.labels(*labels).set(s.batches)
            self.resyncs.labels(*labels).set(s.resyncs)


class AdmissionMetrics:
    """Flow control's (``--admission``; docs/tenants.md). ``band`` is the request's priority;
    ``tenant`` a key file's tenant name (bounded by the file), ``-`` on an open router (where a
    tenant is whatever a client claims)."""

    def __init__(self, r: CollectorRegistry) -> None:
        labels = ["model", "band", "tenant"]
        self.queue_depth = Gauge(
            "kvmesh_router_admission_queue_depth",
            "Requests waiting in flow control's queues while the workers are saturated, by "
            "model, priority band and tenant (refreshed while requests wait).",
            labels,
            registry=r,
        )
        self.wait_seconds = Histogram(
            "kvmesh_router_admission_wait_seconds",
            "Time requests waited in flow control before they were routed (0: at once).",
            labels,
            buckets=TTFT_BUCKETS_S,
            registry=r,
        )
        self.admitted = Counter(
            "kvmesh_router_admission_admitted",
            "Requests flow control let through, by how: immediate (the fleet had room) or "
            "queued (after a wait).",
            [*labels, "how"],
            registry=r,
        )
        self.rejected = Counter(
            "kvmesh_router_admission_rejected",
            "Requests flow control refused, by reason: queue-full, queue-ttl, predicted-wait, "
            "preempted (while queued, for a higher band), rate-limit, no-worker, deadline, "
            "draining.",
            [*labels, "reason"],
            registry=r,
        )
        self.preempted = Counter(
            "kvmesh_router_admission_preempted",
            "Granted requests that had not started, put back in their queue for a higher band.",
            labels,
            registry=r,
        )
        self.tenant_tokens = Counter(
            "kvmesh_router_tenant_tokens",
            "Tokens served per tenant, by kind: prompt-uncached (prefilled by an engine), "
            "prompt-cached (served from a cache), output.",
            ["model", "tenant", "kind"],
            registry=r,
        )
        self._depth_labels: set[tuple[str, str, str]] = set()

    def refresh_depths(self, depths: Mapping[tuple[str, str, str], int]) -> None:
        for gone in self._depth_labels - depths.keys():
            self.queue_depth.remove(*gone)
        self._depth_labels = set(depths)
        for labels, n in depths.items():
            self.queue_depth.labels(*labels).set(n)


class RouterMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = r = registry or CollectorRegistry()
        self.etcd = EtcdGauges(r, "kvmesh_router", "router")
        self.admission = AdmissionMetrics(r)
        self.requests = Counter(
            "kvmesh_router_requests",
            "Generate calls ended, by model and gRPC status code (OK, INVALID_ARGUMENT, ...).",
            ["model", "code"],
            registry=r,
        )
        self.http_requests = Counter(
            "kvmesh_router_http_requests",
            "OpenAI front door requests ended, by endpoint (route template, or 'other' for no "
            "route) and HTTP status (a stream that fails after its headers counts its 200; "
            "499: the client went away first).",
            ["endpoint", "code"],
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
        self.resumes = Counter(
            "kvmesh_router_resumes",
            "Requests resumed on another worker after theirs failed mid-stream, by model.",
            ["model"],
            registry=r,
        )
        self.resume_recomputed_tokens = Counter(
            "kvmesh_router_resume_recomputed_tokens",
            "Tokens resumed requests computed again on their new worker (prompt plus replayed "
            "tokens not loaded from a cache), by model.",
            ["model"],
            registry=r,
        )
        self.disagg_decisions = Counter(
            "kvmesh_router_disagg_decisions",
            "Prefill/decode decisions by model and reason: 'disaggregated', or why the request "
            "was served on one worker (below-threshold, no-prefill-workers, "
            "no-prefill-candidate, disabled).",
            ["model", "reason"],
            registry=r,
        )
        self.disagg_fallbacks = Counter(
            "kvmesh_router_disagg_fallbacks",
            "Disaggregated requests served aggregated after all (the decode worker recomputed), "
            "by why: prefill-unavailable, prefill-timeout, prefill-failed, prefill-gone, "
            "no-kvmanager.",
            ["model", "reason"],
            registry=r,
        )
        self.prefill_seconds = Histogram(
            "kvmesh_router_prefill_seconds",
            "Duration of the prefill call of a disaggregated request (success or not).",
            ["model"],
            buckets=TTFT_BUCKETS_S,
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
        self.peer_hints = Counter(
            "kvmesh_router_peer_hints",
            "Requests sent to a worker naming another node's kvmanager that holds a longer prefix "
            "of the prompt (the worker's kvmanager may fetch it instead of recomputing).",
            ["model"],
            registry=r,
        )
        self.peer_hints_skipped = Counter(
            "kvmesh_router_peer_hints_skipped",
            "Requests whose worker was not told of another node's kvmanager holding more of the "
            "prompt because fetching from it, at its link's measured speed, is slower than "
            "recomputing (or than a faster peer).",
            ["model"],
            registry=r,
        )
        self.peer_hint_blocks = Counter(
            "kvmesh_router_peer_hint_blocks",
            "Prompt blocks the hinted peers held beyond what the chosen workers held.",
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
        # Per finished request, as vLLM's vllm:e2e_request_latency_seconds, request_success,
        # generation_tokens, request_{queue,prefill,decode}_time_seconds (same buckets) but as
        # the router sees them, by model (docs/status.md).
        self.e2e_seconds = Histogram(
            "kvmesh_router_e2e_request_latency_seconds",
            "From the request's arrival at the router to its last output (finished requests).",
            ["model"],
            buckets=VLLM_REQUEST_LATENCY_BUCKETS_S,
            registry=r,
        )
        self.queue_seconds = Histogram(
            "kvmesh_router_request_queue_time_seconds",
            "From the request's arrival at the router until the serving engine first scheduled "
            "it: tokenizing, routing, retries (and a non-overlapped prefill call) in the router, "
            "then the engine's own queue (usage.queue_time_s).",
            ["model"],
            buckets=VLLM_REQUEST_LATENCY_BUCKETS_S,
            registry=r,
        )
        self.prefill_time_seconds = Histogram(
            "kvmesh_router_request_prefill_time_seconds",
            "The serving engine's prefill phase, first scheduled to first token "
            "(usage.prefill_time_s, as vllm:request_prefill_time_seconds).",
            ["model"],
            buckets=VLLM_REQUEST_LATENCY_BUCKETS_S,
            registry=r,
        )
        self.decode_time_seconds = Histogram(
            "kvmesh_router_request_decode_time_seconds",
            "The serving engine's decode phase, first token to finish "
            "(usage.decode_time_s, as vllm:request_decode_time_seconds).",
            ["model"],
            buckets=VLLM_REQUEST_LATENCY_BUCKETS_S,
            registry=r,
        )
        self.success = Counter(
            "kvmesh_router_request_success",
            "Requests that finished with a final message, by model and finish reason (stop, "
            "length, abort), as vllm:request_success.",
            ["model", "finished_reason"],
            registry=r,
        )
        self.generation_tokens = Counter(
            "kvmesh_router_generation_tokens",
            "Output tokens of finished requests (usage.completion_tokens).",
            ["model"],
            registry=r,
        )
        self.in_flight = Gauge(
            "kvmesh_router_in_flight_requests", "Generate calls in progress.", registry=r
        )
        self.kv_index_blocks = Gauge(
            "kvmesh_router_kv_index_blocks", "Distinct block hashes in the KV index.", registry=r
        )
        self._kv = _StreamGauges(
            r, "kvmesh_router_kv", "worker", "worker's KV event stream", ["worker"]
        )
        self.kv_stream_live = self._kv.live
        self.kv_view_exact = self._kv.exact
        self.kv_event_age_seconds = self._kv.age
        self.kv_event_batches = self._kv.batches
        self.kv_resyncs = self._kv.resyncs
        self._tiers = _StreamGauges(
            r,
            "kvmesh_router_kv_tier",
            "kvmanager's layout (a node store)",
            "kvmanager's tier event stream of the layout",
            ["kvmanager", "layout"],
        )
        self.kv_tier_blocks = Gauge(
            "kvmesh_router_kv_tier_blocks",
            "Blocks the KV index holds for a kvmanager's layout, by tier (cpu, disk).",
            ["kvmanager", "layout", "tier"],
            registry=r,
        )
        self.kv_tier_linked_workers = Gauge(
            "kvmesh_router_kv_tier_linked_workers",
            "Workers whose lower KV tiers are this kvmanager's blocks of this layout.",
            ["kvmanager", "layout"],
            registry=r,
        )
        self._tier_labels: set[tuple[str, ...]] = set()

    # ---- per request (on the loop) --------------------------------------------------------
    def decided(self, decision: RouteDecision, seconds: float) -> None:
        self.decisions.labels(decision.policy, decision.reason).inc()
        self.decision_seconds.labels(decision.policy).observe(seconds)

    def routed(self, model: str, prompt_tokens: int, predicted_cached_tokens: int) -> None:
        self.prompt_tokens.labels(model).inc(prompt_tokens)
        if predicted_cached_tokens > 0:
            self.predicted_cached_tokens.labels(model).inc(predicted_cached_tokens)

    def finished(
        self,
        model: str,
        reason: str,
        completion_tokens: int,
        e2e_s: float,
        before_worker_s: float,
        phases: tuple[float, float, float],
    ) -> None:
        """A request's final message: ``before_worker_s`` the router's time until it called the
        worker that served it, ``phases`` that worker's (queue, prefill, decode) seconds."""
        queue_s, prefill_s, decode_s = phases
        self.success.labels(model, reason).inc()
        self.generation_tokens.labels(model).inc(completion_tokens)
        self.e2e_seconds.labels(model).observe(e2e_s)
        self.queue_seconds.labels(model).observe(before_worker_s + queue_s)
        self.prefill_time_seconds.labels(model).observe(prefill_s)
        self.decode_time_seconds.labels(model).observe(decode_s)

    def ended(self, model: str, code: str) -> None:
        self.requests.labels(model or "unknown", code).inc()

    def http_ended(self, endpoint: str, code: int) -> None:
        self.http_requests.labels(endpoint, str(code)).inc()

    # ---- KV streams (on the loop, every few seconds) --------------------------------------
    def refresh_kv(self, streams: Mapping[WorkerId, KvStreamStats], index: KvIndex) -> None:
        self.kv_index_blocks.set(index.block_count)
        self._kv.refresh({(wid,): (wid, s) for wid, s in streams.items()}, index)

    def refresh_tiers(
        self, streams: Mapping[StoreId, tuple[TierStream, KvStreamStats]], index: KvIndex
    ) -> None:
        rows: dict[tuple[str, ...], tuple[HolderId, KvStreamStats]] = {
            (t.kvmanager_id, t.layout_key): (sid, s) for sid, (t, s) in streams.items()
        }
        self._tiers.refresh(rows, index)
        for labels in self._tier_labels - rows.keys():
            self.kv_tier_linked_workers.remove(*labels)
            for tier in ("cpu", "disk"):
                self.kv_tier_blocks.remove(*labels, tier)
        self._tier_labels = set(rows)
        linked: dict[str, int] = {}
        for sid in index.links().values():
            linked[sid] = linked.get(sid, 0) + 1
        for labels, (hid, _) in rows.items():
            v = index.view(hid)
            self.kv_tier_blocks.labels(*labels, "cpu").set(v.cpu_blocks)
            self.kv_tier_blocks.labels(*labels, "disk").set(v.disk_blocks)
            self.kv_tier_linked_workers.labels(*labels).set(linked.get(hid, 0))
