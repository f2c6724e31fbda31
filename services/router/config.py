"""The router's configuration: one frozen tree, defaults < flags (loaded in main())."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvmesh.telemetry import Exporter

from .core.disagg import DisaggConfig
from .http.cors import CorsPolicy


@dataclass(frozen=True, slots=True)
class RouterConfig:
    host: str = "127.0.0.1"  # address to listen on
    port: int = 0  # gRPC port; 0 lets the OS pick (printed at start)
    advertise_host: str = ""  # host others reach us at (etcd record); empty: host, or hostname
    router_id: str = ""  # etcd id; empty: <hostname>-<port>
    cluster: str = "default"  # etcd cluster name (key prefix /kvmesh/<cluster>/)
    etcd_endpoints: tuple[str, ...] = ("127.0.0.1:2379",)  # host:port of etcd
    etcd_ttl_s: float = 10.0  # lease TTL of the router's own etcd record
    policy: str = "precise-sticky"  # scheduler profile name or a profile YAML file
    index_max_blocks: int = 4_000_000  # KV index bound in distinct blocks (~80 B each)
    peer_hints: bool = True  # name another node's kvmanager holding more of the prompt (peers.py)
    peer_hint_min_blocks: int = 4  # ... only when it holds at least this many more blocks
    # prefill/decode disaggregation (core/disagg.py; docs/disaggregation.md)
    disagg: DisaggConfig = field(default_factory=DisaggConfig)
    hash_algo: str = "sha256"  # block hash algorithm; must match the workers' vLLM setting
    hash_seed: str | None = None  # root-hash seed (workers' PYTHONHASHSEED); None: vLLM default
    tokenizer_overrides: dict[str, str] = field(default_factory=dict)  # model -> tokenizer path
    tokenizer_threads: int = 2  # threads tokenizing off the event loop
    # Prompts estimated at most this many tokens are tokenized and hashed on the event loop
    # (two thread hops cost more than the work); longer ones in one executor job (prompt.py).
    inline_prompt_tokens: int = 2048
    default_timeout_s: float = 600.0  # deadline used when a client sets none
    max_request_bytes: int = 16 * 1024 * 1024  # larger request messages: RESOURCE_EXHAUSTED
    max_retries: int = 1  # other workers tried when one is unavailable before the first token
    # A worker that sends nothing for this long after the call (past an overlapped hand-off's
    # wait for the prefill) is given up for the request: hung, or stuck behind a queue. The
    # request goes to another worker (within max_retries), else UNAVAILABLE.
    first_token_timeout_s: float = 300.0
    # A worker failing after tokens were streamed: the request goes on on another worker (its
    # prompt plus the tokens sent, the rest of max_tokens: docs/failover.md), at most this many
    # times per request; then (or with 0) it fails, UNAVAILABLE.
    max_resumes: int = 2
    # The data path to each worker: one Worker.GenerateMany stream carrying all its requests,
    # outputs batched per engine step (services/router/mux.py); False: a Worker.Generate call
    # per request (one gRPC message per request per token).
    worker_mux: bool = True
    # Router processes on this host, all on the same ports (SO_REUSEPORT; services/router/procs.py):
    # one asyncio loop is one core. 1: this process serves.
    processes: int = 1
    reuse_port: bool = False  # bind the HTTP port with SO_REUSEPORT (set for --processes children)
    load_interval_s: float = 0.25  # WatchLoad push interval asked of workers
    worker_call_timeout_s: float = 5.0  # deadline of unary calls to workers (Abort)
    drain_grace_s: float = 10.0  # on SIGTERM, time given to in-flight streams
    # OpenAI-compatible HTTP front door (docs/openai.md)
    http_host: str = "127.0.0.1"  # address of /v1/chat/completions, /v1/completions, /v1/models
    http_port: int = 0  # its port; 0 lets the OS pick (printed at start), -1 turns it off
    api_keys: tuple[str, ...] = ()  # accepted API keys (Bearer); empty: any key or none
    http_max_body_bytes: int = 8 * 1024 * 1024  # larger request bodies: HTTP 413
    # CORS of the HTTP API (http/cors.py), as vLLM's flags of the same names
    cors: CorsPolicy = field(default_factory=CorsPolicy)  # default: no origin allowed
    metrics_host: str = "127.0.0.1"  # address of the Prometheus /metrics endpoint
    metrics_port: int = 0  # its port; 0 lets the OS pick (printed at start), -1 turns it off
    metrics_refresh_s: float = 2.0  # how often the KV stream gauges are refreshed
    trace_exporter: Exporter = Exporter.NONE
    otlp_endpoint: str = ""
    log_level: str = "INFO"
