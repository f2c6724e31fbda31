"""Load scorers, from the workers' own reports and this router's ledger.

Counts are normalised as ``1 / (1 + x / half)``: 1 when idle, 0.5 at ``half``, towards 0 as
load grows. Unlike ``1 - x / max`` over the candidates, this does not depend on the other
candidates, so one waiting request more on an otherwise idle fleet is a small nudge, not a full
weight's swing against prefix affinity.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..types import RouteDecision, RouteRequest
from ..workers import WorkerView, outstanding, waiting
from .params import NoParams, check
from .plugins import CycleContext


def _check_half(half: float) -> None:
    check(half > 0, f"half is {half}; use a positive load at which the score is 0.5")


@dataclass(frozen=True, slots=True)
class QueueParams:
    half: float = 4.0  # waiting requests at which the score is 0.5

    def __post_init__(self) -> None:
        _check_half(self.half)


class QueueScorer:
    """Fewer requests waiting in the worker's queue is better (its own report, or what this
    router sent beyond the requests it runs at once: ``workers.waiting``)."""

    def __init__(self, name: str, params: QueueParams) -> None:
        self.name = name
        self._inv = 1.0 / params.half

    def score(self, ctx: CycleContext, candidates: Sequence[WorkerView]) -> Sequence[float]:
        inv = self._inv
        return [1.0 / (1.0 + waiting(v) * inv) for v in candidates]


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


class KvUsageScorer:
    """More free KV cache is better: ``1 - kv_cache_usage`` (the worker's report, in [0, 1])."""

    def __init__(self, name: str, params: NoParams) -> None:
        self.name = name

    def score(self, ctx: CycleContext, candidates: Sequence[WorkerView]) -> Sequence[float]:
        return [1.0 - min(max(v.load.kv_cache_usage, 0.0), 1.0) for v in candidates]


@dataclass(frozen=True, slots=True)
class RoutedVolumeParams:
    # How fast old routing is forgotten, counted in routing decisions (not seconds, so replays in
    # virtual time and live routers behave alike): a request's weight halves after this many.
    half_life_requests: float = 400.0
    # "input": every prompt token routed counts; "uncached": only the tokens the winner was
    # predicted to compute (its prompt minus the prefix the index says it holds).
    count: str = "input"
    # How much the scores flatten with the share of the prompt some candidate already holds
    # (the profile's prefix match), in [0, 1]: 1 places cold sessions by volume and leaves warm
    # turns to prefix affinity (never migrates a session to even the load); 0 balances
    # regardless of what moving a warm session would recompute.
    yield_to_prefix: float = 0.5

    def __post_init__(self) -> None:
        check(self.half_life_requests > 0, "half_life_requests must be > 0")
        check(0.0 <= self.yield_to_prefix <= 1.0, "yield_to_prefix must be in [0, 1]")
        check(
            self.count in ("input", "uncached"), f"count is {self.count!r}; use input or uncached"
        )


class RoutedVolume:
    """Prompt tokens routed to each worker, decayed per routing decision: the count the
    ``routed-volume`` scorer scores and the ``volume-bound`` filter bounds (one instance,
    shared through the profile's ``CycleContext.volume_source``)."""

    __slots__ = ("_decay", "_n", "_uncached", "_volume")

    def __init__(self, half_life_requests: float, uncached: bool = False) -> None:
        self._decay = 0.5 ** (1.0 / half_life_requests)
        self._uncached = uncached
        self._n = 0
        self._volume: dict[str, tuple[float, int]] = {}  # worker -> (volume, decision number)

    def routed_volume(self, worker_id: str) -> float:
        """The worker's decayed routed tokens now (0 for a worker never routed to)."""
        value, at = self._volume.get(worker_id, (0.0, self._n))
        return float(value * self._decay ** (self._n - at))

    def on_routed(self, request: RouteRequest, decision: RouteDecision) -> None:
        tokens = float(request.prompt_tokens)
        e = decision.explanation
        if self._uncached and e is not None and e.cached_blocks > 0 and e.total_blocks > 0:
            block_tokens = request.prompt_tokens / max(e.total_blocks, 1)
            tokens = max(tokens - e.cached_blocks * block_tokens, 0.0)
        wid = decision.worker_id
        self._n += 1
        self._volume[wid] = (self.routed_volume(wid) + tokens, self._n)


class RoutedVolumeScorer:
    """Less recent routed volume (prompt tokens, decayed per decision) is better, relative to the
    candidates' mean: 1 at no volume, 0.5 at the mean, 0.25 at three times the mean. Request
    counts and queues are instantaneous; agent sessions are long and uneven, so new sessions go
    where the recent volume is lowest and the fleet's share of tokens stays even. The profile's
    first routed-volume scorer is its volume source (``volume``, read by ``volume-bound``)."""

    def __init__(self, name: str, params: RoutedVolumeParams) -> None:
        self.name = name
        self.volume = RoutedVolume(params.half_life_requests, params.count == "uncached")
        self._yield = params.yield_to_prefix

    def score(self, ctx: CycleContext, candidates: Sequence[WorkerView]) -> Sequence[float]:
        now = self.volume.routed_volume
        vols = [now(v.record.worker_id) for v in candidates]
        mean = sum(vols) / len(vols) if vols else 0.0
        if mean <= 0.0:
            return [1.0] * len(candidates)
        keep = 1.0
        total = len(ctx.request.block_hashes)
        if self._yield and total:
            best = max((m.blocks for m in ctx.prefix().values()), default=0)
            keep = 1.0 - self._yield * min(best / total, 1.0)
        return [1.0 - keep * (1.0 - 1.0 / (1.0 + x / mean)) for x in vols]

    def on_routed(self, request: RouteRequest, decision: RouteDecision) -> None:
        self.volume.on_routed(request, decision)
