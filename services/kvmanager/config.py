"""The kvmanager daemon's configuration: one frozen tree, defaults < flags (loaded in main())."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvmesh.telemetry import Exporter

from .core.config import PeerConfig, StoreConfig
from .shm import ShmConfig

__all__ = ["KvManagerConfig", "PeerConfig", "ShmConfig", "StoreConfig"]


@dataclass(frozen=True, slots=True)
class KvManagerConfig:
    host: str = "127.0.0.1"  # address to listen on
    port: int = 0  # gRPC port; 0 lets the OS pick (printed at start)
    advertise_host: str = ""  # host others reach us at (etcd record); empty: host, or hostname
    kvmanager_id: str = ""  # etcd id; empty: the node name
    node: str = ""  # the node served (workers with the same node use it); empty: hostname
    cluster: str = "default"  # etcd cluster name (key prefix /kvmesh/<cluster>/)
    etcd_endpoints: tuple[str, ...] = ("127.0.0.1:2379",)  # host:port of etcd; () = no etcd
    etcd_ttl_s: float = 10.0  # lease TTL of the etcd record
    store: StoreConfig = field(default_factory=StoreConfig)  # tier budgets and the disk dir
    peer: PeerConfig = field(default_factory=PeerConfig)  # data plane and peer fetch
    shm: ShmConfig = field(default_factory=ShmConfig)  # same-node shared memory for block bytes
    max_message_bytes: int = 64 * 1024 * 1024  # largest gRPC message (a PutBlocks batch)
    event_buffer_batches: int = 4096  # event batches kept per layout for resuming subscribers
    event_queue_batches: int = 1024  # a subscriber further behind than this is cut off
    drain_grace_s: float = 5.0  # on SIGTERM, time given to calls in flight
    metrics_host: str = "127.0.0.1"  # address of the Prometheus /metrics endpoint
    metrics_port: int = 0  # its port; 0 lets the OS pick, -1 turns it off
    metrics_refresh_s: float = 2.0  # how often the store, peer and etcd gauges are refreshed
    trace_exporter: Exporter = Exporter.NONE
    otlp_endpoint: str = ""
    log_level: str = "INFO"
