"""Prometheus exposition shared by every service: each service keeps its metrics in its own
``CollectorRegistry`` (so tests and several services in one process never collide) and serves
it on ``/metrics`` from a small HTTP server in a daemon thread (never on the event loop).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Gauge, start_http_server
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

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

# vLLM's own bucket families (vllm/v1/metrics/buckets.py, pinned by tests/unit/test_vllm_metrics.py)
# for the metrics named as vLLM names them, so a vLLM Grafana dashboard reads ours unchanged.
# Request phases (e2e, queue, inference, prefill, decode): 0.3 s .. ~2 h.
VLLM_REQUEST_LATENCY_BUCKETS_S = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
    240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
VLLM_TTFT_BUCKETS_S = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
VLLM_ITL_BUCKETS_S = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0,
)  # fmt: skip


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


class MirroredCounter(Collector):
    """A Prometheus counter (``# TYPE <name> counter``, samples ``<name>_total``) whose totals
    are counted elsewhere, such as a store's cumulative stats: ``set`` (``labels(...).set``
    when it has labels) records the latest total on the loop, and a scrape, on the HTTP
    thread, reads the last one recorded. prometheus_client's ``Counter`` can only add, and a
    ``Gauge`` named ``*_total`` is typed gauge. ``name`` ends in ``_total``."""

    def __init__(
        self,
        name: str,
        documentation: str,
        labelnames: Sequence[str] = (),
        registry: CollectorRegistry | None = None,
    ) -> None:
        if not name.endswith("_total"):
            raise ValueError(f"counter {name!r} must end in _total")
        self._name = name.removesuffix("_total")
        self._doc = documentation
        self._labelnames = tuple(labelnames)
        self._lock = threading.Lock()
        # Without labels it is exported from the start, as 0 (prometheus_client's counters are).
        self._totals: dict[tuple[str, ...], float] = {} if self._labelnames else {(): 0.0}
        if registry is not None:
            registry.register(self)

    def labels(self, *values: str) -> _MirroredChild:
        if len(values) != len(self._labelnames):
            raise ValueError(f"{self._name}: labels {self._labelnames}, got {values}")
        return _MirroredChild(self, tuple(values))

    def set(self, total: float) -> None:
        if self._labelnames:
            raise ValueError(f"{self._name} has labels {self._labelnames}; use labels(...).set")
        self._set((), total)

    def _set(self, key: tuple[str, ...], total: float) -> None:
        with self._lock:
            self._totals[key] = float(total)

    def describe(self) -> list[CounterMetricFamily]:
        return [CounterMetricFamily(self._name, self._doc, labels=self._labelnames)]

    def collect(self) -> list[CounterMetricFamily]:
        family = CounterMetricFamily(self._name, self._doc, labels=self._labelnames)
        with self._lock:
            totals = list(self._totals.items())
        for key, total in totals:
            family.add_metric(list(key), total)
        return [family]


@dataclass(frozen=True, slots=True)
class _MirroredChild:
    counter: MirroredCounter
    key: tuple[str, ...]

    def set(self, total: float) -> None:
        self.counter._set(self.key, total)


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
