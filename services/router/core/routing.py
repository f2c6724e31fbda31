"""Routing policies: given the serving candidates for a request, pick one.

This is the small interface the precise prefix-cache scheduler (filters -> scorers -> picker)
will plug into; for now there is least-loaded, plus round-robin and random as baselines.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from typing import Protocol

from kvmesh.errors import InvalidArgument, Unavailable

from .types import RouteDecision, RouteRequest
from .workers import WorkerView


class RoutingPolicy(Protocol):
    name: str

    def pick(self, request: RouteRequest, candidates: Sequence[WorkerView]) -> RouteDecision: ...


def outstanding(view: WorkerView) -> int:
    """Requests a worker is busy with: the larger of what this router sent it and what the
    worker reports (other routers' requests show up only in the worker's report)."""
    return max(view.router_in_flight, view.load.in_flight_requests)


class LeastLoaded:
    """Fewest outstanding requests, then most free KV cache; ties broken at random."""

    name = "least-loaded"

    def __init__(self, rng: random.Random | None = None) -> None:
        self._rng = rng or random.Random()

    def pick(self, request: RouteRequest, candidates: Sequence[WorkerView]) -> RouteDecision:
        _require(request, candidates)
        keys = [(outstanding(v), round(v.load.kv_cache_usage, 3)) for v in candidates]
        best = min(keys)
        tied = [v for v, k in zip(candidates, keys, strict=True) if k == best]
        chosen = self._rng.choice(tied)
        return RouteDecision(
            worker_id=chosen.record.worker_id,
            policy=self.name,
            reason=f"outstanding={best[0]} kv_usage={best[1]:.3f} tied={len(tied)}",
        )


class RoundRobin:
    name = "round-robin"

    def __init__(self) -> None:
        self._next = 0

    def pick(self, request: RouteRequest, candidates: Sequence[WorkerView]) -> RouteDecision:
        _require(request, candidates)
        chosen = candidates[self._next % len(candidates)]
        self._next += 1
        return RouteDecision(chosen.record.worker_id, self.name, "turn")


class RandomPick:
    name = "random"

    def __init__(self, rng: random.Random | None = None) -> None:
        self._rng = rng or random.Random()

    def pick(self, request: RouteRequest, candidates: Sequence[WorkerView]) -> RouteDecision:
        _require(request, candidates)
        return RouteDecision(
            self._rng.choice(list(candidates)).record.worker_id, self.name, "random"
        )


def _require(request: RouteRequest, candidates: Sequence[WorkerView]) -> None:
    if not candidates:
        raise Unavailable(
            f"no serving worker for model {request.model!r}; start a worker or wait for one "
            "to register"
        )


POLICIES: dict[str, Callable[[], RoutingPolicy]] = {
    LeastLoaded.name: LeastLoaded,
    RoundRobin.name: RoundRobin,
    RandomPick.name: RandomPick,
}


def make_policy(name: str) -> RoutingPolicy:
    try:
        return POLICIES[name]()
    except KeyError:
        raise InvalidArgument(
            f"unknown routing policy {name!r}; choose one of {sorted(POLICIES)}"
        ) from None
