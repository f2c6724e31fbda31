"""The worker's configuration: one frozen tree, every field a flag (``kvmesh.settings``:
defaults < config file < environment ``KVMESH_WORKER_*`` < flags, loaded in main())."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvmesh.cpus import parse_cpu_list
from kvmesh.discovery.endpoints import check_etcd_settings
from kvmesh.discovery.keys import Role
from kvmesh.discovery.security import EtcdSecurity
from kvmesh.settings import setting
from kvmesh.telemetry import Exporter
from kvmesh.tls import TlsConfig

MIB = 1 << 20


def _cpus(text: str) -> tuple[int, ...]:
    import argparse

    try:
        return parse_cpu_list(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


SPEC_METHODS = ("", "ngram", "draft_model", "eagle", "eagle3", "mtp")
"""Speculative methods a worker takes (``--spec-method``); "" is off."""
SPEC_DRAFT_METHODS = frozenset({"draft_model", "eagle", "eagle3"})
"""Methods whose drafts come from a model of their own (``--spec-draft-model``)."""


def spec_method(text: str) -> str:
    """``--spec-method``'s value checked: a method of ``SPEC_METHODS``, "" for none / off
    (``argparse.ArgumentTypeError`` otherwise). Also what ``kvmesh up`` parses its flag with."""
    import argparse

    value = text.strip()
    if value in ("none", "off"):
        return ""
    if value not in SPEC_METHODS:
        raise argparse.ArgumentTypeError(
            f"invalid choice: {text!r} (choose from {', '.join(SPEC_METHODS[1:])}, or none)"
        )
    return value


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """Speculative decoding of the engine (vLLM's ``speculative_config``; docs/engine.md).
    Checked here without reading any model; ``speculative.check_models`` checks the models."""

    method: str = setting(
        "",
        "speculative decoding: ngram (prompt lookup), draft_model, eagle, eagle3 or mtp (the "
        "model's own MTP layers); empty: off",
        parse=spec_method,
        metavar="{" + ",".join((*SPEC_METHODS[1:], "none")) + "}",
    )
    num_speculative_tokens: int = setting(
        0,
        "tokens drafted per step; 0: 3, or with mtp the model's MTP layer count",
        flag="num-tokens",
    )
    draft_model: str = setting(
        "",
        "the draft model (draft_model) or EAGLE head (eagle, eagle3) directory; same "
        "vocabulary as --model",
        metavar="PATH",
    )
    prompt_lookup_min: int = setting(
        0, "ngram: shortest n-gram matched in the prompt, tokens; 0: 5 or --spec-prompt-lookup-max"
    )
    prompt_lookup_max: int = setting(
        0, "ngram: longest n-gram matched in the prompt, tokens; 0: 5 or --spec-prompt-lookup-min"
    )
    extra: Mapping[str, Any] | None = setting(
        None, "more vLLM SpeculativeConfig fields as JSON, passed unchanged"
    )

    def __post_init__(self) -> None:
        if self.method not in SPEC_METHODS:
            raise ValueError(
                f"--spec-method {self.method!r} is not known; use one of "
                f"{', '.join(m for m in SPEC_METHODS if m)} (or leave it unset: off)"
            )
        m = self.method
        if not m:
            given = [
                flag
                for flag, set_ in (
                    ("--spec-num-tokens", self.num_speculative_tokens),
                    ("--spec-draft-model", self.draft_model),
                    ("--spec-prompt-lookup-min", self.prompt_lookup_min),
                    ("--spec-prompt-lookup-max", self.prompt_lookup_max),
                    ("--spec-extra", self.extra),
                )
                if set_
            ]
            if given:
                raise ValueError(
                    f"{given[0]} needs --spec-method (ngram, draft_model, eagle, eagle3 or mtp)"
                )
            return
        if self.num_speculative_tokens < 0:
            raise ValueError(
                f"--spec-num-tokens is {self.num_speculative_tokens}; use tokens >= 1 (0: the "
                "method's default)"
            )
        if m in SPEC_DRAFT_METHODS and not self.draft_model:
            what = "draft model" if m == "draft_model" else "EAGLE head"
            raise ValueError(f"--spec-method {m} needs --spec-draft-model PATH (the {what})")
        if m not in SPEC_DRAFT_METHODS and self.draft_model:
            raise ValueError(
                f"--spec-draft-model is for draft_model, eagle and eagle3, not {m}; drop it"
            )
        lookup = self.prompt_lookup_min or self.prompt_lookup_max
        if m != "ngram" and lookup:
            raise ValueError(
                "--spec-prompt-lookup-min/--spec-prompt-lookup-max are for --spec-method "
                f"ngram, not {m}; drop them"
            )
        for flag, n in (
            ("--spec-prompt-lookup-min", self.prompt_lookup_min),
            ("--spec-prompt-lookup-max", self.prompt_lookup_max),
        ):
            if n < 0:
                raise ValueError(f"{flag} is {n}; use tokens >= 1 (0: the default)")
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        if lo and hi and lo > hi:
            raise ValueError(
                f"--spec-prompt-lookup-min {lo} is above --spec-prompt-lookup-max {hi}; "
                "use min <= max"
            )
        clash = sorted(set(self.extra or {}) & _SPEC_OWN_KEYS)
        if clash:
            raise ValueError(
                f"--spec-extra sets {clash}, which have flags of their own (--spec-method, "
                "--spec-num-tokens, --spec-draft-model, --spec-prompt-lookup-min/max); use those"
            )

    @property
    def enabled(self) -> bool:
        return bool(self.method)


_SPEC_OWN_KEYS = frozenset(
    {"method", "model", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max"}
)


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """What the vLLM engine is built from (``engine.VllmEngine.start``)."""

    model: str = setting("", "model directory (weights + tokenizer); required with vllm")
    served_model_name: str = setting(
        "", "name routers and clients use; empty: the model directory's name"
    )
    dtype: str = setting("auto", "weights/activations dtype: auto, float32, bfloat16, float16")
    max_model_len: int = setting(
        0, "context length in tokens (prompt + completion); 0: the model's own"
    )
    block_size: int = setting(32, "tokens per KV block; on CPU a multiple of 32")
    # Mesh-wide: routers hash with the same value (router --hash-seed).
    hash_seed: str | None = setting(
        None,
        "root seed of vLLM's block hash chain (its PYTHONHASHSEED), the same on every worker "
        "and router; unset: vLLM's fixed seed",
    )
    kv_cache_bytes: int = setting(256 * MIB, "KV cache size, bytes (e.g. 256MiB)")
    enable_prefix_caching: bool = setting(
        True, "reuse KV of shared prompt prefixes", flag="prefix-caching"
    )
    max_num_seqs: int = setting(0, "most requests running at once; 0: vLLM's default")
    vllm_prometheus: bool = setting(
        False,
        "also run vLLM's own Prometheus stat logger, which fills prometheus_client's global "
        "registry (not served: /metrics has the same vLLM names from the worker's registry); "
        "off saves ~10 us of worker CPU per output token",
    )
    scheduling_policy: str = setting(
        "fcfs",
        "vLLM's scheduling policy: fcfs, or priority (its queue ordered by the router's "
        "priority band, higher first; docs/tenants.md)",
        choices=("fcfs", "priority"),
    )
    long_prefill_token_threshold: int = setting(
        0,
        "most prompt tokens one request prefills per engine step (vLLM's "
        "long_prefill_token_threshold; the simulator too): short steps, so a higher band's "
        "request does not wait behind a long prefill chunk (docs/tenants.md); 0: no cap",
    )
    seed: int = setting(0, "engine-wide random seed (per-request seeds override it)")
    data_parallel_size: int = setting(
        1,
        "data-parallel ranks of the engine, each with its own KV cache; the router routes to "
        "each rank (docs/engine.md#data-parallel-ranks)",
    )
    enable_expert_parallel: bool = setting(
        False, "MoE experts sharded across the data-parallel ranks (vLLM; docs/engine.md)"
    )
    # When a signal reaches the engine core directly (Ctrl-C, or a signal to the whole process
    # group). Unless set, the worker's --drain-grace-s rounded up (main.py).
    core_drain_s: int = setting(
        30, "seconds the engine core keeps serving in-flight requests on a signal; 0: abort"
    )
    # Events are always on (ZMQ); endpoint and replay_endpoint default to ipc sockets in a temp
    # dir of the engine's own (services/worker/kv_events.py).
    kv_events_config: Mapping[str, Any] | None = setting(
        None, "vLLM KVEventsConfig fields as JSON (events are always on)"
    )
    kv_transfer_config: Mapping[str, Any] | None = setting(
        None, "vLLM KVTransferConfig fields as JSON (the KV connector); --kvmanager overrides it"
    )
    # None: vLLM's defaults (backend auto: xgrammar, falling back to guidance or outlines).
    structured_outputs_config: Mapping[str, Any] | None = setting(
        None,
        "vLLM StructuredOutputsConfig fields as JSON, e.g. "
        '\'{"backend": "xgrammar", "disable_any_whitespace": true}\'',
    )
    engine_extra: Mapping[str, Any] | None = setting(
        None, "more vLLM EngineArgs fields as JSON, passed unchanged"
    )
    speculative: SpeculativeConfig = setting(
        factory=SpeculativeConfig, doc="speculative decoding (docs/engine.md)", prefix="spec-"
    )
    # Empty: no binding (torch's default: one unbound thread per core of the machine).
    compute_cpus: tuple[int, ...] = setting(
        (),
        "cores for the engine's compute (OpenMP) threads, one thread per core, e.g. 0-6 "
        "(kvmesh/cpus.py); empty: no binding; kvmesh up plans them per worker",
        parse=_cpus,
        metavar="LIST",
    )
    service_cpus: tuple[int, ...] = setting(
        (),
        "cores for this worker's gRPC front end, e.g. 7 (the engine core's own threads stay "
        "on its compute cores); empty: anywhere",
        parse=_cpus,
        metavar="LIST",
    )

    @property
    def model_name(self) -> str:
        """The served model name, defaulting to the model directory's name."""
        if self.served_model_name:
            return self.served_model_name
        return self.model.rstrip("/").rsplit("/", 1)[-1] or self.model


@dataclass(frozen=True, slots=True)
class WorkerConfig:
    engine: EngineConfig = setting(factory=EngineConfig, doc="the vLLM engine", prefix="")
    # "simulated": services/worker/sim, a simulator for scale tests (not an engine: fake
    # tokens, modelled timing, a real block cache and real KV events).
    engine_kind: str = setting(
        "vllm",
        "vllm, or simulated: a simulator for scale tests (fake tokens, modelled timing, real "
        "block cache and KV events; clients must send token ids)",
        flag="engine",
        choices=("vllm", "simulated"),
    )
    sim_capacity_blocks: int = setting(16384, "simulated engine: KV capacity in blocks")
    sim_speedup: float = setting(
        1.0, "simulated engine: virtual seconds per real second (below 1: a slower model)"
    )
    sim_max_running: int = setting(
        256, "simulated engine: most requests running at once (vLLM's max_num_seqs)"
    )
    host: str = setting("127.0.0.1", "address the gRPC server listens on")
    port: int = setting(0, "gRPC port; 0: the OS picks (printed in the ready line)")
    advertise_host: str = setting(
        "", "host others reach this worker at (etcd record); empty: host, or the hostname"
    )
    worker_id: str = setting("", "id in etcd; empty: <hostname>-<port>")
    cluster: str = setting("default", "etcd cluster name (key prefix /kvmesh/<cluster>/)")
    etcd_endpoints: tuple[str, ...] = setting(
        (), "etcd endpoints, host:port,...; empty: do not register (standalone)", flag="etcd"
    )
    etcd_ttl_s: float = setting(10.0, "lease TTL of the worker's etcd record, seconds")
    etcd_retry_max_s: float = setting(
        5.0,
        "longest wait between attempts to reach etcd while starting (retried until it answers; "
        "health NOT_SERVING meanwhile), seconds",
    )
    etcd_security: EtcdSecurity = setting(
        factory=EtcdSecurity,
        doc="TLS and user of the etcd client (docs/etcd.md#tls-and-authentication)",
        prefix="etcd-",
    )
    role: Role = setting(Role.BOTH, "prefill, decode or both")
    node: str = setting("", "node (host) name in the etcd record; empty: this host's name")
    # Published as WorkerRecord.kv_layout: routers count that kvmanager's blocks as its lower
    # tiers.
    kv_layout: str = setting(
        "",
        "KvLayout key (16 hex digits) of the blocks it saves to its node's kvmanager; empty: "
        "the engine's connector layout, if any",
    )
    kvmanager: str = setting(
        "",
        "the node's kvmanager, host:port: the engine saves computed KV blocks to it and loads "
        "prefixes it lacks from it (KvmeshConnector); overrides --kv-transfer-config",
        metavar="HOST:PORT",
    )
    drain_grace_s: float = setting(
        30.0, "on SIGTERM, seconds in-flight requests get before they are aborted"
    )
    load_interval_s: float = setting(0.25, "default minimum seconds between two WatchLoad pushes")
    max_request_bytes: int = setting(16 * MIB, "largest gRPC request message, bytes")
    # The server's send limit is the larger of this and max_request_bytes. A snapshot costs ~8
    # bytes per block in chained runs and ~30 bytes per unchained one: 256 MiB is >= 8 million.
    kv_snapshot_max_bytes: int = setting(
        256 * MIB, "largest KV snapshot message sent to a WatchKvEvents subscriber, bytes"
    )
    kv_event_buffer_batches: int = setting(
        4096, "KV event batches kept for subscribers that resume"
    )
    kv_event_queue_batches: int = setting(
        1024, "live KV event batches queued per subscriber before it is cut off"
    )
    tls: TlsConfig = setting(
        factory=TlsConfig,
        doc="TLS of the gRPC port and of the engine's calls to --kvmanager (kvmesh/tls.py; "
        "docs/deploy.md#tls)",
        prefix="tls-",
    )
    metrics_host: str = setting("127.0.0.1", "address of the Prometheus /metrics endpoint")
    metrics_port: int = setting(
        0, "Prometheus /metrics port; 0: the OS picks (printed in the ready line), -1: off"
    )
    metrics_refresh_s: float = setting(
        2.0, "how often the load, KV event and etcd gauges are refreshed, seconds"
    )
    trace_exporter: Exporter = setting(Exporter.NONE, "where spans go (docs/tracing.md)")
    otlp_endpoint: str = setting(
        "", "OTLP collector, host:port or http(s)://host:port, with --trace-exporter otlp"
    )
    log_level: str = setting("INFO", "logging level: DEBUG, INFO, WARNING, ERROR")

    def __post_init__(self) -> None:
        check_etcd_settings(self.etcd_endpoints, self.etcd_retry_max_s)
        self.etcd_security.check_endpoints(self.etcd_endpoints)
