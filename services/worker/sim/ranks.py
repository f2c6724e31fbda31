"""``RankedSimEngine``: several simulated engines as the data-parallel ranks of one worker.

Each rank is a ``SimulatedEngine`` of its own (its own KV cache, scheduler, clock and KV events),
as each rank of vLLM's internal data parallelism is an engine core of its own behind one front
end. A request names its rank (``GenerateRequest.data_parallel_rank``: the router picked it) or
the engine picks one as vLLM's front end does without a rank (``pick``): the rank with the
fewest requests in flight here, lowest rank first on a tie (vLLM's ``DPLBAsyncMPClient`` scores
``4 * waiting + running`` from the ranks' last reports and counts what it sent since), or round
robin. Implements ``services.worker.core.RankedEngine``.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from dataclasses import replace
from typing import cast

from kvmesh import errors

from ..core import EngineInfo, EngineLoad, GenerateRequest, KvEventSink, OutputDelta
from .engine import SimulatedEngine

PICKS = ("least-loaded", "round-robin")


class RankedSimEngine:
    """``ranks`` as the data-parallel ranks 0..n-1 of one engine (all of one model config)."""

    def __init__(self, ranks: Sequence[SimulatedEngine], pick: str = "least-loaded") -> None:
        if not ranks:
            raise ValueError("a ranked engine needs at least one rank")
        if pick not in PICKS:
            raise ValueError(f"pick must be one of {', '.join(PICKS)}, not {pick!r}")
        self._ranks = tuple(ranks)
        self._pick = pick
        self._next = 0  # round robin
        self._in_flight = [0] * len(ranks)
        self._info = replace(ranks[0].info, data_parallel_size=len(ranks))

    @property
    def info(self) -> EngineInfo:
        return self._info

    @property
    def ranks(self) -> tuple[SimulatedEngine, ...]:
        """The ranks' engines (tests look at their caches)."""
        return self._ranks

    def is_running(self, request_id: str) -> bool:
        return self.rank_of(request_id) is not None

    def rank_of(self, request_id: str) -> int | None:
        for r, engine in enumerate(self._ranks):
            if engine.is_running(request_id):
                return r
        return None

    def load(self) -> EngineLoad:
        """The sum over ranks; KV usage is the mean (each rank has the same capacity)."""
        loads = [e.load() for e in self._ranks]
        return EngineLoad(
            running_requests=sum(x.running_requests for x in loads),
            waiting_requests=sum(x.waiting_requests for x in loads),
            kv_cache_usage=sum(x.kv_cache_usage for x in loads) / len(loads),
            prefix_cache_queried_tokens=sum(x.prefix_cache_queried_tokens for x in loads),
            prefix_cache_hit_tokens=sum(x.prefix_cache_hit_tokens for x in loads),
            preemptions=sum(x.preemptions for x in loads),
            prefill_computed_tokens=sum(x.prefill_computed_tokens for x in loads),
            prefill_s=sum(x.prefill_s for x in loads),
            generation_tokens=sum(x.generation_tokens for x in loads),
            decode_tokens=sum(x.decode_tokens for x in loads),
            decode_s=sum(x.decode_s for x in loads),
        )

    def rank_load(self, rank: int) -> EngineLoad:
        return self._ranks[rank].load()

    def add_load_listener(self, listener: Callable[[], None]) -> None:
        for engine in self._ranks:
            engine.add_load_listener(listener)

    def set_kv_event_sink(self, sink: KvEventSink) -> None:
        """Every rank's events into one sink (a per-worker view: a block stored on any rank;
        a removal on one rank says nothing of the others, so per-rank sinks are the exact ones)."""
        for engine in self._ranks:
            engine.set_kv_event_sink(sink)

    def set_rank_kv_event_sink(self, rank: int, sink: KvEventSink) -> None:
        self._ranks[rank].set_kv_event_sink(sink)

    async def abort(self, request_id: str) -> None:
        rank = self.rank_of(request_id)
        if rank is None:
            raise errors.NotFound(f"request {request_id!r} is not running on this worker")
        await self._ranks[rank].abort(request_id)

    def choose_rank(self) -> int:
        """The rank a request without one goes to."""
        if self._pick == "round-robin":
            rank = self._next
            self._next = (self._next + 1) % len(self._ranks)
            return rank
        return min(range(len(self._ranks)), key=lambda r: (self._in_flight[r], r))

    async def generate(self, request: GenerateRequest) -> AsyncIterator[OutputDelta]:
        rid = request.request_id
        if self.is_running(rid):  # on any rank: ids are the worker's, not a rank's
            raise errors.InvalidArgument(
                f"request_id {rid!r} is already running on this worker; use a unique id"
            )
        rank = request.data_parallel_rank
        if rank is None:
            rank = self.choose_rank()
        elif not 0 <= rank < len(self._ranks):
            raise errors.InvalidArgument(
                f"data_parallel_rank is {rank}; this engine has {len(self._ranks)} ranks",
                "data_parallel_rank",
            )
        self._in_flight[rank] += 1
        try:
            # aclosing: our consumer closing early closes the rank's stream now (its abort).
            inner = cast(AsyncGenerator[OutputDelta, None], self._ranks[rank].generate(request))
            async with contextlib.aclosing(inner) as stream:
                async for delta in stream:
                    yield delta
        finally:
            self._in_flight[rank] -= 1

    async def close(self) -> None:
        for engine in self._ranks:
            await engine.close()
