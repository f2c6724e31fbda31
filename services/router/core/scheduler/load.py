"""Load scorers, from the workers' own reports and this router's ledger.

Counts are normalised as ``1 / (1 + x / half)``: 1 when idle, 0.5 at ``half``, towards 0 as
load grows. Unlike ``1 - x / max`` over the candidates, this does not depend on the other
candidates, so one waiting request more on an otherwise idle fleet is a small nudge, not a full
weight's swing against prefix affinity.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..workers import WorkerView, outstanding
from .params import check
from .plugins import CycleContext


def _check_half(half: float) -> None:
    check(half > 0, f"half is {half}; use a positive load at which the score is 0.5")


@dataclass(frozen=True, slots=True)
class QueueParams:
    half: float = 4.0  # waiting requests at which the score is 0.5

    def __post_init__(self) -> None:
        _check_half(self.half)


class QueueScorer:
    """Fewer requests waiting in the worker's queue (its own report) is better."""

    def __init__(self, name: str, params: QueueParams) -> None:
        self.name = name
        self._inv = 1.0 / params.half

    def score(self, ctx: CycleContext, candidates: Sequence[WorkerView]) -> Sequence[float]:
        inv = self._inv
        return [1.0 / (1.0 + max(v.load.waiting_requests, 0) * inv) for v in candidates]


@dataclass(frozen=True, slots=True)
class InFlightParams:
    half: float = 8.0  # outstanding requests at which the score is 0.5

    def __post_init__(self) -> None:
        _check_half(self.half)


class InFlightScorer:
    """Fewer outstanding requests is better: the larger of what this router sent the worker and
    what the worker reports (which includes other routers' requests)."""

    def __init__(self, name: str, params: InFlightParams) -> None:
        self.name = name
        self._inv = 1.0 / params.half

    def score(self, ctx: CycleContext, candidates: Sequence[WorkerView]) -> Sequence[float]:
        inv = self._inv
        return [1.0 / (1.0 + max(outstanding(v), 0) * inv) for v in candidates]


@dataclass(frozen=True, slots=True)
class InFlightTokensParams:
    half: float = 200_000.0  # prompt tokens in flight at which the score is 0.5
    # Count only tokens still to prefill (uncached, before the first token) instead of every
    # prompt token of a request in flight.
    prefill_only: bool = False

    def __post_init__(self) -> None:
        _check_half(self.half)


class InFlightTokensScorer:
    """Fewer prompt tokens sent by this router and not yet finished (or not yet prefilled) is
    better. Long-context agents make request counts a poor proxy for work."""

    def __init__(self, name: str, params: InFlightTokensParams) -> None:
        self.name = name
        self._inv = 1.0 / params.half
        self._prefill_only = params.prefill_only

    def score(self, ctx: CycleContext, candidates: Sequence[WorkerView]) -> Sequence[float]:
        inv = self._inv
        tally = ctx.ledger.tally
        if self._prefill_only:
            return [
                1.0 / (1.0 + tally(v.record.worker_id).prefill_tokens * inv) for v in candidates
            ]
        return [1.0 / (1.0 + tally(v.record.worker_id).prompt_tokens * inv) for v in candidates]


@dataclass(frozen=True, slots=True)
class NoParams:
    pass


class KvUsageScorer:
    """More free KV cache is better: ``1 - kv_cache_usage`` (the worker's report, in [0, 1])."""

    def __init__(self, name: str, params: NoParams) -> None:
        self.name = name

    def score(self, ctx: CycleContext, candidates: Sequence[WorkerView]) -> Sequence[float]:
        return [1.0 - min(max(v.load.kv_cache_usage, 0.0), 1.0) for v in candidates]
