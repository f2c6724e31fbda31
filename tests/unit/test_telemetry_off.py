"""Tracing off costs nothing: no SDK provider is installed, so spans are OpenTelemetry's no-op
ones (no ids, no attributes kept) and no trace context is propagated."""

from __future__ import annotations

from opentelemetry import propagate, trace

from kvmesh.telemetry import Exporter, setup_tracing, tracer


def test_exporter_none_installs_no_provider_and_records_nothing():
    before = trace.get_tracer_provider()
    assert setup_tracing("kvmesh-test", Exporter.NONE) is None
    assert trace.get_tracer_provider() is before
    if type(before).__name__ != "ProxyTracerProvider":
        return  # another test in this process installed an SDK provider first: nothing to see
    span = tracer(__name__).start_span("work")
    assert not span.is_recording()
    carrier: dict[str, str] = {}
    propagate.inject(carrier, context=trace.set_span_in_context(span))
    assert "traceparent" not in carrier
