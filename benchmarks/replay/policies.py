"""Built-in routing baselines for replays. A policy is any ``route(request, view) -> index``;
the real router's scheduler plugs in the same way (fed KV events through the driver)."""

from __future__ import annotations

from collections.abc import Callable

from .driver import ClusterView, RoutePolicy
from .traces import ReplayRequest


class RoundRobin:
    name = "round-robin"

    def __init__(self) -> None:
        self._next = 0

    def __call__(self, request: ReplayRequest, view: ClusterView) -> int:
        i = self._next % len(view.workers)
        self._next += 1
        return i


def _load_key(view: ClusterView, i: int) -> tuple[int, int, int]:
    s = view.workers[i].load()
    return (s.running + s.waiting, s.pending_prefill_tokens, i)


class LeastLoaded:
    """Fewest unfinished requests, then fewest prompt tokens still to prefill."""

    name = "least-loaded"

    def __call__(self, request: ReplayRequest, view: ClusterView) -> int:
        return min(range(len(view.workers)), key=lambda i: _load_key(view, i))


class OracleLongestPrefix:
    """The worker whose cache holds the longest prefix of the request *now*, read from the
    simulated caches themselves (no real router knows this); ties go to the least loaded.
    An upper bound for routers that route by prefix alone, not an optimum: it ignores load."""

    name = "oracle-prefix"

    def __call__(self, request: ReplayRequest, view: ClusterView) -> int:
        hits = view.prefix_hit_blocks
        best = max(hits)
        tied = [i for i, h in enumerate(hits) if h == best]
        if len(tied) == 1:
            return tied[0]
        return min(tied, key=lambda i: _load_key(view, i))


class OracleLeastWork:
    """The worker with the least prefill work ahead of the request's first token: prompt tokens
    it still has to prefill, plus this request's tokens its cache does not hold now (read from
    the simulated caches themselves). Balances cache affinity against queueing."""

    name = "oracle-cost"

    def __call__(self, request: ReplayRequest, view: ClusterView) -> int:
        bs = view.workers[0].config.block_size
        hits = view.prefix_hit_blocks
        costs = [
            (w.load().pending_prefill_tokens + request.input_tokens - hits[i] * bs, i)
            for i, w in enumerate(view.workers)
        ]
        return min(costs)[1]


BUILTIN: dict[str, Callable[[], RoutePolicy]] = {
    RoundRobin.name: RoundRobin,
    LeastLoaded.name: LeastLoaded,
    OracleLongestPrefix.name: OracleLongestPrefix,
    OracleLeastWork.name: OracleLeastWork,
}
