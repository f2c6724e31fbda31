"""Active context: balance the sessions' working sets, not past traffic.

An agent session's next turns each resend its whole context, so a worker's future load is the sum
of the contexts of the sessions living on it. This scorer keeps, per session id, the worker its
last turn went to and that turn's prompt size; a worker's *footprint* is the sum over the live
sessions on it. A session is live until ``idle_requests`` decisions pass without a turn of it
(decisions, not seconds, so replays in virtual time and live routers behave alike).

Scoring leaves the request's own session out of every candidate (it is added to whichever wins,
so it cannot tip the comparison): 1 at no footprint, 0.5 at the candidates' mean, towards 0
above. With a prefix scorer beside it, a session stays on its worker until the footprint of the
*other* sessions there is far above another worker's: sessions that end early leave room that a
warm session migrates into once, and its next turns follow their prefix to the new worker.
Requests without a session id leave no footprint.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from ..types import RouteDecision, RouteRequest
from ..workers import WorkerView
from .params import check
from .plugins import CycleContext


@dataclass(frozen=True, slots=True)
class ActiveContextParams:
    # A session leaves the footprint after this many routing decisions with no turn of it.
    idle_requests: int = 400
    # The score is 1 / (1 + (x / mean) ** sharpness): 1 makes every difference count a little;
    # larger values flatten the scores below the mean and drop them fast above it, so only a
    # clearly overloaded worker loses warm sessions (fewer, more useful migrations).
    sharpness: float = 1.0
    # A session whose first prompt mostly (this share of its blocks or more) continues a context
    # some candidate already holds is a fork (a sub-agent, a retry, a branch): short-lived as a
    # rule, so moving it would recompute its context for little gain. Forks are scored flat for
    # their whole life and follow prefix affinity; their footprint still counts, so the
    # long-lived sessions beside them are the ones that move. 0 turns this off.
    fork_share: float = 0.7

    def __post_init__(self) -> None:
        check(self.idle_requests > 0, "idle_requests must be > 0")
        check(self.sharpness > 0, "sharpness must be > 0")
        check(0.0 <= self.fork_share <= 1.0, "fork_share must be in [0, 1]")


@dataclass(slots=True)
class _Session:
    worker_id: str
    tokens: int
    last: int  # decision number of its last turn
    fork: bool  # its first prompt continued a context held elsewhere (see fork_share)


class ActiveContextScorer:
    def __init__(self, name: str, params: ActiveContextParams) -> None:
        self.name = name
        self._idle = params.idle_requests
        self._sharp = params.sharpness
        self._fork_share = params.fork_share
        self._first_turn: tuple[str, bool] | None = None  # (request id, fork?) of the last cycle
        self._n = 0
        self._sessions: dict[str, _Session] = {}
        self._footprint: dict[str, int] = {}  # worker -> tokens of its live sessions
        self._turns: deque[tuple[int, str]] = deque()  # (decision number, session), in order

    def footprint(self, worker_id: str) -> int:
        """Prompt tokens of the live sessions whose last turn went to ``worker_id``."""
        return self._footprint.get(worker_id, 0)

    def score(self, ctx: CycleContext, candidates: Sequence[WorkerView]) -> Sequence[float]:
        own = self._sessions.get(ctx.request.session_id) if ctx.request.session_id else None
        if own is None:
            fork = bool(self._fork_share) and self._is_fork(ctx)
            self._first_turn = (ctx.request.request_id, fork)
            if fork:
                return [1.0] * len(candidates)
        elif own.fork:
            return [1.0] * len(candidates)
        fp = self._footprint
        xs = []
        for v in candidates:
            wid = v.record.worker_id
            x = fp.get(wid, 0)
            if own is not None and own.worker_id == wid:
                x -= own.tokens
            xs.append(x)
        mean = sum(xs) / len(xs) if xs else 0.0
        if mean <= 0.0:
            return [1.0] * len(candidates)
        p = self._sharp
        if p == 1.0:
            return [1.0 / (1.0 + x / mean) for x in xs]
        return [1.0 / (1.0 + (x / mean) ** p) for x in xs]

    def _is_fork(self, ctx: CycleContext) -> bool:
        total = len(ctx.request.block_hashes)
        if not total or ctx.prefix_source is None:
            return False
        best = max((m.blocks for m in ctx.prefix().values()), default=0)
        return best >= self._fork_share * total

    def on_routed(self, request: RouteRequest, decision: RouteDecision) -> None:
        self._n += 1
        self._expire()
        sid = request.session_id
        if not sid:
            return
        s = self._sessions.get(sid)
        if s is not None:
            self._add(s.worker_id, -s.tokens)
            s.worker_id, s.tokens, s.last = decision.worker_id, request.prompt_tokens, self._n
        else:
            first = self._first_turn
            fork = first is not None and first[0] == request.request_id and first[1]
            s = _Session(decision.worker_id, request.prompt_tokens, self._n, fork)
            self._sessions[sid] = s
        self._add(s.worker_id, s.tokens)
        self._turns.append((self._n, sid))

    def _add(self, worker_id: str, tokens: int) -> None:
        total = self._footprint.get(worker_id, 0) + tokens
        if total > 0:
            self._footprint[worker_id] = total
        else:
            self._footprint.pop(worker_id, None)

    def _expire(self) -> None:
        horizon = self._n - self._idle
        turns = self._turns
        while turns and turns[0][0] <= horizon:
            _, sid = turns.popleft()
            s = self._sessions.get(sid)
            if s is not None and s.last <= horizon:
                del self._sessions[sid]
                self._add(s.worker_id, -s.tokens)
