"""The worker's configuration: one frozen tree, defaults < flags (loaded in main())."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvmesh.discovery.keys import Role
from kvmesh.telemetry import Exporter


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """What the vLLM engine is built from (``engine.VllmEngine.start``)."""

    model: str = ""  # path of the model directory (weights + tokenizer); required
    served_model_name: str = ""  # name routers and clients use; empty: the model directory's name
    dtype: str = "auto"  # weights/activations dtype: auto, float32, bfloat16, float16
    max_model_len: int = 0  # context length in tokens (prompt + completion); 0: the model's own
    block_size: int = 32  # tokens per KV block; on CPU a multiple of 32
    # Root seed of vLLM's block hash chain (its PYTHONHASHSEED), mesh-wide: routers hash with the
    # same value (router --hash-seed). None: unset, vLLM's fixed default for sha256.
    hash_seed: str | None = None
    kv_cache_bytes: int = 256 * 1024 * 1024  # KV cache size in bytes
    enable_prefix_caching: bool = True  # reuse KV of shared prompt prefixes
    max_num_seqs: int = 0  # most requests running at once; 0: vLLM's default
    seed: int = 0  # engine-wide random seed (per-request seeds override it)
    # Seconds the engine core keeps serving in-flight requests when a signal reaches it directly
    # (Ctrl-C or a signal to the whole process group); 0: it aborts them at once.
    core_drain_s: int = 30
    # vLLM KVEventsConfig fields. Events are always on (ZMQ); endpoint and replay_endpoint default
    # to ipc sockets in a temp dir of the engine's own (services/worker/kv_events.py).
    kv_events_config: Mapping[str, Any] | None = None
    kv_transfer_config: Mapping[str, Any] | None = None  # vLLM KVTransferConfig fields (connector)
    # vLLM StructuredOutputsConfig fields (backend, disable_any_whitespace, ...); None: vLLM's
    # defaults (backend auto: xgrammar, falling back to guidance or outlines per request).
    structured_outputs_config: Mapping[str, Any] | None = None
    engine_extra: Mapping[str, Any] | None = None  # more vLLM EngineArgs fields, passed unchanged
    # Cores the engine's compute (OpenMP) threads are bound to, one thread per core (kvmesh/cpus.py);
    # empty: no binding (torch's default: one unbound thread per core of the machine).
    compute_cpus: tuple[int, ...] = ()
    # Cores for everything else of this worker (its gRPC front end, the engine's helper threads);
    # empty: anywhere. `kvmesh up` plans both so that engines and services do not share cores.
    service_cpus: tuple[int, ...] = ()

    @property
    def model_name(self) -> str:
        """The served model name, defaulting to the model directory's name."""
        if self.served_model_name:
            return self.served_model_name
        return self.model.rstrip("/").rsplit("/", 1)[-1] or self.model


@dataclass(frozen=True, slots=True)
class WorkerConfig:
    engine: EngineConfig = EngineConfig()
    # "vllm", or "simulated": services/worker/sim, a simulator for scale tests (not an engine:
    # fake tokens, modelled timing, a real block cache and real KV events).
    engine_kind: str = "vllm"
    sim_capacity_blocks: int = 16384  # simulated engine: KV capacity in blocks
    sim_speedup: float = 1.0  # simulated engine: virtual seconds per real second (< 1: slower)
    sim_max_running: int = 256  # simulated engine: most requests running at once
    host: str = "127.0.0.1"  # address to listen on
    port: int = 0  # gRPC port; 0 lets the OS pick (printed in the ready line)
    advertise_host: str = ""  # host others reach us at (etcd record); empty: host, or hostname
    worker_id: str = ""  # etcd id; empty: <hostname>-<port>
    cluster: str = "default"  # etcd cluster name (key prefix /kvmesh/<cluster>/)
    etcd_endpoints: tuple[str, ...] = ()  # host:port of etcd; empty: do not register (standalone)
    etcd_ttl_s: float = 10.0  # lease TTL of the worker's etcd record, seconds
    role: Role = Role.BOTH  # prefill, decode or both
    node: str = ""  # node (host) name in the etcd record; empty: this host's name
    # KvLayout key (16 hex digits) of the blocks it saves to its node's kvmanager, published as
    # WorkerRecord.kv_layout (routers count that kvmanager's blocks as its lower tiers); empty:
    # the engine's connector layout, if any (EngineInfo.connector_layout).
    kv_layout: str = ""
    drain_grace_s: float = 30.0  # on SIGTERM, seconds in-flight requests get before abort
    load_interval_s: float = 0.25  # default minimum seconds between two WatchLoad pushes
    max_request_bytes: int = 16 * 1024 * 1024  # largest request message, bytes
    # Largest KV snapshot message sent to a WatchKvEvents subscriber, bytes (the server's send
    # limit is the larger of this and max_request_bytes). A snapshot costs ~8 bytes per block in
    # chained runs and ~30 bytes per unchained block: 256 MiB is >= 8 million blocks.
    kv_snapshot_max_bytes: int = 256 * 1024 * 1024
    kv_event_buffer_batches: int = 4096  # KV event batches kept for subscribers that resume
    kv_event_queue_batches: int = 1024  # live batches queued per subscriber before it is cut off
    metrics_host: str = "127.0.0.1"  # address of the Prometheus /metrics endpoint
    metrics_port: int = (
        0  # its port; 0 lets the OS pick (printed in the ready line), -1 turns it off
    )
    metrics_refresh_s: float = 2.0  # how often the load, KV event and etcd gauges are refreshed
    trace_exporter: Exporter = Exporter.NONE  # where spans go: none, console, otlp
    otlp_endpoint: str = ""  # OTLP collector (host:port) when trace_exporter is otlp
    log_level: str = "INFO"
