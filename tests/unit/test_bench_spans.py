"""benchmarks/serve/spans.py reads what OpenTelemetry's console exporter really prints."""

from __future__ import annotations

import io

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import ConsoleSpanExporter, SimpleSpanProcessor

from benchmarks.serve.spans import arrival_gaps_ms, format_report, parse_spans, timeline

MS = 1_000_000  # ns


def console_log(starts_ms: list[int]) -> str:
    """A log with a request trace per start: a router server span, a worker span under it, an
    ``engine.queue`` span from +2 to +5 ms and a first_token event at +9 ms; lines of other
    logging between them."""
    out = io.StringIO()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(ConsoleSpanExporter(out=out)))
    tracer = provider.get_tracer("test")
    base = 1_800_000_000_000 * MS
    for start in starts_ms:
        t0 = base + start * MS
        root = tracer.start_span("router", kind=trace.SpanKind.SERVER, start_time=t0)
        ctx = trace.set_span_in_context(root)
        queue = tracer.start_span("engine.queue", context=ctx, start_time=t0 + 2 * MS)
        queue.end(end_time=t0 + 5 * MS)
        root.add_event("first_token", timestamp=t0 + 9 * MS)
        root.end(end_time=t0 + 20 * MS)
        out.write("2026-12-07 INFO something else logged\n")
    provider.shutdown()
    return out.getvalue()


def test_steps_are_timed_from_the_request_span_start() -> None:
    spans = list(parse_spans(console_log([0, 100, 300])))
    assert len(spans) == 6
    marks = timeline(spans)
    assert marks["engine.queue.start"] == pytest.approx([2.0, 2.0, 2.0], abs=1e-3)
    assert marks["engine.queue.end"] == pytest.approx([5.0, 5.0, 5.0], abs=1e-3)
    assert marks["event:first_token"] == pytest.approx([9.0, 9.0, 9.0], abs=1e-3)
    assert marks["router.end"] == pytest.approx([20.0, 20.0, 20.0], abs=1e-3)


def test_arrival_gaps_show_a_convoy() -> None:
    spans = list(parse_spans(console_log([0, 0, 50, 50])))
    assert arrival_gaps_ms(spans) == pytest.approx([0.0, 50.0, 0.0], abs=1e-3)
    report = format_report(spans)
    assert "| engine.queue.end | 4 | 5.00 | 5.00 |" in report
    assert "under 1 ms: 67%" in report
