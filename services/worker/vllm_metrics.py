"""The worker's engine metrics under vLLM's own names, labels and buckets (vLLM 0.32's
``vllm/v1/metrics/loggers.py`` ``PrometheusStatLogger``), so a vLLM Grafana dashboard pointed at
kvmesh workers works unchanged: one worker is one vLLM engine, ``engine="0"``, and
``model_name`` is the served model name.

Only metrics whose meaning is the same are exported here (the rest of vLLM's set is listed in
docs/status.md). Per-request histograms and counters are observed once per request, when it
finishes (``finished``); ``vllm:inter_token_latency_seconds`` once per output message (one per
engine step), where the worker already times its own inter-token latency; gauges and the
engine's cumulative counters on each refresh. Imports no vLLM: the sim engine feeds it too.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kvmesh.metrics import (
    VLLM_ITL_BUCKETS_S,
    VLLM_REQUEST_LATENCY_BUCKETS_S,
    VLLM_TTFT_BUCKETS_S,
    MirroredCounter,
)

from .core import EngineLoad, FinishReason, Timing

LABELS = ("model_name", "engine")


class VllmMetrics:
    """vLLM-named metrics of one engine serving ``model`` (engine index ``engine``)."""

    def __init__(
        self, registry: CollectorRegistry, model: str, engine: str = "0", spec_positions: int = 0
    ) -> None:
        r, lv, labels = registry, (model, engine), LABELS

        def hist(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, labels, buckets=buckets, registry=r).labels(*lv)  # type: ignore[no-any-return]

        def mirrored(name: str, doc: str) -> MirroredCounter:
            return MirroredCounter(name, doc, labels, registry=r)

        self._lv = lv
        self.running = Gauge(
            "vllm:num_requests_running",
            "Number of requests in model execution batches.",
            labels,
            registry=r,
        ).labels(*lv)
        self.waiting = Gauge(
            "vllm:num_requests_waiting",
            "Number of requests waiting to be processed.",
            labels,
            registry=r,
        ).labels(*lv)
        self.kv_cache_usage = Gauge(
            "vllm:kv_cache_usage_perc",
            "KV-cache usage. 1 means 100 percent usage.",
            labels,
            registry=r,
        ).labels(*lv)
        self.prefix_queries = mirrored(
            "vllm:prefix_cache_queries_total",
            "Prefix cache queries, in terms of number of queried tokens.",
        )
        self.prefix_hits = mirrored(
            "vllm:prefix_cache_hits_total",
            "Prefix cache hits, in terms of number of cached tokens.",
        )
        self.preemptions = mirrored(
            "vllm:num_preemptions_total", "Cumulative number of preemption from the engine."
        )
        self.prompt_tokens = Counter(
            "vllm:prompt_tokens", "Number of prefill tokens processed.", labels, registry=r
        ).labels(*lv)
        self.generation_tokens = Counter(
            "vllm:generation_tokens", "Number of generation tokens processed.", labels, registry=r
        ).labels(*lv)
        success = Counter(
            "vllm:request_success",
            "Count of successfully processed requests.",
            [*labels, "finished_reason"],
            registry=r,
        )
        # Every reason exported from the start, as vLLM does (a dashboard's rate() sees 0s).
        self.success = {reason: success.labels(*lv, reason.value) for reason in FinishReason}
        self.ttft = hist(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            VLLM_TTFT_BUCKETS_S,
        )
        self.itl = hist(
            "vllm:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            VLLM_ITL_BUCKETS_S,
        )
        self.tpot = hist(
            "vllm:request_time_per_output_token_seconds",
            "Histogram of time_per_output_token_seconds per request.",
            VLLM_ITL_BUCKETS_S,
        )
        self.e2e = hist(
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            VLLM_REQUEST_LATENCY_BUCKETS_S,
        )
        self.queue = hist(
            "vllm:request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
            VLLM_REQUEST_LATENCY_BUCKETS_S,
        )
        self.inference = hist(
            "vllm:request_inference_time_seconds",
            "Histogram of time spent in RUNNING phase for request.",
            VLLM_REQUEST_LATENCY_BUCKETS_S,
        )
        self.prefill = hist(
            "vllm:request_prefill_time_seconds",
            "Histogram of time spent in PREFILL phase for request.",
            VLLM_REQUEST_LATENCY_BUCKETS_S,
        )
        self.decode = hist(
            "vllm:request_decode_time_seconds",
            "Histogram of time spent in DECODE phase for request.",
            VLLM_REQUEST_LATENCY_BUCKETS_S,
        )

        # Speculative decoding, as vLLM's SpecDecodingProm: only on an engine that speculates
        # (``spec_positions``: tokens drafted per step, one per-position counter each).
        self.spec_positions = spec_positions
        if spec_positions > 0:
            self.spec_drafts = mirrored(
                "vllm:spec_decode_num_drafts_total", "Number of spec decoding drafts."
            )
            self.spec_draft_tokens = mirrored(
                "vllm:spec_decode_num_draft_tokens_total", "Number of draft tokens."
            )
            self.spec_accepted_tokens = mirrored(
                "vllm:spec_decode_num_accepted_tokens_total", "Number of accepted tokens."
            )
            per_pos = MirroredCounter(
                "vllm:spec_decode_num_accepted_tokens_per_pos_total",
                "Accepted tokens per draft position.",
                [*labels, "position"],
                registry=r,
            )
            self.spec_accepted_per_pos = [
                per_pos.labels(*lv, str(i)) for i in range(spec_positions)
            ]
            for child in self.spec_accepted_per_pos:  # exported from the start, as vLLM's
                child.set(0)
            for c in (self.spec_drafts, self.spec_draft_tokens, self.spec_accepted_tokens):
                c.labels(*lv).set(0)

    def finished(
        self,
        reason: FinishReason,
        prompt_tokens: int,
        completion_tokens: int,
        timing: Timing | None,
    ) -> None:
        """One finished request (its last delta), as vLLM counts a ``FinishedRequestStats``."""
        self.success[reason].inc()
        self.prompt_tokens.inc(prompt_tokens)
        if timing is None:  # an engine that does not time its requests
            return
        p = timing.phases()
        self.e2e.observe(p.e2e_s)
        self.queue.observe(p.queue_s)
        self.prefill.observe(p.prefill_s)
        self.decode.observe(p.decode_s)
        self.inference.observe(p.inference_s)
        # vLLM's mean_time_per_output_token: the decode phase over the tokens after the first.
        self.tpot.observe(p.decode_s / (completion_tokens - 1) if completion_tokens > 1 else 0.0)

    def refresh(self, load: EngineLoad) -> None:
        self.running.set(load.running_requests)
        self.waiting.set(load.waiting_requests)
        self.kv_cache_usage.set(load.kv_cache_usage)
        self.prefix_queries.labels(*self._lv).set(load.prefix_cache_queried_tokens)
        self.prefix_hits.labels(*self._lv).set(load.prefix_cache_hit_tokens)
        self.preemptions.labels(*self._lv).set(load.preemptions)
        if self.spec_positions > 0:
            spec, lv = load.spec, self._lv
            self.spec_drafts.labels(*lv).set(spec.drafts)
            self.spec_draft_tokens.labels(*lv).set(spec.draft_tokens)
            self.spec_accepted_tokens.labels(*lv).set(spec.accepted_tokens)
            for child, n in zip(
                self.spec_accepted_per_pos, spec.accepted_per_position, strict=False
            ):
                child.set(n)
