"""Built-in filters: serving state, model, role."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvmesh.discovery.keys import Role

from ..workers import WorkerView
from .params import NoParams
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
