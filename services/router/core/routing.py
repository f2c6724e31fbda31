"""Routing policies: given the serving candidates for a request, pick one.

``make_policy`` builds a scheduler profile (``core/scheduler``: filters -> weighted scorers ->
picker) by name or from a YAML file; every policy, round-robin included, is a profile.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

from kvmesh.discovery.keys import WorkerId
from kvmesh.errors import InvalidArgument

from .scheduler import (
    BUILTIN_PROFILES,
    PluginEnv,
    PrefixIndex,
    Registry,
    TransferRates,
    build_scheduler,
    builtin_profile,
)
from .scheduler import load_profile as _load_profile
from .types import RouteDecision, RouteRequest
from .workers import WorkerView


class RoutingPolicy(Protocol):
    name: str

    def pick(self, request: RouteRequest, candidates: Sequence[WorkerView]) -> RouteDecision: ...

    def on_routed(self, request: RouteRequest, decision: RouteDecision) -> None:
        """The request was sent to ``decision.worker_id`` (once per attempt)."""

    def on_first_token(self, request: RouteRequest, worker_id: WorkerId) -> None:
        """The worker sent the first token (prefill done)."""

    def on_finished(self, request: RouteRequest, worker_id: WorkerId) -> None:
        """The attempt on ``worker_id`` ended, however it ended."""


POLICIES: dict[str, str] = BUILTIN_PROFILES  # built-in profile name -> its YAML


def make_policy(
    name: str,
    *,
    index: PrefixIndex | None = None,
    rng: random.Random | None = None,
    registry: Registry | None = None,
    transfer_rates: TransferRates | None = None,
) -> RoutingPolicy:
    """A built-in profile by name (round-robin, random, least-loaded, approximate-prefix,
    precise-prefix, precise-sticky), or a profile file when ``name`` ends in .yaml/.yml.
    ``index`` is the KV block index (a ``scheduler.PrefixIndex``) the precise profiles need."""
    env = PluginEnv(index=index, rng=rng or random.Random(), transfer_rates=transfer_rates)
    if name.endswith((".yaml", ".yml")):
        return _load_profile(Path(name), registry=registry, env=env)
    if name not in POLICIES:
        raise InvalidArgument(
            f"unknown routing policy {name!r}; choose one of {sorted(POLICIES)} or give a "
            "profile file (.yaml)"
        )
    return build_scheduler(builtin_profile(name), registry, env)
