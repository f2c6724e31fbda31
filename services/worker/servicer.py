"""kvmesh.v1.Worker over gRPC: converts messages to core values and back, calls the engine."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from typing import cast

import grpc

from kvmesh import errors
from kvmesh.discovery.keys import Role, target_id
from kvmesh.grpc_errors import status_for
from kvmesh.kv.fanout import KvEventHub
from kvmesh.kv_stream import serve_kv_events
from kvmesh.sampling import sampling_from_pb
from kvmesh.v1 import common_pb2, worker_pb2, worker_pb2_grpc

from . import validation
from .core import (
    Engine,
    EngineLoad,
    FinishReason,
    GenerateRequest,
    KvSource,
    OutputDelta,
    RankedEngine,
    RequestPhases,
    TokenLogprob,
)
from .metrics import WorkerMetrics
from .mux import WorkerStreamServer

log = logging.getLogger(__name__)

# How long a request id still in flight here is waited for before a request reusing it is
# refused: covers a failed-over client's retry racing the dead router's stream end (ms here).
DUPLICATE_WAIT_S = 2.0
_DUPLICATE_POLL_S = 0.05

ROLE_PB = {
    Role.BOTH: common_pb2.WORKER_ROLE_BOTH,
    Role.PREFILL: common_pb2.WORKER_ROLE_PREFILL,
    Role.DECODE: common_pb2.WORKER_ROLE_DECODE,
}
FINISH_PB = {
    FinishReason.STOP: common_pb2.FINISH_REASON_STOP,
    FinishReason.LENGTH: common_pb2.FINISH_REASON_LENGTH,
    FinishReason.ABORT: common_pb2.FINISH_REASON_ABORT,
}


def request_from_pb(r: worker_pb2.WorkerGenerateRequest) -> GenerateRequest:
    source = None
    if r.HasField("kv_source"):
        k = r.kv_source
        source = KvSource(k.kvmanager_id, k.blocks, k.handoff_wait_s, k.max_fetch_s)
    return GenerateRequest(
        request_id=r.request_id,
        prompt_token_ids=tuple(r.prompt_token_ids),
        sampling=sampling_from_pb(r.sampling),
        kv_source=source,
        cache_salt=r.cache_salt,
        priority=r.priority,
        data_parallel_rank=r.data_parallel_rank if r.HasField("data_parallel_rank") else None,
        store_prefix_blocks=(r.store_prefix_blocks if r.HasField("store_prefix_blocks") else None),
    )


def response_to_pb(d: OutputDelta, worker_id: str) -> worker_pb2.WorkerGenerateResponse:
    msg = worker_pb2.WorkerGenerateResponse(
        request_id=d.request_id, token_ids=d.token_ids, text=d.text
    )
    if d.logprobs is not None:  # only when asked for: nothing more per token otherwise
        msg.logprobs.extend(logprobs_to_pb(d.logprobs))
    if d.prompt_logprobs is not None:
        msg.prompt_logprobs.extend(logprobs_to_pb(d.prompt_logprobs))
    if d.finish is not None:
        split = d.cached_split()
        phases = d.timing.phases() if d.timing is not None else RequestPhases()
        msg.finished.CopyFrom(
            common_pb2.Finished(
                reason=FINISH_PB[d.finish.reason],
                stop_reason=d.finish.stop_reason,
                usage=common_pb2.Usage(
                    prompt_tokens=d.prompt_tokens,
                    cached_prompt_tokens=d.cached_tokens,
                    completion_tokens=d.completion_tokens,
                    worker_id=worker_id,
                    time_to_first_token_s=d.timing.time_to_first_token_s if d.timing else 0.0,
                    cached_gpu_tokens=split.gpu,
                    cached_cpu_tokens=split.cpu,
                    cached_disk_tokens=split.disk,
                    cached_peer_tokens=split.peer,
                    queue_time_s=phases.queue_s,
                    prefill_time_s=phases.prefill_s,
                    decode_time_s=phases.decode_s,
                ),
            )
        )
    return msg


def logprobs_to_pb(entries: tuple[TokenLogprob, ...]) -> list[common_pb2.TokenLogprob]:
    out = []
    for e in entries:
        msg = common_pb2.TokenLogprob(
            token_id=e.token_id,
            token=e.token,
            rank=e.rank,
            top=[
                common_pb2.TopLogprob(token_id=t.token_id, logprob=t.logprob, token=t.token)
                for t in e.top
            ],
        )
        if e.logprob is not None:
            msg.logprob = e.logprob
        out.append(msg)
    return out


def load_to_pb(load: EngineLoad, in_flight: int, worker_id: str) -> worker_pb2.WorkerLoad:
    return worker_pb2.WorkerLoad(
        worker_id=worker_id,
        running_requests=load.running_requests,
        waiting_requests=load.waiting_requests,
        kv_cache_usage=load.kv_cache_usage,
        prefix_cache_queried_tokens=load.prefix_cache_queried_tokens,
        prefix_cache_hit_tokens=load.prefix_cache_hit_tokens,
        in_flight_requests=in_flight,
        prefill_computed_tokens=load.prefill_computed_tokens,
        prefill_seconds=load.prefill_s,
        generation_tokens=load.generation_tokens,
        decode_tokens=load.decode_tokens,
        decode_seconds=load.decode_s,
        spec_drafts=load.spec.drafts,
        spec_draft_tokens=load.spec.draft_tokens,
        spec_accepted_tokens=load.spec.accepted_tokens,
        spec_accepted_tokens_per_position=load.spec.accepted_per_position,
    )


class _Changes:
    """A version number that waiters can block on until it moves."""

    def __init__(self) -> None:
        self.version = 0
        self._event = asyncio.Event()

    def notify(self) -> None:
        self.version += 1
        event, self._event = self._event, asyncio.Event()
        event.set()

    async def wait(self, seen: int) -> None:
        event = self._event
        if self.version == seen:
            await event.wait()


class WorkerServicer(worker_pb2_grpc.WorkerServicer):
    def __init__(
        self,
        engine: Engine,
        worker_id: str,
        role: Role = Role.BOTH,
        load_interval_s: float = 0.25,
        duplicate_wait_s: float = DUPLICATE_WAIT_S,
        kv_events: KvEventHub | None = None,
        max_send_bytes: int = 0,
        metrics: WorkerMetrics | None = None,
    ) -> None:
        self._engine = engine
        self.metrics = metrics or WorkerMetrics()
        self._kv_events = kv_events  # None: this worker publishes no KV events
        self._max_send_bytes = max_send_bytes  # the server's limit; 0: none
        self._worker_id = worker_id
        self._role = role
        self._load_interval_s = load_interval_s
        self._duplicate_wait_s = duplicate_wait_s
        self._active: dict[str, object] = {}  # request id -> token of the RPC serving it
        self._changes = _Changes()
        self._idle = asyncio.Event()
        self._idle.set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._closed = False
        self.draining = False
        engine.add_load_listener(self._changes.notify)
        ranked = engine.info.data_parallel_size > 1 and isinstance(engine, RankedEngine)
        self._ranked = cast(RankedEngine, engine) if ranked else None
        # With several ranks: each rank's KV event hub (kv_events is then unused).
        self.rank_kv_events: tuple[KvEventHub, ...] = ()

    @property
    def in_flight(self) -> int:
        return len(self._active)

    @property
    def worker_id(self) -> str:
        return self._worker_id

    def load(self, rank: int | None = None) -> worker_pb2.WorkerLoad:
        """The whole worker's load, or (``rank``, on a ``RankedEngine``) that rank's, named by
        its target id."""
        if rank is None or self._ranked is None:
            return load_to_pb(self._engine.load(), self.in_flight, self._worker_id)
        in_flight = sum(1 for r in self._active if self._ranked.rank_of(r) == rank)
        return load_to_pb(self._ranked.rank_load(rank), in_flight, target_id(self._worker_id, rank))

    def _check_rank(self, rank: int | None) -> None:
        """A WatchLoad / WatchKvEvents rank must name one of the engine's (0 on one rank)."""
        validation.check_rank(rank, self._engine.info.data_parallel_size)

    # ---- lifecycle (driven by main) --------------------------------------------------------
    async def wait_idle(self, timeout_s: float) -> bool:
        """Waits until no request is in flight; False if ``timeout_s`` passed first."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        except TimeoutError:
            return False
        return True

    async def abort_all(self) -> int:
        """Aborts every in-flight request in the engine (their streams end with ABORT)."""
        ids = [rid for rid in self._active if self._engine.is_running(rid)]
        for rid in ids:
            with contextlib.suppress(errors.NotFound):
                await self._engine.abort(rid)
        return len(ids)

    async def close(self) -> None:
        """Ends WatchLoad and WatchKvEvents streams and waits for background aborts."""
        self._closed = True
        self._changes.notify()
        if self._kv_events is not None:
            self._kv_events.close()
        for hub in self.rank_kv_events:
            hub.close()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)

    # ---- RPCs ----------------------------------------------------------------------------
    async def Generate(
        self, request: worker_pb2.WorkerGenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[worker_pb2.WorkerGenerateResponse]:
        # What it raises (admission, the engine) the host's error interceptor sends with its
        # status (kvmesh.grpc_errors.ErrorStatus): domain errors their code, others INTERNAL.
        rid = request.request_id
        req = await self.admit(request)
        token = object()
        self.track(rid, token)
        context.add_done_callback(lambda _ctx: self._on_rpc_done(rid, token))
        try:
            async for msg in self.outputs(req):
                yield msg
        finally:
            self.untrack(rid, token)

    def GenerateMany(
        self,
        requests: AsyncIterator[worker_pb2.WorkerStreamIn],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[worker_pb2.WorkerStreamOut]:
        """Many requests on one stream, outputs batched (``mux.WorkerStreamServer``). A plain
        function returning the stream's generator: the error interceptor's wrapper is then the
        one hop between gRPC and it, per message."""
        return WorkerStreamServer(self).serve(requests)

    async def admit(self, request: worker_pb2.WorkerGenerateRequest) -> GenerateRequest:
        """The request as a core value, if this worker takes it; else a domain error (counted
        and logged).

        A request id still in flight here is waited for (up to ``duplicate_wait_s``) before it
        is refused: a client that failed over to another router resends the same id, and the
        copy the dead router started is only cancelled here once its stream's end reaches this
        worker, which can come a moment after the retry."""
        rid = request.request_id
        try:
            if self.draining:
                raise errors.Unavailable("worker is draining; retry on another worker")
            req = request_from_pb(request)
            validation.check_request(req, self._engine.info)
            if not await self._wait_gone(rid):
                raise errors.InvalidArgument(
                    f"request_id {rid!r} is already in flight on this worker (still after "
                    f"{self._duplicate_wait_s:g} s); use a unique id per request"
                )
            if self.draining:
                raise errors.Unavailable("worker is draining; retry on another worker")
        except errors.KvmeshError as exc:
            log.info("rejected request_id=%s: %s", rid, exc)
            self.metrics.ended(status_for(exc).name)
            raise
        return req

    async def _wait_gone(self, rid: str) -> bool:
        """True once ``rid`` is neither tracked nor running in the engine; False if it still is
        after ``duplicate_wait_s``."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._duplicate_wait_s
        while rid in self._active or self._engine.is_running(rid):
            left = deadline - loop.time()
            if left <= 0:
                return False
            seen = self._changes.version
            # the engine letting an aborted request go moves no version: poll that part
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changes.wait(seen), min(left, _DUPLICATE_POLL_S))
        return True

    async def outputs(
        self, req: GenerateRequest
    ) -> AsyncIterator[worker_pb2.WorkerGenerateResponse]:
        """One admitted request's messages, transport-free: what ``Generate`` streams and what
        ``GenerateMany`` batches. Counts metrics; raises domain errors (unexpected ones are
        logged with the request id). Closing it early aborts the request in the engine. The
        caller tracks the request as in flight (``track`` / ``untrack``)."""
        rid = req.request_id
        metrics = self.metrics
        started = time.monotonic()
        log.debug("generate request_id=%s prompt_tokens=%d", rid, len(req.prompt_token_ids))
        last: OutputDelta | None = None
        last_token_s = 0.0  # when the previous message with tokens was sent; 0: none yet
        code = "CANCELLED"  # unless it ends otherwise (also when the client goes away)
        try:
            async for delta in self._engine.generate(req):
                last = delta
                if delta.token_ids:
                    now = time.monotonic()
                    if last_token_s == 0.0:
                        metrics.ttft_seconds.observe(now - started)
                        metrics.vllm.ttft.observe(now - started)
                    else:
                        itl = (now - last_token_s) / len(delta.token_ids)
                        metrics.itl_seconds.observe(itl)
                        metrics.vllm.itl.observe(itl)
                    last_token_s = now
                    metrics.completion_tokens.inc(len(delta.token_ids))
                    metrics.vllm.generation_tokens.inc(len(delta.token_ids))
                if delta.finish is not None:
                    split = delta.cached_split()
                    metrics.finished(
                        delta.prompt_tokens,
                        delta.cached_tokens,
                        {
                            "gpu": split.gpu,
                            "cpu": split.cpu,
                            "disk": split.disk,
                            "peer": split.peer,
                        },
                    )
                    metrics.vllm.finished(
                        delta.finish.reason,
                        delta.prompt_tokens,
                        delta.completion_tokens,
                        delta.timing,
                    )
                    code = "OK"  # a caller that stops reading after this has nothing to cancel
                yield response_to_pb(delta, self._worker_id)
            code = "OK"
        except errors.KvmeshError as exc:
            log.info("request_id=%s failed: %s", rid, exc)
            code = status_for(exc).name
            raise
        except asyncio.CancelledError:
            log.info("request_id=%s cancelled by the client or its deadline", rid)
            raise
        except Exception:
            code = "INTERNAL"
            raise
        finally:
            metrics.ended(code)
            if last is not None and last.finish is not None:
                log.info(
                    "finished request_id=%s reason=%s prompt_tokens=%d cached_tokens=%d "
                    "completion_tokens=%d ttft_s=%.3f total_s=%.3f",
                    rid,
                    last.finish.reason.value,
                    last.prompt_tokens,
                    last.cached_tokens,
                    last.completion_tokens,
                    last.timing.time_to_first_token_s if last.timing else 0.0,
                    time.monotonic() - started,
                )

    async def Abort(
        self, request: common_pb2.AbortRequest, context: grpc.aio.ServicerContext
    ) -> common_pb2.AbortResponse:
        rid = request.request_id
        if rid not in self._active:
            raise errors.NotFound(f"request {rid!r} is not in flight on this worker")
        await self._engine.abort(rid)
        log.info("aborted request_id=%s by Abort", rid)
        return common_pb2.AbortResponse()

    async def GetLoad(
        self, request: worker_pb2.GetLoadRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.WorkerLoad:
        return self.load()

    async def WatchLoad(
        self, request: worker_pb2.WatchLoadRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[worker_pb2.WorkerLoad]:
        interval = request.min_interval_s or self._load_interval_s
        if interval < 0:
            raise errors.InvalidArgument(
                f"min_interval_s must be >= 0 (0: the worker's default), got {interval:g}"
            )
        rank = request.data_parallel_rank if request.HasField("data_parallel_rank") else None
        self._check_rank(rank)
        last: worker_pb2.WorkerLoad | None = None
        while not self._closed:
            seen = self._changes.version
            load = self.load(rank)
            if load != last:
                yield load
                last = load
            await asyncio.sleep(interval)
            await self._changes.wait(seen)

    async def GetInfo(
        self, request: worker_pb2.GetInfoRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.WorkerInfo:
        info = self._engine.info
        return worker_pb2.WorkerInfo(
            worker_id=self._worker_id,
            model=info.model,
            max_model_len=info.max_model_len,
            block_size=info.block_size,
            vocab_size=info.vocab_size,
            role=ROLE_PB[self._role],
            data_parallel_size=max(info.data_parallel_size, 1),
        )

    async def WatchKvEvents(
        self, request: worker_pb2.WatchKvEventsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[worker_pb2.KvEventBatch]:
        hub = self._kv_events
        rank = request.data_parallel_rank if request.HasField("data_parallel_rank") else None
        self._check_rank(rank)
        if self.rank_kv_events:
            if rank is None:
                await context.abort(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"this worker's engine has {len(self.rank_kv_events)} data-parallel ranks, "
                    "each with its own KV cache: set data_parallel_rank to watch one",
                )
                return
            hub = self.rank_kv_events[rank]
        if hub is None:
            await context.abort(
                grpc.StatusCode.UNIMPLEMENTED, "this worker's engine publishes no KV events"
            )
            return
        async for msg in serve_kv_events(
            hub,
            request.epoch,
            request.from_seq,
            context,
            self._max_send_bytes,
            f"KV event (worker {self._worker_id})",
            "kv_snapshot_max_bytes",
        ):
            yield msg

    # ---- in-flight requests (Generate and GenerateMany) ------------------------------------
    def track(self, rid: str, token: object) -> None:
        """Counts ``rid`` in flight (served by the RPC or stream call ``token``)."""
        self._active[rid] = token
        self._idle.clear()
        self._changes.notify()

    def untrack(self, rid: str, token: object) -> None:
        """``rid`` is no longer in flight, unless another call took it over meanwhile."""
        if self._active.get(rid) is token:
            del self._active[rid]
            if not self._active:
                self._idle.set()
            self._changes.notify()

    # ---- internals -----------------------------------------------------------------------
    def _on_rpc_done(self, rid: str, token: object) -> None:
        """The RPC ended (also by cancel or deadline). If its stream was not closed, the engine
        may still run the request: abort it there."""
        if self._active.get(rid) is not token:
            return
        self.untrack(rid, token)
        if self._engine.is_running(rid):
            log.info("request_id=%s: RPC ended with the request still running; aborting", rid)
            task = asyncio.get_running_loop().create_task(self._abort_quietly(rid))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _abort_quietly(self, rid: str) -> None:
        try:
            await self._engine.abort(rid)
        except errors.NotFound:
            pass
        except Exception:
            log.exception("abort of request_id=%s failed", rid)
