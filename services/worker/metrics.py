"""The worker's Prometheus metrics: Generate calls by status, time to first token and
inter-token latency as this worker sees them, tokens served (and served from its local prefix
cache), the engine's load, its KV event stream (sequence, subscribers) and its etcd session.

Counters and histograms are updated on the event loop by the servicer; the gauges are refreshed
on the loop by ``refresh`` every few seconds (the HTTP thread never reads live worker state,
which the loop mutates).
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kvmesh.metrics import ITL_BUCKETS_S, TTFT_BUCKETS_S, EtcdGauges, MirroredCounter

from .core import EngineLoad
from .vllm_metrics import VllmMetrics


@dataclass(frozen=True, slots=True)
class KvEventState:
    """The worker's KV event log and fan-out, as of one refresh."""

    seq: int  # sequence number of the last batch published (0: none yet)
    subscribers: int  # WatchKvEvents streams open
    cut_off: int  # subscribers cut off for falling behind, since start
    gpu_blocks: int  # blocks the engine holds per its events


@dataclass(frozen=True, slots=True)
class EtcdState:
    """The worker's etcd registration, as of one refresh."""

    connected: bool  # the last exchange with etcd (keepalive, update) succeeded
    registered: bool  # a lease is held and the record put under it


class WorkerMetrics:
    """``model``: the served model name, the ``model_name`` label of the vLLM-named metrics
    (``vllm``, services/worker/vllm_metrics.py) beside the worker's own."""

    def __init__(
        self, registry: CollectorRegistry | None = None, model: str = "", spec_positions: int = 0
    ) -> None:
        self.registry = r = registry or CollectorRegistry()
        self.vllm = VllmMetrics(r, model, spec_positions=spec_positions)
        self.requests = Counter(
            "kvmesh_worker_requests",
            "Generate calls ended, by gRPC status code (OK, INVALID_ARGUMENT, CANCELLED, ...).",
            ["code"],
            registry=r,
        )
        self.prompt_tokens = Counter(
            "kvmesh_worker_prompt_tokens", "Prompt tokens of finished requests.", registry=r
        )
        self.cached_tokens = Counter(
            "kvmesh_worker_cached_prompt_tokens",
            "Prompt tokens of finished requests whose KV came from the engine's prefix cache "
            "(local hits, blocks loaded by the KV connector included).",
            registry=r,
        )
        self.cached_tokens_by_tier = Counter(
            "kvmesh_worker_cached_prompt_tokens_by_tier",
            "Cached prompt tokens of finished requests by where their KV came from: gpu (the"
            " engine's own prefix cache), cpu / disk (loaded from the node kvmanager's tiers),"
            " peer (fetched from another node's kvmanager, then loaded).",
            ["tier"],
            registry=r,
        )
        self.completion_tokens = Counter(
            "kvmesh_worker_completion_tokens", "Tokens generated and streamed.", registry=r
        )
        self.engine_generation_tokens = MirroredCounter(
            "kvmesh_worker_engine_generation_tokens_total",
            "Tokens the engine emitted since it started (with speculative decoding: 1 + the "
            "accepted draft tokens per request and step), as its load stream reports them.",
            registry=r,
        )
        self.ttft_seconds = Histogram(
            "kvmesh_worker_time_to_first_token_seconds",
            "From the Generate call's arrival at the worker to its first output token.",
            buckets=TTFT_BUCKETS_S,
            registry=r,
        )
        self.itl_seconds = Histogram(
            "kvmesh_worker_inter_token_latency_seconds",
            "Time between consecutive output messages after the first, per token.",
            buckets=ITL_BUCKETS_S,
            registry=r,
        )
        # ---- gauges, refreshed on the loop ----
        self.in_flight = Gauge(
            "kvmesh_worker_in_flight_requests",
            "Generate calls accepted and not finished (scheduled or not).",
            registry=r,
        )
        self.running = Gauge(
            "kvmesh_worker_running_requests", "Requests the engine is running.", registry=r
        )
        self.waiting = Gauge(
            "kvmesh_worker_waiting_requests",
            "Requests waiting for the engine's scheduler (the queue depth).",
            registry=r,
        )
        self.kv_cache_usage = Gauge(
            "kvmesh_worker_kv_cache_usage_ratio",
            "Fraction of the engine's KV cache blocks in use, [0, 1].",
            registry=r,
        )
        # The engine's cumulative counters, mirrored as counters (they only grow).
        self.prefix_queried = MirroredCounter(
            "kvmesh_worker_prefix_cache_queried_tokens_total",
            "Prompt tokens looked up in the engine's prefix cache since it started.",
            registry=r,
        )
        self.prefix_hits = MirroredCounter(
            "kvmesh_worker_prefix_cache_hit_tokens_total",
            "Prompt tokens found in the engine's prefix cache since it started.",
            registry=r,
        )
        self.kv_connector = MirroredCounter(
            "kvmesh_worker_kv_connector_total",
            "The engine's KV connector since it started, by count: lookups (store lookups of new "
            "requests), lookups_skipped (spared by the router's count of the node store's "
            "prefix), lookup_hit_blocks, load_blocks, load_failed_blocks, save_blocks, "
            "save_skipped_blocks (saver queue full), save_deduped_blocks, peer_fetches, ...",
            ["count"],
            registry=r,
        )
        self.kv_event_seq = Gauge(
            "kvmesh_worker_kv_event_seq",
            "Sequence number of the last KV event batch published (0: none yet).",
            registry=r,
        )
        self.kv_event_subscribers = Gauge(
            "kvmesh_worker_kv_event_subscribers",
            "WatchKvEvents streams open (routers following this worker).",
            registry=r,
        )
        self.kv_event_cut_off = MirroredCounter(
            "kvmesh_worker_kv_event_subscribers_cut_off_total",
            "KV event subscribers cut off for falling too far behind, since start.",
            registry=r,
        )
        self.kv_blocks = Gauge(
            "kvmesh_worker_kv_blocks",
            "KV blocks the engine holds on the GPU tier, per its own events.",
            registry=r,
        )
        self.draining = Gauge(
            "kvmesh_worker_draining", "1 once the worker is draining, else 0.", registry=r
        )
        self._etcd = EtcdGauges(r, "kvmesh_worker", "worker")

    # ---- per request (on the loop) --------------------------------------------------------
    def ended(self, code: str) -> None:
        self.requests.labels(code).inc()

    def finished(
        self, prompt_tokens: int, cached_tokens: int, by_tier: dict[str, int] | None = None
    ) -> None:
        self.prompt_tokens.inc(prompt_tokens)
        self.cached_tokens.inc(cached_tokens)
        for tier, n in (by_tier or {"gpu": cached_tokens}).items():
            if n:
                self.cached_tokens_by_tier.labels(tier).inc(n)

    # ---- gauges (on the loop, every few seconds) -----------------------------------------
    def refresh(
        self,
        load: EngineLoad,
        in_flight: int,
        draining: bool,
        kv: KvEventState | None,
        etcd: EtcdState | None,
    ) -> None:
        self.in_flight.set(in_flight)
        self.running.set(load.running_requests)
        self.waiting.set(load.waiting_requests)
        self.kv_cache_usage.set(load.kv_cache_usage)
        self.prefix_queried.set(load.prefix_cache_queried_tokens)
        self.prefix_hits.set(load.prefix_cache_hit_tokens)
        self.engine_generation_tokens.set(load.generation_tokens)
        self.draining.set(1.0 if draining else 0.0)
        for name, n in load.kv_connector:
            self.kv_connector.labels(name).set(n)
        self.vllm.refresh(load)
        if kv is not None:
            self.kv_event_seq.set(kv.seq)
            self.kv_event_subscribers.set(kv.subscribers)
            self.kv_event_cut_off.set(kv.cut_off)
            self.kv_blocks.set(kv.gpu_blocks)
        if etcd is not None:
            self._etcd.refresh(etcd.connected, etcd.registered)
