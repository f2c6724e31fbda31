"""Routing policies: given the serving candidates for a request, pick one.

``make_policy`` builds a scheduler profile (``core/scheduler``: filters -> weighted scorers ->
picker) by name or from a YAML file. The three small classes below are the original
hand-written policies, kept as references for the profiles of the same names.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

from kvmesh.discovery.keys import WorkerId
from kvmesh.errors import InvalidArgument, Unavailable

from .scheduler import (
    BUILTIN_PROFILES,
    PluginEnv,
    PrefixIndex,
    Registry,
    build_scheduler,
    builtin_profile,
)
from .scheduler import load_profile as _load_profile
from .types import RouteDecision, RouteRequest
from .workers import WorkerView, outstanding


class RoutingPolicy(Protocol):
    name: str

    def pick(self, request: RouteRequest, candidates: Sequence[WorkerView]) -> RouteDecision: ...

    def on_routed(self, request: RouteRequest, decision: RouteDecision) -> None:
        """The request was sent to ``decision.worker_id`` (once per attempt)."""

    def on_first_token(self, request: RouteRequest, worker_id: WorkerId) -> None:
        """The worker sent the first token (prefill done)."""

    def on_finished(self, request: RouteRequest, worker_id: WorkerId) -> None:
        """The attempt on ``worker_id`` ended, however it ended."""


class _Stateless:
    """No-op feedback hooks for policies that learn nothing."""

    def on_routed(self, request: RouteRequest, decision: RouteDecision) -> None:
        pass

    def on_first_token(self, request: RouteRequest, worker_id: WorkerId) -> None:
        pass

    def on_finished(self, request: RouteRequest, worker_id: WorkerId) -> None:
        pass


class LeastLoaded(_Stateless):
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


class RoundRobin(_Stateless):
    name = "round-robin"

    def __init__(self) -> None:
        self._next = 0

    def pick(self, request: RouteRequest, candidates: Sequence[WorkerView]) -> RouteDecision:
        _require(request, candidates)
        chosen = candidates[self._next % len(candidates)]
        self._next += 1
        return RouteDecision(chosen.record.worker_id, self.name, "turn")


class RandomPick(_Stateless):
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


POLICIES: dict[str, str] = BUILTIN_PROFILES  # built-in profile name -> its YAML


def make_policy(
    name: str,
    *,
    index: PrefixIndex | None = None,
    rng: random.Random | None = None,
    registry: Registry | None = None,
) -> RoutingPolicy:
    """A built-in profile by name (round-robin, random, least-loaded, approximate-prefix,
    precise-prefix, precise-sticky), or a profile file when ``name`` ends in .yaml/.yml.
    ``index`` is the KV block index (a ``scheduler.PrefixIndex``) the precise profiles need."""
    env = PluginEnv(index=index, rng=rng or random.Random())
    if name.endswith((".yaml", ".yml")):
        return _load_profile(Path(name), registry=registry, env=env)
    if name not in POLICIES:
        raise InvalidArgument(
            f"unknown routing policy {name!r}; choose one of {sorted(POLICIES)} or give a "
            "profile file (.yaml)"
        )
    return build_scheduler(builtin_profile(name), registry, env)
