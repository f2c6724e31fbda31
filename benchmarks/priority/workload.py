"""The priority mix (after llm-d-benchmark's priority-mix harness): who sends what, and the
report. Pure: arrival times, prompts and the per-tenant summary; ``cli.py`` runs the mesh.

Three tenants on one fleet:

- ``interactive`` (high band): a steady rate of short turns on a shared system prompt;
- ``batch`` (low band): long prompts on a cached document prefix, bursting to a multiple of the
  fleet's measured capacity;
- ``flood`` (low band): cold prompts (nothing cached), at the fleet's capacity.

Reported per tenant: requests sent, answered, refused (429 / RESOURCE_EXHAUSTED) and failed,
time to first token p50 / p99, answered per second, uncached prompt tokens served, and the
refusals' latency; for the batch and flood tenants (one band), Jain's fairness index over their
uncached tokens served while both had requests waiting.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

OK, REJECTED, FAILED = "ok", "rejected", "failed"
# A refusal's kind: at arrival (a full queue, a predicted wait past the TTL), or after waiting
# (its place taken by another tenant's request or a higher band's, or the TTL ran out).
ARRIVAL, AFTER_WAIT = "at-arrival", "after-waiting"
VOCAB = 30_000  # token ids drawn below this (the simulator takes any id < its vocab)


@dataclass(frozen=True, slots=True)
class TenantLoad:
    name: str
    priority: int
    shared_tokens: int  # a prefix all its requests share (cached after the first)
    new_tokens: int  # unique tokens per request, after the prefix
    output_tokens: int
    rate_per_s: float  # requests per second, evenly spaced
    start_s: float = 0.0  # from the phase's start
    duration_s: float = 0.0
    vocab: int = VOCAB  # token ids drawn below this (a real model's vocabulary size)

    def arrivals(self) -> list[float]:
        """Send times from the phase's start: steady, ``rate_per_s`` over ``duration_s``."""
        if self.rate_per_s <= 0 or self.duration_s <= 0:
            return []
        n = int(self.rate_per_s * self.duration_s)
        return [self.start_s + i / self.rate_per_s for i in range(n)]

    def prompt(self, i: int, seed: int = 0) -> list[int]:
        """Request ``i``'s token ids: the tenant's shared prefix, then its own tokens."""
        shared = random.Random(f"{seed}:{self.name}:shared")
        own = random.Random(f"{seed}:{self.name}:{i}")
        return [shared.randrange(1, self.vocab) for _ in range(self.shared_tokens)] + [
            own.randrange(1, self.vocab) for _ in range(self.new_tokens)
        ]


@dataclass(frozen=True, slots=True)
class Result:
    tenant: str
    sent_s: float  # from the run's start
    end_s: float
    status: str  # OK, REJECTED, FAILED
    first_token_s: float | None = None  # from sending
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    retry_after_s: float | None = None  # a refusal's
    detail: str = ""  # a failure's status code; a refusal's kind (ARRIVAL or a later one)
    engine_queue_s: float = 0.0  # in the serving engine's queue (usage.queue_time_s)
    engine_prefill_s: float = 0.0  # its prefill there (usage.prefill_time_s)

    @property
    def uncached_tokens(self) -> int:
        return max(self.prompt_tokens - self.cached_tokens, 0)


def percentile(xs: Sequence[float], q: float) -> float:
    """The q-th percentile (nearest rank); NaN for none."""
    if not xs:
        return math.nan
    s = sorted(xs)
    k = max(math.ceil(q / 100.0 * len(s)) - 1, 0)
    return s[min(k, len(s) - 1)]


def jain(xs: Sequence[float]) -> float:
    """Jain's fairness index: 1 when all equal, 1/n when one has everything."""
    if not xs or not any(xs):
        return math.nan
    return sum(xs) ** 2 / (len(xs) * sum(x * x for x in xs))


@dataclass(frozen=True, slots=True)
class TenantRow:
    phase: str
    tenant: str
    sent: int
    ok: int
    rejected: int
    failed: int
    ttft_p50_s: float
    ttft_p99_s: float
    ok_per_s: float
    uncached_tokens: int
    reject_p99_s: float  # time to a refusal at arrival
    rejected_after_wait: int  # refusals after waiting (displaced, pre-empted, TTL)
    engine_p50_s: float  # in the engine before the first token (its queue + prefill)


def summarize(phase: str, results: Iterable[Result], window_s: float) -> list[TenantRow]:
    by: dict[str, list[Result]] = {}
    for r in results:
        by.setdefault(r.tenant, []).append(r)
    rows = []
    for tenant, rs in sorted(by.items()):
        ok = [r for r in rs if r.status == OK]
        rej = [r for r in rs if r.status == REJECTED]
        ttft = [r.first_token_s for r in ok if r.first_token_s is not None]
        rows.append(
            TenantRow(
                phase,
                tenant,
                len(rs),
                len(ok),
                len(rej),
                sum(1 for r in rs if r.status == FAILED),
                percentile(ttft, 50),
                percentile(ttft, 99),
                len(ok) / window_s if window_s > 0 else math.nan,
                sum(r.uncached_tokens for r in ok),
                percentile([r.end_s - r.sent_s for r in rej if r.detail == ARRIVAL], 99),
                sum(1 for r in rej if r.detail != ARRIVAL),
                percentile([r.engine_queue_s + r.engine_prefill_s for r in ok], 50),
            )
        )
    return rows


def served_between(
    results: Iterable[Result], tenant: str, t0: float, t1: float, handed_off: bool = False
) -> int:
    """Uncached prompt tokens of ``tenant``'s requests answered (first token) in [t0, t1);
    ``handed_off``: instead those the router handed to an engine in [t0, t1) (first token less
    the engine's queue and prefill: when the admission let them go, whatever their prefill
    then took)."""
    total = 0
    for r in results:
        if r.tenant != tenant or r.status != OK or r.first_token_s is None:
            continue
        at = r.sent_s + r.first_token_s
        if handed_off:
            at -= r.engine_queue_s + r.engine_prefill_s
        if t0 <= at < t1:
            total += r.uncached_tokens
    return total


def format_rows(rows: Sequence[TenantRow]) -> str:
    head = (
        "| phase | tenant | sent | ok | 429 (after waiting) | failed | TTFT p50 | TTFT p99 "
        "| in engine p50 | ok/s | uncached tokens | 429 at arrival p99 |"
    )
    lines = [head, "|" + "---|" * 12]
    for r in rows:
        lines.append(
            f"| {r.phase} | {r.tenant} | {r.sent} | {r.ok} | {r.rejected} "
            f"({r.rejected_after_wait}) | {r.failed} | {_s(r.ttft_p50_s)} | {_s(r.ttft_p99_s)} "
            f"| {_s(r.engine_p50_s)} | {r.ok_per_s:.2f} | {r.uncached_tokens:,} "
            f"| {_s(r.reject_p99_s)} |"
        )
    return "\n".join(lines)


def _s(x: float) -> str:
    if math.isnan(x):
        return "-"
    return f"{x * 1000:.0f} ms" if x < 1.0 else f"{x:.2f} s"
