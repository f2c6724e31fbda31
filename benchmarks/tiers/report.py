"""Figures of ``kvmesh bench tiers`` and how they are printed (pure: no I/O, no timing).

A ``Figure`` is one measurement beside the limit it is compared with, measured in the same run:
offload beside memcpy, disk promotion beside a raw sequential read, peer fetch beside raw TCP,
a cached TTFT beside recompute. Its JSON row carries ``<name>_<unit>``, ``<limit>_<unit>`` and
their ratio ``<name>_over_<limit>`` (e.g. ``offload_gbps``, ``memcpy_gbps``,
``offload_over_memcpy``).
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

KiB = 1 << 10
MiB = 1 << 20

UNITS = {"gbps": "GB/s", "ms": "ms"}


@dataclass(frozen=True, slots=True)
class Figure:
    """One measured figure and its limit. ``value`` and ``limit`` share ``unit`` (``gbps``: 1e9
    bytes per second of wall time; ``ms``: milliseconds)."""

    title: str  # the table's first column, e.g. "worker -> kvmanager offload"
    name: str  # JSON stem of the measurement, e.g. "offload"
    value: float | None  # None: not measured (``notes`` says why)
    limit_name: str  # JSON stem of the limit, e.g. "memcpy"
    limit: float | None
    unit: str  # a key of UNITS
    block_bytes: int | None = None
    path: str = ""  # what exactly was measured
    limit_path: str = ""  # what exactly the limit is
    ratio_key: str = ""  # default: <name>_over_<limit_name>
    notes: str = ""
    extra: Mapping[str, Any] = field(default_factory=dict)  # more JSON fields (counts, flags)

    def __post_init__(self) -> None:
        if self.unit not in UNITS:
            raise ValueError(f"unit must be one of {sorted(UNITS)}, got {self.unit!r}")

    @property
    def ratio(self) -> float | None:
        return ratio(self.value, self.limit)

    def to_json(self) -> dict[str, Any]:
        row: dict[str, Any] = {"figure": self.name}
        if self.block_bytes is not None:
            row["block_bytes"] = self.block_bytes
        row[f"{self.name}_{self.unit}"] = self.value
        row[f"{self.limit_name}_{self.unit}"] = self.limit
        row[self.ratio_key or f"{self.name}_over_{self.limit_name}"] = self.ratio
        row["path"] = self.path
        row["limit_path"] = self.limit_path
        if self.notes:
            row["notes"] = self.notes
        row.update(self.extra)
        return row


def ratio(value: float | None, limit: float | None) -> float | None:
    """``value / limit``; None when either is missing or the limit is not positive."""
    if value is None or limit is None or limit <= 0:
        return None
    return value / limit


def median(xs: Iterable[float]) -> float | None:
    values = list(xs)
    return statistics.median(values) if values else None


def gbps(nbytes: int, seconds: float) -> float:
    """1e9 bytes per second."""
    return nbytes / seconds / 1e9 if seconds > 0 else float("inf")


def fmt_size(nbytes: int | None) -> str:
    """32 KiB, 2 MiB, 1.5 MiB, 100 B; '-' for None."""
    if nbytes is None:
        return "-"
    for unit, size in (("GiB", 1 << 30), ("MiB", MiB), ("KiB", KiB)):
        if nbytes >= size:
            q = nbytes / size
            return f"{q:.0f} {unit}" if q == int(q) else f"{q:.1f} {unit}"
    return f"{nbytes} B"


def fmt_value(value: float | None, unit: str) -> str:
    if value is None:
        return "-"
    if unit == "gbps":
        return f"{value:.2f} {UNITS[unit]}"
    return f"{value:.1f} {UNITS[unit]}"


def fmt_ratio(r: float | None) -> str:
    return "-" if r is None else f"{r:.2f}x"


def format_table(figures: Sequence[Figure]) -> str:
    """The markdown table: one row per figure."""
    lines = [
        "| figure | block | measured | limit (same run) | ratio | how | notes |",
        "|---|---|---|---|---|---|---|",
    ]
    for f in figures:
        limit = f"{f.limit_name.replace('_', ' ')} {fmt_value(f.limit, f.unit)}"
        how = f.path + (f"; limit: {f.limit_path}" if f.limit_path else "")
        lines.append(
            f"| {f.title} | {fmt_size(f.block_bytes)} | {fmt_value(f.value, f.unit)} | {limit}"
            f" | {fmt_ratio(f.ratio)} | {how} | {f.notes} |"
        )
    return "\n".join(lines)
