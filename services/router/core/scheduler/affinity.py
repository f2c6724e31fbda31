"""Session affinity: a session keeps the worker it was last routed to while that worker is not
saturated. The session table is a bounded LRU, updated in ``on_routed`` (so a session that had
to move sticks to its new worker)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from kvmesh.discovery.keys import WorkerId

from ..types import RouteDecision, RouteRequest
from ..workers import WorkerView, outstanding, waiting
from .params import check
from .plugins import CycleContext, PluginEnv


@dataclass(frozen=True, slots=True)
class SessionParams:
    max_sessions: int = 100_000  # sessions remembered (least recently routed forgotten first)
    # The session's worker is saturated, and loses its bonus, when any limit is reached.
    max_waiting: int = 4  # requests waiting in the worker's queue (workers.waiting); 0: no limit
    max_in_flight: int = 0  # outstanding requests (router's count or the report); 0: no limit
    max_kv_usage: float = 0.95  # KV cache usage in [0, 1]; 1: no limit

    def __post_init__(self) -> None:
        check(self.max_sessions >= 1, f"max_sessions is {self.max_sessions}; use 1 or more")
        check(self.max_waiting >= 0, f"max_waiting is {self.max_waiting}; use 0 (off) or more")
        check(
            self.max_in_flight >= 0, f"max_in_flight is {self.max_in_flight}; use 0 (off) or more"
        )
        check(
            0.0 < self.max_kv_usage <= 1.0,
            f"max_kv_usage is {self.max_kv_usage}; use a fraction in (0, 1]",
        )


class SessionAffinityScorer:
    """1 for the session's worker unless it is saturated, 0 for every other worker (and for
    requests without a session id)."""

    def __init__(self, name: str, params: SessionParams) -> None:
        self.name = name
        self._p = params
        self._sessions: OrderedDict[str, WorkerId] = OrderedDict()

    @classmethod
    def build(cls, name: str, params: SessionParams, env: PluginEnv) -> SessionAffinityScorer:
        return cls(name, params)

    def saturated(self, view: WorkerView) -> bool:
        p = self._p
        return (
            (p.max_waiting > 0 and waiting(view) >= p.max_waiting)
            or (p.max_in_flight > 0 and outstanding(view) >= p.max_in_flight)
            or (p.max_kv_usage < 1.0 and view.load.kv_cache_usage >= p.max_kv_usage)
        )

    def worker_of(self, session_id: str) -> WorkerId | None:
        return self._sessions.get(session_id)

    def score(self, ctx: CycleContext, candidates: Sequence[WorkerView]) -> Sequence[float]:
        out = [0.0] * len(candidates)
        sid = ctx.request.session_id
        wid = self._sessions.get(sid) if sid else None
        if wid is None:
            return out
        for i, v in enumerate(candidates):
            if v.record.worker_id == wid:
                if not self.saturated(v):
                    out[i] = 1.0
                break
        return out

    def on_routed(self, request: RouteRequest, decision: RouteDecision) -> None:
        sid = request.session_id
        if not sid:
            return
        self._sessions[sid] = decision.worker_id
        self._sessions.move_to_end(sid)
        if len(self._sessions) > self._p.max_sessions:
            self._sessions.popitem(last=False)

    def __len__(self) -> int:
        return len(self._sessions)
