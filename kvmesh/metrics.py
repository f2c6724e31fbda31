"""Prometheus exposition shared by every service: each service keeps its metrics in its own
``CollectorRegistry`` (so tests and several services in one process never collide) and serves
it on ``/metrics`` from a small HTTP server in a daemon thread (never on the event loop).
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, start_http_server

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
