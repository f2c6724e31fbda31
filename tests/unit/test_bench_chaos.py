"""``kvmesh bench chaos``'s accounting: outcomes per API and greedy outputs against the
no-fault run, turn by turn."""

from __future__ import annotations

from benchmarks.chaos.cli import format_table, summarize
from benchmarks.chaos.sessions import (
    FAILED_BEFORE_FIRST,
    FAILED_MID,
    HUNG,
    OK,
    LoadResult,
    TurnResult,
)


def turn(api: str, s: int, t: int, outcome: str = OK, out: str = "1,2", **kw) -> TurnResult:
    return TurnResult((api, s, 0, t), outcome, kw.pop("latency_s", 1.0), out, **kw)


def test_summarize_counts_and_compares_turn_by_turn():
    baseline = LoadResult(
        [turn("grpc", 0, 0), turn("grpc", 0, 1, out="3"), turn("grpc", 1, 0), turn("http", 0, 0)]
    )
    run = LoadResult(
        [
            turn("grpc", 0, 0, resumes=1, prompt_tokens=400, recomputed_tokens=20),  # same output
            turn("grpc", 0, 1, out="4"),  # differs from the no-fault run's
            turn("grpc", 1, 0, FAILED_MID, error="UNAVAILABLE: gone"),
            turn("grpc", 2, 0, FAILED_BEFORE_FIRST, error="UNAVAILABLE: gone"),
            turn("grpc", 3, 0, HUNG),
            turn("grpc", 0, 2),  # no such turn in the no-fault run: not compared
            turn("http", 0, 0),
        ]
    )
    row = summarize("kill-worker", run, baseline, "grpc")
    assert (row.sent, row.ok, row.failed_mid, row.failed_before_first, row.hung) == (6, 3, 1, 1, 1)
    assert row.resumed == 1 and row.recomputed_share == 0.05
    assert (row.identical, row.compared) == (1, 2)
    assert row.errors == ("UNAVAILABLE: gone",)
    http = summarize("kill-worker", run, baseline, "http")
    assert (http.sent, http.ok, http.identical, http.compared) == (1, 1, 1, 1)
    table = format_table([row, http])
    assert "| kill-worker | grpc | 6 | 3 | 1 | 1 | 1 | 1 |" in table
    assert "| 1 / 2 | 5.0% |" in table
    assert "kill-worker grpc: UNAVAILABLE: gone" in table
