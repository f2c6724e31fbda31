"""kvmesh bench speculative's arithmetic and table (the engines it runs are in
tests/integration/test_speculative_vllm.py's territory; the benchmark itself is run by hand)."""

from __future__ import annotations

import math

from benchmarks.speculative import Row, format_table, with_ratios
from kvmesh.cli import build_parser


def row(method: str, model: str, tok_s: float, drafted: int = 0, accepted: int = 0) -> Row:
    return Row(
        method,
        model,
        4,
        400,
        tok_s,
        2 * tok_s,
        10.0 / tok_s,
        20.0,
        5.0,
        drafted,
        accepted,
        drafted // 2,
    )


def test_ratios_are_to_none_on_the_same_model() -> None:
    rows = with_ratios(
        [
            row("none", "tiny", 100),
            row("ngram", "tiny", 150, 30, 12),
            row("mtp", "tiny-mtp", 80, 10),
        ]
    )
    assert rows[1].single_ratio == 1.5 and rows[1].batch_ratio == 1.5
    assert math.isclose(rows[1].itl_p50_ratio, 100 / 150)
    assert math.isnan(rows[2].single_ratio)  # no plain run of tiny-mtp: no ratio, not a wrong one
    assert rows[1].acceptance == 0.4 and rows[1].accepted_per_draft == 12 / 15
    table = format_table(rows)
    assert "| ngram | tiny | 150 | 300 |" in table and "12/30 = 40.0%" in table
    assert table.splitlines()[-1].endswith("| 0/10 = 0.0% | 0.00 | - |")


def test_the_subcommand_is_registered() -> None:
    a = build_parser().parse_args(
        ["bench", "speculative", "--methods", "none,mtp", "--sequential", "2"]
    )
    assert (a.methods, a.sequential, a.concurrency) == ("none,mtp", 2, 8)
