"""Built-in filters: serving state, model, role, a bound on the routed volume."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvmesh.discovery.keys import Role

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


def within_bound(volumes: Sequence[float], max_over_mean: float) -> list[bool]:
    """Which volumes are at most ``max_over_mean`` x their mean (all of them when the mean is
    0 or when none is)."""
    mean = sum(volumes) / len(volumes) if volumes else 0.0
    if mean <= 0.0:
        return [True] * len(volumes)
    limit = max_over_mean * mean
    keep = [x <= limit for x in volumes]
    return keep if any(keep) else [True] * len(volumes)


class VolumeBoundFilter:
    """Drops the candidates whose recent routed volume (the ``routed-volume`` scorer's own
    decayed count, shared through ``CycleContext.volume_source``) exceeds ``max_over_mean`` x
    the candidates' mean, so no worker takes more than that share of the input tokens however
    cheap its cache makes a request there; keeps all when every one would be dropped. The
    scorers then choose among the rest (a dropped prefix holder's blocks come from its node's
    tier or a peer, priced by ttft-cost). With ``spare_gpu_share`` a candidate holding that
    share of the request on its GPU is kept past the bound (sessions stay; new work goes)."""

    needs_volume_source = True  # the Scheduler checks the profile has a routed-volume scorer

    def __init__(self, name: str, params: VolumeBoundParams) -> None:
        self.name = name
        self._max = params.max_over_mean
        self._spare = params.spare_gpu_share

    def filter(self, ctx: CycleContext, candidates: Sequence[WorkerView]) -> Sequence[WorkerView]:
        src = ctx.volume_source
        if src is None or len(candidates) < 2:
            return candidates
        vols = [src.routed_volume(v.record.worker_id) for v in candidates]
        keep = within_bound(vols, self._max)
        if all(keep):
            return candidates
        total = len(ctx.request.block_hashes)
        if self._spare > 0.0 and total:
            held = ctx.prefix()  # the profile's prefix source (memoised for the scorers)
            need = self._spare * total
            for i, v in enumerate(candidates):
                m = held.get(v.record.worker_id)
                if not keep[i] and m is not None and m.gpu_blocks >= need:
                    keep[i] = True
        return [v for v, k in zip(candidates, keep, strict=True) if k]
