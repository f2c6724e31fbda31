"""The router's configuration: one frozen tree, every field a flag (``kvmesh.settings``:
defaults < config file < environment ``KVMESH_ROUTER_*`` < flags, loaded in main())."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from kvmesh.discovery.endpoints import check_etcd_settings
from kvmesh.discovery.security import EtcdSecurity
from kvmesh.errors import InvalidArgument
from kvmesh.settings import parse_pair, setting
from kvmesh.telemetry import Exporter
from kvmesh.tls import TlsConfig

from .core.admission import AdmissionConfig
from .core.disagg import DisaggConfig
from .core.sessions import RetentionConfig
from .http.cors import CorsPolicy
from .state.records import ResponsesConfig

MIB = 1 << 20


@dataclass(frozen=True, slots=True)
class RouterConfig:
    host: str = setting("127.0.0.1", "address the gRPC server listens on")
    port: int = setting(0, "gRPC port; 0: the OS picks (printed at start)")
    advertise_host: str = setting(
        "", "host others reach this router at (etcd record); empty: host, or the hostname"
    )
    router_id: str = setting("", "id in etcd; empty: <hostname>-<port>")
    cluster: str = setting("default", "etcd cluster name (key prefix /kvmesh/<cluster>/)")
    etcd_endpoints: tuple[str, ...] = setting(
        ("127.0.0.1:2379",), "etcd endpoints, host:port,...", flag="etcd"
    )
    etcd_ttl_s: float = setting(10.0, "lease TTL of the router's own etcd record, seconds")
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
    ready_timeout_s: float = setting(
        10.0,
        "at start, the longest wait for the KV event streams of the workers etcd lists to be "
        "synced before serving anyway (those not synced are logged), seconds",
    )
    policy: str = setting(
        "precise-sticky",
        "scheduler profile: a built-in name (services/router/core/scheduler/profiles/*.yaml)"
        " or a profile YAML file",
    )
    index_max_blocks: int = setting(
        4_000_000, "KV index bound in distinct blocks (~80 bytes of memory each)"
    )
    peer_hints: bool = setting(
        True, "name another node's kvmanager holding more of the prompt for a worker to fetch"
    )
    peer_hint_min_blocks: int = setting(
        4, "name a peer kvmanager only when it holds at least this many more prompt blocks"
    )
    peer_hint_sibling_wait_s: float = setting(
        0.25,
        "a worker on the chosen worker's node holds more of the prompt than the node's"
        " kvmanager (it just computed it): name that kvmanager and have the worker wait up to"
        " this long for the save to land instead of recomputing, seconds; 0: never",
    )
    peer_hint_cost: bool = setting(
        True,
        "price a peer hint: fetching over that link's measured speed against recomputing at the"
        " worker's measured prefill speed; a slower peer is not named (core/peer_cost.py);"
        " off: name the longest on blocks gained alone",
    )
    peer_hint_probe_s: float = setting(
        30.0,
        "name a peer skipped as slow at most this often anyway, to measure its link again,"
        " seconds; 0: never",
    )
    peer_fetch_budget_floor_s: float = setting(
        0.25,
        "a priced hint tells the worker to stop its fetch once it took as long as recomputing"
        " the blocks would, but never sooner than this, seconds",
    )
    disagg: DisaggConfig = setting(
        factory=DisaggConfig,
        doc="prefill/decode disaggregation (core/disagg.py; docs/disaggregation.md)",
        prefix="disagg-",
    )
    admission: AdmissionConfig = setting(
        factory=AdmissionConfig,
        doc="flow control in front of the scheduler (core/admission.py; docs/tenants.md)",
        prefix="admission-",
    )
    retention: RetentionConfig = setting(
        factory=RetentionConfig,
        doc="session retention: keep a session's blocks on its node between turns "
        "(docs/agents.md#retention)",
        prefix="retention-",
    )
    hash_algo: str = setting("sha256", "block hash algorithm; the workers' vLLM setting")
    hash_seed: str | None = setting(
        None, "root-hash seed, the workers' PYTHONHASHSEED; unset: vLLM's fixed seed"
    )
    tokenizer_overrides: dict[str, str] = setting(
        factory=dict,
        doc="tokenizer directory for a model, MODEL=PATH, repeatable; unset: the path its "
        "workers advertise",
        flag="tokenizer",
        parse=parse_pair,
        repeat=True,
        metavar="MODEL=PATH",
    )
    tokenizer_threads: int = setting(2, "threads tokenizing off the event loop")
    inline_prompt_tokens: int = setting(
        2048,
        "prompts estimated at most this many tokens are tokenized and hashed on the event loop "
        "(two thread hops cost more); longer ones in one executor job (prompt.py)",
    )
    default_timeout_s: float = setting(
        600.0, "deadline of a request whose client sets none, seconds"
    )
    max_request_bytes: int = setting(
        16 * MIB, "largest gRPC request message, bytes; larger: RESOURCE_EXHAUSTED"
    )
    max_retries: int = setting(
        1, "other workers tried when one is unavailable before the first token"
    )
    max_resumes: int = setting(
        2,
        "times one request is resumed on another worker after its worker failed mid-stream "
        "(prompt + the tokens already sent; docs/failover.md); past it: UNAVAILABLE, retryable",
    )
    first_token_timeout_s: float = setting(
        300.0,
        "give a worker up (retry elsewhere, within max_retries; else UNAVAILABLE) when it "
        "sends no token for this long after the call (past an overlapped hand-off's wait), seconds",
    )
    worker_mux: bool = setting(
        True,
        "one Worker.GenerateMany stream per worker with outputs batched per engine step "
        "(services/router/mux.py); off: one Worker.Generate call per request (for comparison)",
    )
    processes: int = setting(
        1,
        "router processes on this host sharing the gRPC and HTTP ports (SO_REUSEPORT), each a "
        "whole router with its own KV index (services/router/procs.py)",
    )
    reuse_port: bool = setting(
        False, "bind the HTTP port with SO_REUSEPORT (set for --processes children)", hidden=True
    )
    load_interval_s: float = setting(0.25, "WatchLoad push interval asked of workers, seconds")
    unregistered_linger_s: float = setting(
        30.0,
        "how long a worker whose etcd record vanished stays routable while its load stream is "
        "live (etcd unreachable past its lease, then back), waiting for it to register again, "
        "seconds; 0: drop it with its record",
    )
    worker_call_timeout_s: float = setting(
        5.0, "deadline of unary calls to workers (Abort), seconds"
    )
    drain_grace_s: float = setting(10.0, "on SIGTERM, seconds given to in-flight streams")
    http_host: str = setting(
        "127.0.0.1", "address of the OpenAI-compatible HTTP API (docs/openai.md)"
    )
    http_port: int = setting(
        0, "OpenAI-compatible HTTP port (/v1/chat/completions ...); 0: the OS picks, -1: off"
    )
    api_keys: tuple[str, ...] = setting(
        (),
        "accepted API key (Bearer) on the HTTP and gRPC APIs, each its own tenant, repeatable; "
        "none and no --api-keys-file: open, any key or none (docs/tenants.md)",
        flag="api-key",
        repeat=True,
        parse=str,
        metavar="KEY",
    )
    api_keys_file: Path | None = setting(
        None,
        "YAML/TOML file of tenants, their priority classes and SHA-256 digests of their API "
        "keys (kvmesh auth hash-key); required on the HTTP and gRPC APIs; unset: open "
        "(docs/tenants.md)",
    )
    api_keys_reload_s: float = setting(
        2.0, "how often the API key file is checked for changes, seconds; 0: only on SIGHUP"
    )
    http_max_body_bytes: int = setting(8 * MIB, "largest HTTP request body, bytes; larger: 413")
    responses: ResponsesConfig = setting(
        factory=ResponsesConfig,
        doc="the Responses API's stored responses (state/; docs/agents.md#responses-api)",
        prefix="responses-",
    )
    cors: CorsPolicy = setting(
        factory=CorsPolicy, doc="CORS of the HTTP API (http/cors.py), as vLLM's flags", prefix=""
    )
    tls: TlsConfig = setting(
        factory=TlsConfig,
        doc="TLS of the gRPC and HTTP ports and of the calls to workers and kvmanagers "
        "(kvmesh/tls.py; docs/deploy.md#tls)",
        prefix="tls-",
    )
    metrics_host: str = setting("127.0.0.1", "address of the Prometheus /metrics endpoint")
    metrics_port: int = setting(
        0, "Prometheus /metrics port; 0: the OS picks (printed at start), -1: off"
    )
    metrics_refresh_s: float = setting(
        2.0, "how often the KV stream, tier and etcd gauges are refreshed, seconds"
    )
    trace_exporter: Exporter = setting(Exporter.NONE, "where spans go (docs/tracing.md)")
    otlp_endpoint: str = setting(
        "", "OTLP collector, host:port or http(s)://host:port, with --trace-exporter otlp"
    )
    log_level: str = setting("INFO", "logging level: DEBUG, INFO, WARNING, ERROR")

    def __post_init__(self) -> None:
        check_etcd_settings(self.etcd_endpoints, self.etcd_retry_max_s)
        self.etcd_security.check_endpoints(self.etcd_endpoints)
        if not self.ready_timeout_s >= 0:
            raise InvalidArgument(f"--ready-timeout-s is {self.ready_timeout_s}; use >= 0 seconds")
        if self.peer_hint_min_blocks < 1:
            raise InvalidArgument(
                f"--peer-hint-min-blocks is {self.peer_hint_min_blocks}; use 1 or more"
            )
        for flag, v in (
            ("--peer-hint-probe-s", self.peer_hint_probe_s),
            ("--peer-hint-sibling-wait-s", self.peer_hint_sibling_wait_s),
            ("--peer-fetch-budget-floor-s", self.peer_fetch_budget_floor_s),
        ):
            if not (v >= 0 and math.isfinite(v)):
                raise InvalidArgument(f"{flag} is {v}; use seconds >= 0")
        if not self.first_token_timeout_s > 0:
            raise InvalidArgument(
                f"--first-token-timeout-s is {self.first_token_timeout_s}; use > 0 seconds"
            )
        if self.processes < 1:
            raise InvalidArgument(f"--processes is {self.processes}; use 1 or more")
        if self.api_keys and self.api_keys_file is not None:
            raise InvalidArgument(
                "--api-key and --api-keys-file both given; use one (the file holds tenants)"
            )
        if self.api_keys_reload_s < 0:
            raise InvalidArgument(f"--api-keys-reload-s is {self.api_keys_reload_s}; use >= 0")
        if not self.unregistered_linger_s >= 0:
            raise InvalidArgument(
                f"--unregistered-linger-s is {self.unregistered_linger_s}; use >= 0 seconds"
            )
        if self.max_resumes < 0:
            raise InvalidArgument(f"--max-resumes is {self.max_resumes}; use 0 or more")
