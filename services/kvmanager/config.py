"""The kvmanager daemon's configuration: one frozen tree, every field a flag
(``kvmesh.settings``: defaults < config file < environment ``KVMESH_KVMANAGER_*`` < flags,
loaded in main())."""

from __future__ import annotations

from dataclasses import dataclass

from kvmesh.discovery.endpoints import check_etcd_settings
from kvmesh.discovery.security import EtcdSecurity
from kvmesh.settings import setting
from kvmesh.telemetry import Exporter
from kvmesh.tls import TlsConfig

from .core.config import PeerConfig, RetentionConfig, StoreConfig
from .shm import ShmConfig

__all__ = ["KvManagerConfig", "PeerConfig", "RetentionConfig", "ShmConfig", "StoreConfig"]


@dataclass(frozen=True, slots=True)
class KvManagerConfig:
    host: str = setting("127.0.0.1", "address the gRPC server listens on")
    port: int = setting(0, "gRPC port; 0: the OS picks (printed at start)")
    advertise_host: str = setting(
        "", "host others reach this kvmanager at (etcd record); empty: host, or the hostname"
    )
    kvmanager_id: str = setting("", "id in etcd; empty: the node name")
    node: str = setting(
        "", "the node served (workers naming the same node use it); empty: hostname"
    )
    cluster: str = setting("default", "etcd cluster name (key prefix /kvmesh/<cluster>/)")
    etcd_endpoints: tuple[str, ...] = setting(
        ("127.0.0.1:2379",),
        "etcd endpoints, host:port,...; empty: standalone (no registration)",
        flag="etcd",
    )
    etcd_ttl_s: float = setting(10.0, "lease TTL of the kvmanager's etcd record, seconds")
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
    store: StoreConfig = setting(
        factory=StoreConfig, doc="tier budgets, the disk directory, the write policy", prefix=""
    )
    peer: PeerConfig = setting(factory=PeerConfig, doc="data plane and peer fetch", prefix="")
    retention: RetentionConfig = setting(
        factory=RetentionConfig,
        doc="blocks kept for live agent sessions (docs/agents.md#retention)",
        prefix="retention-",
    )
    shm: ShmConfig = setting(
        factory=ShmConfig, doc="same-node shared memory for block bytes", prefix="shm-"
    )
    max_message_bytes: int = setting(
        64 * 1024 * 1024, "largest gRPC message (a PutBlocks batch), bytes"
    )
    event_buffer_batches: int = setting(
        4096, "tier event batches kept per layout for resuming subscribers"
    )
    event_queue_batches: int = setting(
        1024, "tier event batches queued per subscriber; one further behind is cut off"
    )
    drain_grace_s: float = setting(5.0, "on SIGTERM, seconds given to calls in flight")
    tls: TlsConfig = setting(
        factory=TlsConfig,
        doc="TLS of the gRPC port, the data plane and the calls to peer kvmanagers "
        "(kvmesh/tls.py; docs/deploy.md#tls)",
        prefix="tls-",
    )
    metrics_host: str = setting("127.0.0.1", "address of the Prometheus /metrics endpoint")
    metrics_port: int = setting(0, "Prometheus /metrics port; 0: the OS picks, -1: off")
    metrics_refresh_s: float = setting(
        2.0, "how often the store, peer and etcd gauges are refreshed, seconds"
    )
    trace_exporter: Exporter = setting(Exporter.NONE, "where spans go (docs/tracing.md)")
    otlp_endpoint: str = setting(
        "", "OTLP collector, host:port or http(s)://host:port, with --trace-exporter otlp"
    )
    log_level: str = setting("INFO", "logging level: DEBUG, INFO, WARNING, ERROR")

    def __post_init__(self) -> None:
        self.retention.budget_bytes(self.store)  # a budget over half its tier is an error
        check_etcd_settings(self.etcd_endpoints, self.etcd_retry_max_s)
        self.etcd_security.check_endpoints(self.etcd_endpoints)
