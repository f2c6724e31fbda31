"""Where a request's first token waits, from the spans kvmesh's services print with
``--trace-exporter console`` (OpenTelemetry's console exporter: one JSON object per span in each
service's log).

    kvmesh up --workers 1 --trace-exporter console --log-dir LOGS ...   # then drive it
    python -m benchmarks.serve.spans LOGS/*.log

Prints, per step of a request (a span's start or end, or an event), the median and p90 of its
time from the router's request span start, ms; then how the requests reached the engine: the
gaps between consecutive arrivals and the share under 1 ms (a convoy: requests that prefill in
one engine step; docs/serving-cost.md)."""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
from collections import defaultdict
from collections.abc import Iterable, Iterator, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

Span = dict[str, Any]
_SPAN_START = '{\n    "name"'  # how the console exporter starts each span's JSON


def parse_spans(text: str) -> Iterator[Span]:
    """The spans in a log, skipping everything else on it."""
    decoder = json.JSONDecoder()
    i = 0
    while (j := text.find(_SPAN_START, i)) >= 0:
        try:
            span, i = decoder.raw_decode(text, j)
        except ValueError:
            i = j + 1
            continue
        yield span


def _seconds(stamp: str) -> float:
    return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()


def timeline(spans: Iterable[Span]) -> dict[str, list[float]]:
    """Per step (``NAME.start``, ``NAME.end``, ``event:NAME``), the ms from its trace's root
    server span start, one value per trace that has that step. Traces without a root server
    span (a background call) are left out."""
    traces: dict[str, list[Span]] = defaultdict(list)
    for span in spans:
        traces[span["context"]["trace_id"]].append(span)
    marks: dict[str, list[float]] = defaultdict(list)
    for members in traces.values():
        roots = [
            s for s in members if s.get("parent_id") is None and s.get("kind") == "SpanKind.SERVER"
        ]
        if not roots:
            continue
        t0 = _seconds(roots[0]["start_time"])
        for s in members:
            marks[f"{s['name']}.start"].append((_seconds(s["start_time"]) - t0) * 1e3)
            marks[f"{s['name']}.end"].append((_seconds(s["end_time"]) - t0) * 1e3)
            for event in s.get("events", ()):
                marks[f"event:{event['name']}"].append((_seconds(event["timestamp"]) - t0) * 1e3)
    return dict(marks)


def arrival_gaps_ms(spans: Iterable[Span], name: str = "engine.queue") -> list[float]:
    """The gaps between consecutive starts of span ``name`` (requests reaching the engine)."""
    starts = sorted(_seconds(s["start_time"]) for s in spans if s["name"] == name)
    return [(b - a) * 1e3 for a, b in itertools.pairwise(starts)]


def _quantile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[int(q * (len(ordered) - 1))]


def format_report(spans: Sequence[Span]) -> str:
    marks = timeline(spans)
    lines = ["| step | n | p50 ms | p90 ms |", "|---|---:|---:|---:|"]
    for step, values in sorted(marks.items(), key=lambda kv: statistics.median(kv[1])):
        lines.append(
            f"| {step} | {len(values)} | {statistics.median(values):.2f} | "
            f"{_quantile(values, 0.9):.2f} |"
        )
    gaps = arrival_gaps_ms(spans)
    if gaps:
        quartiles = " / ".join(f"{_quantile(gaps, q):.1f}" for q in (0.1, 0.25, 0.5, 0.75, 0.9))
        close = sum(g < 1.0 for g in gaps) / len(gaps)
        lines += [
            "",
            f"arrivals at the engine: gaps p10 / p25 / p50 / p75 / p90 ms {quartiles}; "
            f"under 1 ms: {close:.0%}",
        ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("logs", nargs="+", type=Path, help="service logs with console spans")
    args = parser.parse_args(argv)
    spans = [s for path in args.logs for s in parse_spans(path.read_text(errors="replace"))]
    if not spans:
        print("no spans in these logs (run the services with --trace-exporter console)")
        return 1
    print(format_report(spans))
    return 0


if __name__ == "__main__":
    sys.exit(main())
