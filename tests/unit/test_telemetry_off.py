"""Tracing off costs nothing: no SDK provider is installed, so spans are OpenTelemetry's no-op
ones (no ids, no attributes kept), no trace context is propagated, and no gRPC interceptor
wraps the servers' handlers or the channels' calls."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from opentelemetry import trace

from kvmesh.telemetry import Exporter, setup_tracing

# Run in a fresh interpreter: the global provider can be set once per process, and other
# tests in this one install an SDK provider with an in-memory exporter.
CHECK = """
from opentelemetry import propagate, trace
from kvmesh.telemetry import (
    Exporter, client_interceptors, server_interceptors, setup_tracing, tracer
)
assert setup_tracing("kvmesh-test", Exporter.NONE) is None
assert server_interceptors() == [] and client_interceptors() == []
span = tracer("t").start_span("work")
carrier = {}
propagate.inject(carrier, context=trace.set_span_in_context(span))
print(span.is_recording(), "traceparent" in carrier)
setup_tracing("kvmesh-test", Exporter.CONSOLE)  # on: one server span per RPC, client spans too
print(len(server_interceptors()), len(client_interceptors()) > 0)
"""


def test_exporter_none_installs_no_provider_and_records_nothing():
    before = trace.get_tracer_provider()
    assert setup_tracing("kvmesh-test", Exporter.NONE) is None
    assert trace.get_tracer_provider() is before
    out = subprocess.run(
        [sys.executable, "-c", CHECK],
        capture_output=True,
        text=True,
        check=True,
        cwd=Path(__file__).resolve().parents[2],
        timeout=60,
    )
    # Off: not recording, nothing propagated, no interceptors; on: both kinds of interceptor.
    assert out.stdout.split() == ["False", "False", "1", "True"]
