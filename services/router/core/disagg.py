"""Prefill/decode disaggregation: the per-request decision (a "profile handler", after llm-d's
P/D handler). Pure: no grpc, etcd or I/O; the servicer carries the decision out (its prefill
half: ``services/router/prefill.py``).

One request, two scheduling cycles over the same routing policy:

1. **decode**: the policy picks among the decode-capable workers (role ``decode`` or ``both``),
   by load and by what each holds (the policy's scorers, e.g. the cost model and the prefix
   scorer). The pick's predicted cache hit gives the *uncached* part of the prompt on it.
2. **prefill**, only when that uncached part is at least ``threshold_tokens`` and the mesh has
   dedicated prefill workers: the policy picks among the prefill-capable workers (role
   ``prefill`` or ``both``, not the decode pick, and able to hand the KV over: a node
   kvmanager, and blocks of the decode pick's KV layout), so the best prefix score wins.
   With ``placement.mode`` ``joint`` (the default) the pair is then settled by an estimated
   cost (``placement.py``): the profile's two picks, or a prefill worker on the decode worker's
   node (the hand-off free: one kvmanager), or a near-best decode worker on another prefill
   worker's node, whichever costs least in prefill compute + bytes handed across nodes /
   bandwidth + queueing (pairs of one KV layout only).

Otherwise the request is served aggregated on the decode pick (a ``decode`` worker is a full
engine: it prefills short prompts itself). A mesh of ``both`` workers only is never
disaggregated: ``kvmesh up`` without roles behaves as before.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from enum import StrEnum
from typing import Protocol

from kvmesh.discovery.keys import Role, WorkerId
from kvmesh.errors import InvalidArgument, Unavailable
from kvmesh.settings import setting

from .placement import (
    JointPlacer,
    PairCost,
    Placement,
    PlacementConfig,
    PrefixFn,
    layouts_match,
    profile_prefix,
)
from .types import RouteDecision, RouteRequest
from .workers import WorkerView

DECODE_ROLES = frozenset({Role.DECODE, Role.BOTH})
PREFILL_ROLES = frozenset({Role.PREFILL, Role.BOTH})


class Policy(Protocol):
    """What the handler needs of a routing policy (``RoutingPolicy`` has it)."""

    def pick(self, request: RouteRequest, candidates: Sequence[WorkerView]) -> RouteDecision: ...


@dataclass(frozen=True, slots=True)
class DisaggConfig:
    enabled: bool = setting(
        True, "consider disaggregating (only ever when prefill workers exist)", flag="--disagg"
    )
    # Disaggregate when the decode pick would prefill at least this many prompt tokens itself
    # (prompt minus its predicted cache hit). Shorter prefills stall its decoding neighbours
    # less than a hand-off costs.
    threshold_tokens: int = setting(
        1024, "disaggregate when the decode worker would prefill at least this many tokens"
    )
    # Deadline of the prefill call, seconds (also bounded by the request's own deadline); on
    # expiry the request is served aggregated on the decode worker.
    prefill_timeout_s: float = setting(
        30.0, "deadline of the prefill call, seconds; then the decode worker recomputes"
    )
    # Send the decode request together with the prefill, not after it: the decode worker
    # waits (up to the prefill's deadline) for the blocks, fetching each as its prefill chunk
    # lands, so the transfer of the first blocks overlaps the prefill of the rest.
    overlap: bool = setting(
        True,
        "send the decode request with the prefill, the decode worker fetching the blocks as "
        "the prefill saves them (off: only after the prefill finished)",
    )
    # How the prefill and decode workers are chosen: jointly by cost (default) or independently.
    placement: PlacementConfig = setting(
        factory=PlacementConfig, doc="how the pair of workers is chosen", prefix=""
    )

    def __post_init__(self) -> None:
        if self.threshold_tokens < 1:
            raise InvalidArgument(
                f"disaggregation threshold_tokens is {self.threshold_tokens}; use 1 or more"
            )
        if not self.prefill_timeout_s > 0:
            raise InvalidArgument(
                f"disaggregation prefill_timeout_s is {self.prefill_timeout_s}; use > 0 seconds"
            )


class Reason(StrEnum):
    """Why a request was (not) disaggregated; a closed set, safe as a metric label."""

    DISAGGREGATED = "disaggregated"
    DISABLED = "disabled"  # config.enabled is False
    NO_PREFILL_WORKERS = "no-prefill-workers"  # no worker of role prefill serves the model
    BELOW_THRESHOLD = "below-threshold"  # the decode pick's uncached part is short
    NO_PREFILL_CANDIDATE = "no-prefill-candidate"  # none left that can hand its KV over


@dataclass(frozen=True, slots=True)
class DisaggDecision:
    decode: RouteDecision  # where the request is decoded (and, when aggregated, prefilled)
    prefill: RouteDecision | None  # None: aggregated
    reason: Reason
    uncached_tokens: int  # prompt tokens the decode pick would have to prefill itself
    placement: PairCost | None = None  # joint placement: the chosen pair's estimated cost

    @property
    def disaggregated(self) -> bool:
        return self.prefill is not None


class DisaggHandler:
    """``decide(request, candidates)``: aggregated or disaggregated, and on which workers.
    ``can_hand_off(worker_id)``: the worker's blocks reach a kvmanager another worker can load
    from (the servicer: the index links it to a node store). ``prefix``: each candidate's
    matched prefix, for joint placement (default: the prefill policy's own prefix source)."""

    def __init__(
        self,
        config: DisaggConfig,
        policy: Policy,
        *,
        prefill_policy: Policy | None = None,
        can_hand_off: Callable[[WorkerId], bool] = lambda _w: True,
        prefix: PrefixFn | None = None,
    ) -> None:
        self.config = config
        self._decode_policy = policy
        self._prefill_policy = prefill_policy or policy
        self._can_hand_off = can_hand_off
        self._placer: JointPlacer | None = None
        if config.placement.mode is Placement.JOINT:
            self._placer = JointPlacer(
                config.placement, prefix or profile_prefix(self._prefill_policy)
            )

    def pick_decode(self, request: RouteRequest, candidates: Sequence[WorkerView]) -> RouteDecision:
        """The decode worker (or the only worker of an aggregated request)."""
        cands = [v for v in candidates if v.record.role in DECODE_ROLES]
        if not cands:
            raise Unavailable(
                f"no decode-capable worker (role decode or both) serves model {request.model!r} "
                f"({len(candidates)} prefill-only candidate(s)); start one with --role decode"
            )
        return self._decode_policy.pick(replace(request, role=Role.DECODE), cands)

    def decide(self, request: RouteRequest, candidates: Sequence[WorkerView]) -> DisaggDecision:
        decode = self.pick_decode(request, candidates)
        e = decode.explanation
        cached = e.cached_tokens if e is not None and e.cached_tokens > 0 else 0
        uncached = max(request.prompt_tokens - cached, 0)
        reason = self._gate(candidates, uncached)
        if reason is not None:
            return DisaggDecision(decode, None, reason, uncached)
        # Only a worker whose blocks the decode pick can load (the same KV layout: a decode
        # worker with a speculative drafter needs a prefill worker with the same drafter).
        picked = next(v for v in candidates if v.record.worker_id == decode.worker_id)
        prefill_cands = [
            v
            for v in candidates
            if v.record.role in PREFILL_ROLES
            and v.record.worker_id != decode.worker_id
            and self._can_hand_off(v.record.worker_id)
            and layouts_match(v, picked)
        ]
        if not prefill_cands:
            return DisaggDecision(decode, None, Reason.NO_PREFILL_CANDIDATE, uncached)
        prefill = self._prefill_policy.pick(replace(request, role=Role.PREFILL), prefill_cands)
        if self._placer is not None:
            decode_cands = [v for v in candidates if v.record.role in DECODE_ROLES]
            placed = self._placer.place(
                request, decode, decode_cands, prefill, prefill_cands, self.config.threshold_tokens
            )
            if placed is not None:
                d, p, cost = placed
                return DisaggDecision(
                    d, p, Reason.DISAGGREGATED, cost.decode_uncached_tokens, placement=cost
                )
        return DisaggDecision(decode, prefill, Reason.DISAGGREGATED, uncached)

    def _gate(self, candidates: Sequence[WorkerView], uncached: int) -> Reason | None:
        if not self.config.enabled:
            return Reason.DISABLED
        if not any(v.record.role is Role.PREFILL for v in candidates):
            return Reason.NO_PREFILL_WORKERS
        if uncached < self.config.threshold_tokens:
            return Reason.BELOW_THRESHOLD
        return None
