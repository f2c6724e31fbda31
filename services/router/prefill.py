"""The prefill half of a disaggregated request, over gRPC: the prefill worker computes the
prompt's KV (one token, which nobody sees) and its KV connector saves the blocks to its node's
kvmanager; the decode worker is then called with ``kv_source`` naming that kvmanager
(``handoff_source``). Any failure here is a fallback, never an error: the decode worker serves
the request aggregated (recomputing). The decision itself is ``core/disagg.py``;
``Prefills`` carries the prefill out for the request's loop (``proxy.py``).

The decode half's failures: before the first token another decode worker takes the request
(``proxy.py``'s retry); after it, ``core.lifecycle.decode_failed`` is what the client gets.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum

import grpc

from kvmesh.discovery.keys import WorkerId, split_target
from kvmesh.telemetry import tracer
from kvmesh.v1 import common_pb2, worker_pb2, worker_pb2_grpc

from .attempt import Active
from .core.disagg import DisaggConfig
from .core.index_types import StoreId, store_parts
from .core.routing import RoutingPolicy
from .core.types import RouteDecision, RouteRequest
from .core.workers import WorkerSet
from .decode import Overlap
from .metrics import RouterMetrics
from .pool import WorkerPool

log = logging.getLogger(__name__)
_tracer = tracer(__name__)
_HANDOFF_WAIT_MARGIN_S = 1.0  # an overlapped decode waits this much past the prefill deadline


class Fallback(StrEnum):
    """Why a disaggregated request was served aggregated after all (a metric label)."""

    PREFILL_GONE = "prefill-gone"  # the prefill worker left between the pick and the call
    PREFILL_UNAVAILABLE = "prefill-unavailable"  # UNAVAILABLE (died, draining, unreachable)
    PREFILL_TIMEOUT = "prefill-timeout"  # the prefill call ran out of its deadline
    PREFILL_FAILED = "prefill-failed"  # any other error, or the prefill was aborted
    NO_KVMANAGER = "no-kvmanager"  # the prefill worker's node store vanished meanwhile


@dataclass(frozen=True, slots=True)
class PrefillResult:
    fallback: Fallback | None  # None: the prompt's KV was computed (and is being saved)
    seconds: float
    cached_tokens: int = 0  # prompt tokens the prefill worker served from its caches
    detail: str = ""


def one_token(sampling: common_pb2.SamplingParams) -> common_pb2.SamplingParams:
    """The request's sampling, stopped after the first token: the prefill's output is dropped
    (so are logprobs: the decode worker computes those it returns)."""
    out = common_pb2.SamplingParams()
    out.CopyFrom(sampling)
    out.max_tokens = 1
    out.ClearField("structured_output")  # the token is dropped: no grammar to compile for it
    out.ClearField("logprobs")
    out.ClearField("prompt_logprobs")
    return out


async def run_prefill(
    stub: worker_pb2_grpc.WorkerStub,
    route: RouteRequest,
    sampling: common_pb2.SamplingParams,
    timeout_s: float,
    rank: int | None = None,
) -> PrefillResult:
    """Calls ``Worker.Generate`` with the prompt and one token; drains the stream. Never raises
    for a worker failure (cancellation propagates). ``rank``: the target is that data-parallel
    rank of the worker."""
    started = time.monotonic()
    call = stub.Generate(
        worker_pb2.WorkerGenerateRequest(
            request_id=route.request_id,
            prompt_token_ids=route.prompt_token_ids,
            sampling=one_token(sampling),
            cache_salt=route.cache_salt,  # the decode worker fetches the blocks by its hashes
            priority=route.priority,
            data_parallel_rank=rank,
        ),
        timeout=max(timeout_s, 0.001),
    )
    try:
        async for msg in call:
            if msg.HasField("finished"):
                f = msg.finished
                took = time.monotonic() - started
                if f.reason == common_pb2.FINISH_REASON_ABORT:
                    return PrefillResult(Fallback.PREFILL_FAILED, took, detail="aborted")
                return PrefillResult(None, took, f.usage.cached_prompt_tokens)
        return PrefillResult(
            Fallback.PREFILL_FAILED, time.monotonic() - started, detail="no final message"
        )
    except grpc.aio.AioRpcError as exc:
        took = time.monotonic() - started
        code = exc.code()
        if code is grpc.StatusCode.UNAVAILABLE:
            return PrefillResult(Fallback.PREFILL_UNAVAILABLE, took, detail=exc.details() or "")
        if code is grpc.StatusCode.DEADLINE_EXCEEDED:
            return PrefillResult(Fallback.PREFILL_TIMEOUT, took, detail=exc.details() or "")
        return PrefillResult(Fallback.PREFILL_FAILED, took, detail=f"{code.name}: {exc.details()}")
    finally:
        call.cancel()  # no-op when finished; aborts the engine request otherwise


def handoff_source(
    route: RouteRequest, prefill_worker: WorkerId, linked: Callable[[WorkerId], StoreId | None]
) -> worker_pb2.KvSource | None:
    """``kv_source`` for the decode call: the prefill worker's node kvmanager, which will hold
    every full block of the prompt. None when the worker has no node store (no hand-off)."""
    store = linked(prefill_worker)
    if store is None or not route.block_hashes:
        return None
    return worker_pb2.KvSource(kvmanager_id=store_parts(store)[0], blocks=len(route.block_hashes))


class Prefills:
    """The prefill halves of disaggregated requests, carried out for the request's loop
    (``proxy.py``): placed, tracked in ``active`` (request id -> worker, for Abort), timed and
    counted; a failure is a fallback to aggregated serving."""

    def __init__(
        self,
        config: DisaggConfig,
        workers: WorkerSet,
        pool: WorkerPool,
        policy: RoutingPolicy,
        metrics: RouterMetrics,
        active: dict[str, Active],
        linked: Callable[[WorkerId], StoreId | None],
    ) -> None:
        self.config = config
        self._workers = workers
        self._pool = pool
        self._policy = policy
        self.metrics = metrics
        self._active = active
        self._linked = linked

    async def hand_off(
        self,
        route: RouteRequest,
        prefill: RouteDecision,
        sampling: common_pb2.SamplingParams,
        deadline: float,
        overlap: Overlap,
    ) -> worker_pb2.KvSource | None:
        """The decode call's ``kv_source`` of a disaggregated request: at once with the prefill
        started as ``overlap.task`` (overlapped), or after the prefill; None: aggregated."""
        if self.config.overlap:
            handoff, overlap.task = self._start(route, prefill, sampling, deadline)
            return handoff
        return await self._run(route, prefill, sampling, deadline)

    def _start(
        self,
        route: RouteRequest,
        decision: RouteDecision,
        sampling: common_pb2.SamplingParams,
        deadline: float,
    ) -> tuple[worker_pb2.KvSource | None, asyncio.Task[worker_pb2.KvSource | None] | None]:
        """An overlapped hand-off: the prefill as a task, and the decode call's ``kv_source``
        at once, telling the decode worker to wait for the blocks as long as the prefill may
        take. (None, None) when there is nothing to hand over (counted as a fallback)."""
        source = handoff_source(route, decision.worker_id, self._linked)
        if source is None or self._pool.stub(decision.worker_id) is None:
            self._fallback(route, decision.worker_id)
            return None, None
        task = asyncio.create_task(
            self._run(route, decision, sampling, deadline, track=False),
            name=f"prefill-{route.request_id}",
        )
        # The router ends the wait itself when the prefill falls back (it sends the decode
        # request again without the hint); the worker's own bound is a backstop past that.
        left = deadline - time.monotonic()
        wait_s = self.config.prefill_timeout_s + _HANDOFF_WAIT_MARGIN_S
        source.handoff_wait_s = max(0.001, min(left, wait_s, 600.0))
        return source, task

    def _fallback(self, route: RouteRequest, wid: WorkerId) -> None:
        stub = self._pool.stub(wid)
        fallback = Fallback.PREFILL_GONE if stub is None else Fallback.NO_KVMANAGER
        self.metrics.disagg_fallbacks.labels(route.model, fallback.value).inc()

    async def _run(
        self,
        route: RouteRequest,
        decision: RouteDecision,
        sampling: common_pb2.SamplingParams,
        deadline: float,
        track: bool = True,
    ) -> worker_pb2.KvSource | None:
        """The prefill half of a disaggregated request; returns the decode call's ``kv_source``,
        or None when the request falls back to aggregated serving (counted, logged). ``track``:
        the request's abort goes to this worker meanwhile (not when overlapped: the decode
        worker has the request then, and cancelling this task aborts the prefill)."""
        wid = decision.worker_id
        stub = self._pool.stub(wid)
        source = handoff_source(route, wid, self._linked)
        if stub is None or source is None:
            self._fallback(route, wid)
            return None
        if track:
            self._active[route.request_id] = Active(wid, route.tenant)
        self._workers.started(wid)
        self._policy.on_routed(route, decision)
        try:
            left = deadline - time.monotonic()
            with _tracer.start_as_current_span("prefill") as span:
                span.set_attribute("worker_id", wid)
                result = await run_prefill(
                    stub,
                    route,
                    sampling,
                    min(left, self.config.prefill_timeout_s),
                    split_target(wid)[1],
                )
                span.set_attribute("ok", result.fallback is None)
        finally:
            self._workers.finished(wid)
            self._policy.on_finished(route, wid)
            if track:
                self._active.pop(route.request_id, None)
        self.metrics.prefill_seconds.labels(route.model).observe(result.seconds)
        if result.fallback is not None:
            log.warning(
                "prefill of %s on worker %s failed (%s: %s); serving it aggregated",
                route.request_id,
                wid,
                result.fallback.value,
                result.detail,
            )
            self.metrics.disagg_fallbacks.labels(route.model, result.fallback.value).inc()
            return None
        log.info(
            "request %s prefilled on worker %s in %.3fs (cached %d); the decode worker loads "
            "%d blocks via kvmanager %s",
            route.request_id,
            wid,
            result.seconds,
            result.cached_tokens,
            source.blocks,
            source.kvmanager_id,
        )
        return source
