"""Built-in filters: serving state, model, role, a bound on the routed volume."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from kvmesh.discovery.keys import Role
from kvmesh.kv.events import BlockHash

from ..types import RouteDecision, RouteRequest
from ..workers import WorkerView
from .params import NoParams, check
from .plugins import CycleContext


class ServingFilter:
    """Workers in state ``serving`` (draining ones take no new work)."""

    def __init__(self, name: str, params: NoParams) -> None:
        self.name = name

    def filter(self, ctx: CycleContext, candidates: Sequence[WorkerView]) -> Sequence[WorkerView]:
        return [v for v in candidates if v.serving]


class ModelFilter:
    """Workers serving the request's model."""

    def __init__(self, name: str, params: NoParams) -> None:
        self.name = name

    def filter(self, ctx: CycleContext, candidates: Sequence[WorkerView]) -> Sequence[WorkerView]:
        model = ctx.request.model
        return [v for v in candidates if v.record.model == model]


@dataclass(frozen=True, slots=True)
class RoleParams:
    # Worker roles accepted; empty: ``both`` and the request's own role.
    accept: tuple[Role, ...] = ()


class RoleFilter:
    """Workers whose role can run the stage the request needs: by default a worker of role
    ``both`` or of the request's role (a plain request, role ``both``, goes to ``both``)."""

    def __init__(self, name: str, params: RoleParams) -> None:
        self.name = name
        self._accept = frozenset(params.accept)

    def filter(self, ctx: CycleContext, candidates: Sequence[WorkerView]) -> Sequence[WorkerView]:
        accept = self._accept or {Role.BOTH, ctx.request.role}
        if all(v.record.role in accept for v in candidates):
            return candidates
        return [v for v in candidates if v.record.role in accept]


@dataclass(frozen=True, slots=True)
class VolumeBoundParams:
    # A candidate whose recent routed volume (the profile's routed-volume count: decayed prompt
    # tokens) exceeds this multiple of the candidates' mean is dropped, unless all would be.
    # At >= 1 the least loaded always passes; below 1 an even fleet drops all (then all stay).
    max_over_mean: float = 1.1
    # A candidate holding at least this share of the request's blocks in its engine's (GPU)
    # cache is never dropped: a warm session's turn stays with its cache, only new work is
    # turned away. 0: none spared (the bound is hard).
    spare_gpu_share: float = 0.0
    # None: the bound is hard (past it, a candidate goes whatever the move costs). A number:
    # a candidate past the bound goes only when one within it has an estimated time to first
    # token (the profile's ttft-cost scorer's: queue + fetch of the prefix it lacks from the
    # best tier or peer + prefill of what nobody holds + the cache it displaces) of at most
    # ``move_factor`` x its own + ``move_slack_s``: moves that cost that little more. Needs a
    # ttft-cost scorer in the profile (weight 0 keeps it an estimate only).
    move_slack_s: float | None = None
    move_factor: float = 1.0
    # Seconds of slack added per unit of a candidate's volume past the bound, in units of the
    # candidates' mean (a worker at 1.2x the mean under a 1.1 bound gets 0.1 x this more): the
    # further a worker runs past the bound, the dearer a move it gives up. 0: a flat slack.
    move_slack_per_excess_s: float = 0.0
    # The most that slack grows to (seconds); None: no cap. Keeps the moves a growing slack
    # allows to those a short reload makes cheap (a long warm context never goes).
    move_slack_max_s: float | None = None
    # Judge each candidate by its volume with this request added (and the mean with it): a
    # worker just under the bound does not take a request that would carry it past. False:
    # by the volume before it.
    prospective: bool = False
    # 0: off. > 0: a candidate's slack is multiplied by 1 + the number of recent requests
    # routed to a worker holding the prefix it holds on its GPU (the same block at the same
    # depth), decayed with this half-life in decisions, at most ``move_slack_max_s``: a move's
    # reload is paid once per copy of a prefix, and the requests of a recurring prefix that
    # follow it hit the new copy (a prefix seen r times moves at (1 + r) x the slack).
    recurrence_half_life_requests: float = 0.0

    def __post_init__(self) -> None:
        check(
            self.max_over_mean > 0.0,
            f"max_over_mean is {self.max_over_mean}; use a positive ratio (1.1: drop a worker "
            "past 1.1x the candidates' mean routed volume)",
        )
        check(
            0.0 <= self.spare_gpu_share <= 1.0,
            f"spare_gpu_share is {self.spare_gpu_share}; use a share in [0, 1] (0: spare none)",
        )
        check(
            self.move_slack_s is None or self.move_slack_s >= 0.0,
            f"move_slack_s is {self.move_slack_s}; use seconds >= 0 (or leave it out for a "
            "hard bound)",
        )
        check(
            self.move_factor >= 1.0,
            f"move_factor is {self.move_factor}; use a ratio >= 1 (1: a move may cost only "
            "move_slack_s more than staying)",
        )
        check(
            self.move_slack_per_excess_s >= 0.0,
            f"move_slack_per_excess_s is {self.move_slack_per_excess_s}; use seconds >= 0 "
            "(0: the slack does not grow with the excess)",
        )
        check(
            self.move_slack_max_s is None or self.move_slack_max_s >= (self.move_slack_s or 0.0),
            f"move_slack_max_s is {self.move_slack_max_s}; use seconds >= move_slack_s (or "
            "leave it out for no cap)",
        )
        check(
            self.recurrence_half_life_requests >= 0.0,
            f"recurrence_half_life_requests is {self.recurrence_half_life_requests}; use "
            "decisions >= 0 (0: the slack does not grow with a prefix's recurrence)",
        )


def within_bound(volumes: Sequence[float], max_over_mean: float, added: float = 0.0) -> list[bool]:
    """Which volumes are at most ``max_over_mean`` x their mean (all of them when the mean is
    0 or when none is). With ``added`` > 0 (a request's tokens), each is judged as if it took
    them: its volume + ``added`` against the bound of the mean with them."""
    n = len(volumes)
    mean = (sum(volumes) + added) / n if n else 0.0
    if mean <= 0.0 or (added > 0.0 and sum(volumes) <= 0.0):
        return [True] * n
    limit = max_over_mean * mean - added
    keep = [x <= limit for x in volumes]
    return keep if any(keep) else [True] * n


class VolumeBoundFilter:
    """Drops the candidates whose recent routed volume (the ``routed-volume`` scorer's own
    decayed count, shared through ``CycleContext.volume_source``) exceeds ``max_over_mean`` x
    the candidates' mean, so no worker takes more than that share of the input tokens however
    cheap its cache makes a request there; keeps all when every one would be dropped. The
    scorers then choose among the rest (a dropped prefix holder's blocks come from its node's
    tier or a peer, priced by ttft-cost). With ``spare_gpu_share`` a candidate holding that
    share of the request on its GPU is kept past the bound (sessions stay; new work goes).
    With ``move_slack_s`` a candidate past the bound is kept unless a candidate within it is
    about as fast for this request by the ttft-cost estimate (``CycleContext.cost_source``):
    the load moves where moving is cheap (a short prompt, a prefix a sibling loads from its
    node's tier) and warm long contexts stay with their cache. With
    ``recurrence_half_life_requests`` that slack grows with how often the prefix a candidate
    holds on its GPU was placed recently (``RecentPrefixes``): a hot prefix is reloaded once
    onto another worker, and its next requests hit there."""

    needs_volume_source = True  # the Scheduler checks the profile has a routed-volume scorer

    def __init__(self, name: str, params: VolumeBoundParams) -> None:
        self.name = name
        self._max = params.max_over_mean
        self._spare = params.spare_gpu_share
        self._slack = params.move_slack_s
        self._factor = params.move_factor
        self._per_excess = params.move_slack_per_excess_s
        self._slack_max = params.move_slack_max_s
        self._prospective = params.prospective
        hl = params.recurrence_half_life_requests
        self._recent = RecentPrefixes(hl) if hl > 0.0 and params.move_slack_s is not None else None
        # The Scheduler checks the profile has a ttft-cost scorer when the bound prices moves.
        self.needs_cost_source = params.move_slack_s is not None

    def filter(self, ctx: CycleContext, candidates: Sequence[WorkerView]) -> Sequence[WorkerView]:
        src = ctx.volume_source
        if src is None or len(candidates) < 2:
            return candidates
        vols = [src.routed_volume(v.record.worker_id) for v in candidates]
        added = float(ctx.request.prompt_tokens) if self._prospective else 0.0
        within = within_bound(vols, self._max, added)
        if all(within):
            return candidates
        keep = list(within)
        total = len(ctx.request.block_hashes)
        if self._spare > 0.0 and total:
            held = ctx.prefix()  # the profile's prefix source (memoised for the scorers)
            need = self._spare * total
            for i, v in enumerate(candidates):
                m = held.get(v.record.worker_id)
                if not keep[i] and m is not None and m.gpu_blocks >= need:
                    keep[i] = True
        cost, slack = ctx.cost_source, self._slack
        if slack is not None and cost is not None:
            est = cost.ttft_estimates(ctx, candidates)
            ttft = [est[v.record.worker_id] for v in candidates]
            slacks: float | list[float] = slack
            if self._per_excess > 0.0:
                slacks = graduated_slack(vols, self._max, slack, self._per_excess, self._slack_max)
            if self._recent is not None:
                slacks = self._recurring(self._recent, ctx, candidates, slacks)
            keep = costly_moves_stay(ttft, within, keep, self._factor, slacks)
        return [v for v, k in zip(candidates, keep, strict=True) if k]

    def _recurring(
        self,
        recent: RecentPrefixes,
        ctx: CycleContext,
        candidates: Sequence[WorkerView],
        slacks: float | list[float],
    ) -> list[float]:
        """Each candidate's slack x (1 + recent requests placed on a holder of its GPU prefix),
        at most ``move_slack_max_s``."""
        held = ctx.prefix()
        hashes = ctx.request.block_hashes
        cap = math.inf if self._slack_max is None else self._slack_max
        out = []
        for i, v in enumerate(candidates):
            s = slacks if isinstance(slacks, (int, float)) else slacks[i]
            m = held.get(v.record.worker_id)
            g = min(m.gpu_blocks, len(hashes)) if m is not None else 0
            r = recent.count(hashes[g - 1]) if g > 0 else 0.0
            out.append(min(s * (1.0 + r), cap) if r > 0.0 else s)
        return out

    def on_routed(self, request: RouteRequest, decision: RouteDecision) -> None:
        """Counts the prefix the winner held on its GPU (the recurrence the slack reads)."""
        recent = self._recent
        if recent is None:
            return
        e = decision.explanation
        g = min(e.cached_gpu_blocks, len(request.block_hashes)) if e is not None else 0
        recent.decide(request.block_hashes[g - 1] if g > 0 else None)


class RecentPrefixes:
    """How many recent requests were placed on a worker holding each prefix on its GPU (keyed
    by the prefix's last block hash, so the same block at the same depth), decayed per decision
    with a half-life counted in decisions. Entries that decay away are dropped now and then, so
    the table holds about the prefixes of the last few half-lives."""

    __slots__ = ("_counts", "_decay", "_n", "_prune_at")

    def __init__(self, half_life_requests: float) -> None:
        self._decay = 0.5 ** (1.0 / half_life_requests)
        self._n = 0
        self._counts: dict[BlockHash, tuple[float, int]] = {}
        # Prune when the table is due: every ~4 half-lives' worth of decisions, at least 1024.
        self._prune_at = max(1024, int(4 * half_life_requests))

    def count(self, block: BlockHash) -> float:
        value, at = self._counts.get(block, (0.0, self._n))
        return float(value * self._decay ** (self._n - at))

    def decide(self, block: BlockHash | None) -> None:
        """One decision; ``block``: the prefix its winner held on its GPU (None: none)."""
        self._n += 1
        if block is not None:
            self._counts[block] = (self.count(block) + 1.0, self._n)
        if self._n % self._prune_at == 0:
            self._counts = {b: c for b, c in self._counts.items() if self.count(b) >= 0.05}


def graduated_slack(
    volumes: Sequence[float],
    max_over_mean: float,
    move_slack_s: float,
    per_excess_s: float,
    max_s: float | None = None,
) -> list[float]:
    """Each candidate's slack: ``move_slack_s`` + ``per_excess_s`` x how far its volume runs
    past ``max_over_mean`` x the mean, in units of the mean (0 within the bound), at most
    ``max_s`` (None: no cap)."""
    mean = sum(volumes) / len(volumes) if volumes else 0.0
    if mean <= 0.0:
        return [move_slack_s] * len(volumes)
    cap = math.inf if max_s is None else max_s
    return [
        min(move_slack_s + per_excess_s * max(x / mean - max_over_mean, 0.0), cap) for x in volumes
    ]


def costly_moves_stay(
    ttft_s: Sequence[float],
    within: Sequence[bool],
    keep: Sequence[bool],
    move_factor: float,
    move_slack_s: float | Sequence[float],
) -> list[bool]:
    """``keep``, plus each candidate past the bound (``within`` false) whose request no
    candidate within it serves in at most ``move_factor`` x its estimate + its slack
    (``move_slack_s``: one for all, or one per candidate): turning it away would cost more."""
    best = min((t for t, w in zip(ttft_s, within, strict=True) if w), default=math.inf)
    slacks = (
        [move_slack_s] * len(ttft_s) if isinstance(move_slack_s, (int, float)) else move_slack_s
    )
    return [k or best > move_factor * t + s for k, t, s in zip(keep, ttft_s, slacks, strict=True)]
