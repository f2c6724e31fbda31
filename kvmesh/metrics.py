"""Prometheus exposition shared by every service: each service keeps its metrics in its own
``CollectorRegistry`` (so tests and several services in one process never collide) and serves
it on ``/metrics`` from a small HTTP server in a daemon thread (never on the event loop).
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Gauge, start_http_server

log = logging.getLogger(__name__)

# Latency buckets (seconds) for time to first token: 5 ms .. 10 min, wide enough for 195K-token
# prefills on a busy fleet.
TTFT_BUCKETS_S = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0
)  # fmt: skip
# Inter-token latency: 1 ms .. 5 s.
ITL_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
# Fast in-process decisions: 10 us .. 1 s.
DECISION_BUCKETS_S = (1e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 0.1, 1.0)


class EtcdGauges:
    """A service's etcd session as ``<prefix>_etcd_connected`` (the last exchange with etcd
    succeeded) and ``<prefix>_etcd_registered`` (a lease is held, the record put under it),
    made on the first ``refresh``: a service running without etcd exports neither."""

    def __init__(self, registry: CollectorRegistry, prefix: str, what: str) -> None:
        self._registry = registry
        self._prefix = prefix
        self._what = what
        self._gauges: tuple[Gauge, Gauge] | None = None

    def refresh(self, connected: bool, registered: bool) -> None:
        if self._gauges is None:
            self._gauges = (
                Gauge(
                    f"{self._prefix}_etcd_connected",
                    "1 while the last exchange with etcd succeeded; 0 while etcd is unreachable.",
                    registry=self._registry,
                ),
                Gauge(
                    f"{self._prefix}_etcd_registered",
                    f"1 while the {self._what} holds an etcd lease with its record put under it;"
                    " 0 once the lease is lost (until a new one is granted) or revoked.",
                    registry=self._registry,
                ),
            )
        self._gauges[0].set(1.0 if connected else 0.0)
        self._gauges[1].set(1.0 if registered else 0.0)


@dataclass
class MetricsServer:
    """A running ``/metrics`` endpoint; ``port`` is the bound one (0 in the config: OS picks)."""

    host: str
    port: int
    _server: Any
    _thread: threading.Thread

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/metrics"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5.0)


def serve_metrics(registry: CollectorRegistry, host: str, port: int) -> MetricsServer:
    """Serves ``registry`` at ``http://host:port/metrics``; port 0 lets the OS pick."""
    server, thread = start_http_server(port, addr=host, registry=registry)
    bound = server.server_address[1]
    log.info("metrics on http://%s:%d/metrics", host, bound)
    return MetricsServer(host, bound, server, thread)
