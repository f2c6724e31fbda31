"""kvmesh.v1.Router over gRPC: converts messages, calls the core, proxies the worker stream."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass, field, replace

import grpc
from opentelemetry import trace

from kvmesh import errors
from kvmesh.discovery.keys import WorkerId
from kvmesh.grpc_errors import await_status, from_rpc_error, status_for
from kvmesh.sampling import (
    STRUCTURED_FIELD,
    check_prompt,
    check_sampling,
    sampling_from_pb,
    structured_output_pb,
)
from kvmesh.telemetry import tracer
from kvmesh.v1 import common_pb2, router_pb2, router_pb2_grpc, worker_pb2, worker_pb2_grpc

from .auth import CALLER
from .config import RouterConfig
from .core import validation
from .core.disagg import DisaggHandler
from .core.forced_tools import TOOLS_FIELD, ForcedChoice, ForcedKind, ToolDef, forced_output
from .core.index_types import StoreId
from .core.lifecycle import Action, Attempt, Outcome, Progress, RetryPolicy, Step, next_step
from .core.peers import PeerHints
from .core.routing import RoutingPolicy
from .core.types import ChatMessage, PeerHint, RouteDecision, RouteRequest
from .core.workers import ModelSummary, WorkerSet
from .decode import EndedEarly, Overlap, decode_stream, fell_back
from .disagg import Fallback, handoff_source, run_prefill
from .metrics import RouterMetrics
from .mux import MuxCall
from .pool import WorkerPool
from .prompt import PromptBuilder, PromptInput
from .resume import Replay, held_back, resumed_route, resumed_sampling
from .tokenizer import template_input

log = logging.getLogger(__name__)
# A final message's finish reason, as the metrics label it (vLLM's finished_reason values).
FINISH_NAMES = {
    common_pb2.FINISH_REASON_STOP: "stop",
    common_pb2.FINISH_REASON_LENGTH: "length",
    common_pb2.FINISH_REASON_ABORT: "abort",
}
_tracer = tracer(__name__)
_HANDOFF_WAIT_MARGIN_S = 1.0  # an overlapped decode waits this much past the prefill deadline


@dataclass(slots=True)
class _Active:
    worker_id: WorkerId
    tenant: str = ""  # whose request it is (Abort by another tenant: NOT_FOUND)


@dataclass(slots=True)
class _Ended:
    """How an attempt stopped short of the final message (None: it did not)."""

    attempt: Attempt | None = None
    cause: BaseException | None = None  # the worker call's error, chained to the client's
    # What the client got from this attempt, one message per chunk (a resume replays its
    # token ids; their text is the seam's).
    sent: list[router_pb2.GenerateResponse] = field(default_factory=list)


# The status a worker call ended with, as the lifecycle core names it (others: FAILED).
_OUTCOME_OF = {
    grpc.StatusCode.UNAVAILABLE: Outcome.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED: Outcome.DEADLINE,
}


class RouterServicer(router_pb2_grpc.RouterServicer):
    def __init__(
        self,
        config: RouterConfig,
        workers: WorkerSet,
        pool: WorkerPool,
        policy: RoutingPolicy,
        prompts: PromptBuilder,
        metrics: RouterMetrics | None = None,
        peers: PeerHints | None = None,
        disagg: DisaggHandler | None = None,
        linked: Callable[[WorkerId], StoreId | None] | None = None,
    ) -> None:
        self._config = config
        self._retry = RetryPolicy(config.max_retries, config.max_resumes)
        # The worker -> node store link (the KV index's); None: no worker can hand KV over.
        self._linked: Callable[[WorkerId], StoreId | None] = linked or (lambda _w: None)
        self._disagg = disagg or DisaggHandler(
            config.disagg, policy, can_hand_off=lambda w: self._linked(w) is not None
        )
        self._peers = peers  # None: no peer hints
        self._workers = workers
        self._pool = pool
        self._policy = policy
        self._prompts = prompts
        self.metrics = metrics or RouterMetrics()
        self.metrics.in_flight.set_function(lambda: len(self._active))
        self._active: dict[str, _Active] = {}
        self.draining = False
        self.not_ready = ""  # while starting: why new requests are refused ("": ready)

    # ---- Generate -------------------------------------------------------------------------
    def Generate(
        self, request: router_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[router_pb2.GenerateResponse]:
        # A plain function returning the generator: the host's error interceptor
        # (kvmesh.grpc_errors.ErrorStatus) maps what it raises, and its wrapper is the one hop
        # between gRPC and ``stream``. The id is set on the request, so an INTERNAL status
        # names the id this request is logged under.
        if not request.request_id:
            request.request_id = uuid.uuid4().hex
        return self.stream(request, request.request_id, context.time_remaining())

    async def stream(
        self,
        request: router_pb2.GenerateRequest,
        rid: str,
        time_remaining_s: float | None,
    ) -> AsyncGenerator[router_pb2.GenerateResponse, None]:
        """One request, transport-free: what ``Generate`` serves over gRPC and what the HTTP
        front door calls in-process (``http.backend.InProcessRouterBackend``). Raises domain
        errors; closing the generator early cancels the worker call (the engine aborts)."""
        arrived = time.monotonic()
        # The request's span: the RPC's server span (kvmesh.telemetry.ServerSpans), or the HTTP
        # front door's; the trace's root unless the client sent a trace context.
        request_span = trace.get_current_span()
        request_span.set_attribute("request_id", rid)
        model_name = ""
        code = "OK"
        finished = False  # the final chunk was handed out
        forced: ForcedChoice | None = None
        try:
            if rid in self._active:
                raise errors.InvalidArgument(
                    f"request_id {rid!r} is already in flight; use a unique id per request"
                )
            if self.draining:
                raise errors.Unavailable("router is shutting down; retry on another router")
            if self.not_ready:
                raise errors.Unavailable(
                    f"router is starting ({self.not_ready}); retry shortly or on another router"
                )
            model = self._resolve_model(request.model)
            model_name = model.name
            request_span.set_attribute("model", model_name)
            sampling = sampling_from_pb(request.sampling)
            check_sampling(sampling, model.vocab_size)
            prompt = await self._prompts.build(
                model.name,
                model.model_path,
                model.block_size,
                request.session_id,
                self._prompt_input(request),
                lambda ids: check_prompt(
                    ids, sampling.max_tokens, model.vocab_size, model.max_model_len
                ),
            )
            ids, hashed = prompt.token_ids, prompt.hashed
            sampling_pb = request.sampling
            forced = forced_choice(request)
            if forced is not None:  # constrained to the tool calls, whatever else was asked
                sampling_pb = common_pb2.SamplingParams()
                sampling_pb.CopyFrom(request.sampling)
                sampling_pb.structured_output.CopyFrom(
                    structured_output_pb(
                        forced_output(forced, tool_defs(request.chat)),
                        common_pb2.StructuredOutput,
                    )
                )
            route = RouteRequest(
                request_id=rid,
                model=model.name,
                prompt_token_ids=tuple(ids),
                session_id=request.session_id,
                tenant=request.tenant,
                priority=request.priority,
                block_hashes=hashed.hashes,
            )
            if forced is not None or sampling_pb.HasField("structured_output"):
                not_resumable = "a structured output's grammar state cannot be replayed"
            else:
                not_resumable = ""
            resume = request.resume  # the client's, after its router failed mid-stream
            validation.check_resume(
                resume.token_ids, resume.text, sampling.max_tokens, model.vocab_size, not_resumable
            )
            replay = Replay.from_client(len(ids), resume) if resume.token_ids else None
            chunks = self._proxy(
                route, model, sampling_pb, time_remaining_s, arrived, not_resumable, replay
            )
            async with contextlib.aclosing(chunks):
                async for chunk in chunks:
                    finished = chunk.HasField("finished")
                    yield chunk
        except errors.KvmeshError as exc:
            code = status_for(exc).name
            log.info("request %s rejected: %s: %s", rid, type(exc).__name__, exc)
            if (
                forced is not None
                and isinstance(exc, errors.InvalidArgument)
                and exc.field == STRUCTURED_FIELD
            ):  # the schema came from the tools: they are what to fix
                raise errors.InvalidArgument(
                    f"the engine cannot constrain the output to calls of chat.tools (forced "
                    f"chat.tool_choice): {exc}",
                    TOOLS_FIELD,
                ) from exc
            raise
        except (asyncio.CancelledError, GeneratorExit):
            # A caller that stops reading after the final chunk (the HTTP front door) ends a
            # finished request: that is OK, not a cancel.
            if not finished:
                code = "CANCELLED"
                log.info("request %s cancelled by the client", rid)
            raise
        except Exception:
            code = "INTERNAL"
            raise
        finally:
            self.metrics.ended(model_name, code)

    async def count_tokens(self, request: router_pb2.GenerateRequest) -> int:
        """The prompt tokens ``request`` has (its chat template rendered with its tools), without
        routing or generating: the Anthropic front door's count_tokens."""
        model = self._resolve_model(request.model)
        return await self._prompts.count(model.name, model.model_path, self._prompt_input(request))

    def _resolve_model(self, name: str) -> ModelSummary:
        models = self._workers.models()
        if not models:
            raise errors.Unavailable(
                "no worker is registered and serving; start one (kvmesh up / kvmesh worker)"
            )
        if not name:
            if len(models) == 1:
                return models[0]
            raise errors.InvalidArgument(
                f"several models are served ({', '.join(m.name for m in models)}); set model",
                "model",
            )
        for m in models:
            if m.name == name:
                return m
        raise errors.NotFound(
            f"model {name!r} is not served; served models: {', '.join(m.name for m in models)}"
        )

    def _prompt_input(self, request: router_pb2.GenerateRequest) -> PromptInput:
        kind = request.WhichOneof("input")
        if kind == "text":
            validation.check_text(request.text)
            return PromptInput(text=request.text)
        if kind == "chat":
            messages = [
                ChatMessage(m.role, m.content, m.name, m.tool_call_id)
                for m in request.chat.messages
            ]
            validation.check_chat(messages)
            return PromptInput(chat=template_input(request.chat))  # tool calls and tools, checked
        if kind == "token_ids":
            return PromptInput(token_ids=request.token_ids.ids)
        raise errors.InvalidArgument("no input: set one of text, chat or token_ids")

    async def _proxy(
        self,
        route: RouteRequest,
        model: ModelSummary,
        sampling: common_pb2.SamplingParams,
        time_remaining_s: float | None,
        arrived: float,
        not_resumable: str = "",
        client_resume: Replay | None = None,
    ) -> AsyncGenerator[router_pb2.GenerateResponse, None]:
        """The request's worker attempts, until one sends the final message. Each attempt that
        ends without it goes to the lifecycle core (``core/lifecycle.py``), whose step this
        carries out: pick another worker, resend without the hand-off, resume the stream
        elsewhere, or fail. ``client_resume``: what the client has of the answer (it resumes
        the request through this router); the first attempt goes on from there."""
        deadline = arrived + (
            time_remaining_s if time_remaining_s is not None else self._config.default_timeout_s
        )
        progress = Progress(route.request_id, not_resumable=not_resumable)
        replay = client_resume or Replay(route.prompt_tokens)
        if client_resume is not None:  # as a resume after a worker failed, without the failure
            resumed = await self._replayed(route, model, sampling, replay.token_ids, replay, "")
            if resumed is None:  # the client has every token: only the final message was lost
                yield _final_after_lost_end(route, _Ended(), replay)
                return
            route, sampling = resumed
        overlap = Overlap()
        handoff: worker_pb2.KvSource | None = None  # set once a prefill worker computed the KV
        try:
            while True:
                decision, prefill = self._route(route, progress, handoff is not None)
                if prefill is not None:
                    handoff = await self._hand_off(route, prefill, sampling, deadline, overlap)
                if overlap.task is not None and fell_back(overlap.task):
                    handoff, overlap.task = None, None  # the prefill fell back: nothing to wait for
                ended = _Ended()
                attempt = self._attempt(
                    route, decision, sampling, handoff, deadline, arrived, overlap, ended, replay
                )
                async with contextlib.aclosing(attempt):
                    async for out in attempt:
                        yield out
                if ended.attempt is None:
                    return  # the worker's stream ended (with the final message)
                step = next_step(progress, ended.attempt, self._retry)
                self._carry_out(route, ended, step)
                progress = step.progress
                if step.action is Action.RESEND_WITHOUT_HANDOFF:
                    handoff, overlap.task = None, None
                elif step.action is Action.RESUME_ELSEWHERE:
                    resumed = await self._resume(route, model, sampling, ended, step, replay)
                    if resumed is None:  # every token was sent; only the final message was lost
                        yield _final_after_lost_end(route, ended, replay)
                        return
                    route, sampling = resumed
                    if overlap.task is not None and not overlap.task.done():
                        overlap.task.cancel()
                    handoff, overlap.task = None, None  # the new worker finds the KV itself
        finally:
            if overlap.task is not None and not overlap.task.done():
                overlap.task.cancel()  # nobody needs its KV any more; it aborts its engine call

    def _route(
        self, route: RouteRequest, progress: Progress, handing_off: bool
    ) -> tuple[RouteDecision, RouteDecision | None]:
        """The attempt's decode worker, and on the first attempt the prefill worker of a
        disaggregated request (the P/D decision is made once: a retry only picks another
        decode worker). Span ``route``."""
        candidates = [
            v
            for v in self._workers.candidates(route.model)
            if v.record.worker_id not in progress.tried
        ]
        if not candidates and (exhausted := progress.exhausted()) is not None:
            raise exhausted
        with _tracer.start_as_current_span("route") as span:
            started = time.perf_counter()
            prefill: RouteDecision | None = None
            if progress.attempts == 0:
                dd = self._disagg.decide(route, candidates)
                decision, prefill = dd.decode, dd.prefill
                self.metrics.disagg_decisions.labels(route.model, dd.reason.value).inc()
                span.set_attribute("disagg", dd.reason.value)
                span.set_attribute("uncached_tokens", dd.uncached_tokens)
            else:
                try:
                    decision = self._disagg.pick_decode(route, candidates)
                except errors.Unavailable as exc:  # prefill workers left: the failure says why
                    if (exhausted := progress.exhausted()) is None:
                        raise
                    raise exhausted from exc
            if not handing_off and prefill is None:
                decision = self._with_peer(route, decision)
            self.metrics.decided(decision, time.perf_counter() - started)
            span.set_attributes(decision.attributes())
        return decision, prefill

    async def _hand_off(
        self,
        route: RouteRequest,
        prefill: RouteDecision,
        sampling: common_pb2.SamplingParams,
        deadline: float,
        overlap: Overlap,
    ) -> worker_pb2.KvSource | None:
        """The decode call's ``kv_source`` of a disaggregated request: at once with the prefill
        started as ``overlap.task`` (overlapped), or after the prefill; None: aggregated."""
        if self._disagg.config.overlap:
            handoff, overlap.task = self._start_prefill(route, prefill, sampling, deadline)
            return handoff
        return await self._prefill(route, prefill, sampling, deadline)

    def _carry_out(self, route: RouteRequest, ended: _Ended, step: Step) -> None:
        """Logs and counts an ended attempt's step; raises its error when the request fails."""
        attempt = ended.attempt
        assert attempt is not None
        if attempt.outcome is Outcome.NO_FIRST_TOKEN:
            log.warning("%s for %s", step.progress.last_failure, route.request_id)
        if step.action is Action.FAIL:
            assert step.error is not None
            raise step.error from ended.cause
        if step.action is Action.RESUME_ELSEWHERE:
            log.warning(
                "request %s: worker %s failed mid-stream (%s: %s); resuming it elsewhere "
                "(resume %d of at most %d)",
                route.request_id,
                attempt.worker_id,
                attempt.code,
                attempt.details,
                step.progress.resumes,
                self._retry.max_resumes,
            )
        elif step.action is Action.RESEND_WITHOUT_HANDOFF:
            log.info(
                "request %s: its overlapped prefill fell back; the decode request is sent"
                " again, aggregated",
                route.request_id,
            )
        elif attempt.outcome is Outcome.UNAVAILABLE:
            log.warning(
                "worker %s unavailable before the first token of %s; retrying elsewhere",
                attempt.worker_id,
                route.request_id,
            )
        if step.drain_worker:
            self._workers.mark_draining(attempt.worker_id)
        if step.counted:
            self.metrics.retries.inc()

    async def _attempt(
        self,
        route: RouteRequest,
        decision: RouteDecision,
        sampling: common_pb2.SamplingParams,
        handoff: worker_pb2.KvSource | None,
        deadline: float,
        arrived: float,
        overlap: Overlap,
        ended: _Ended,
        replay: Replay,
    ) -> AsyncGenerator[router_pb2.GenerateResponse, None]:
        """One worker call, proxied message by message (the only per-token work of the
        router). An attempt that stops short of the final message says how in ``ended``; a
        resumed one (``replay``) continues the stream the client has."""
        wid = decision.worker_id
        stub = self._pool.stub(wid)
        if stub is None:  # left between pick and call
            ended.attempt = Attempt(wid, Outcome.WORKER_GONE)
            return
        self._routed(route, decision)
        metrics = self.metrics
        model = route.model
        # Checked once per attempt: the default path copies nothing more per chunk.
        with_logprobs = sampling.HasField("logprobs") or sampling.HasField("prompt_logprobs")
        resumed = replay.resumes > 0
        sent = ended.sent
        sent_any = False
        streamed = 0
        last_token_s = 0.0
        itl = metrics.itl_seconds.labels(model)  # per chunk: the labelled child, looked up once
        self._active[route.request_id] = _Active(wid, route.tenant)
        self._workers.started(wid)
        self._policy.on_routed(route, decision)
        dispatched = time.monotonic()
        call = self._call_worker(
            wid,
            stub,
            worker_pb2.WorkerGenerateRequest(
                request_id=route.request_id,
                prompt_token_ids=route.prompt_token_ids,
                sampling=sampling,
                kv_source=handoff if handoff is not None else kv_source_pb(decision.peer),
            ),
            max(deadline - time.monotonic(), 0.001),
        )
        first_token_s = self._config.first_token_timeout_s
        if handoff is not None:
            first_token_s += handoff.handoff_wait_s
        try:
            async for msg in decode_stream(call, overlap, first_token_s):
                out = router_pb2.GenerateResponse(
                    request_id=route.request_id, token_ids=msg.token_ids, text=msg.text
                )
                if with_logprobs:
                    out.logprobs.extend(msg.logprobs)
                    out.prompt_logprobs.extend(msg.prompt_logprobs)
                finished = msg.HasField("finished")
                if finished:
                    out.finished.CopyFrom(msg.finished)
                    out.finished.usage.worker_id = wid
                    metrics.cached_tokens.labels(model).inc(msg.finished.usage.cached_prompt_tokens)
                # A resumed attempt: the stream the client has goes on (its text across the
                # seam, its usage); True: a stop string across the seam ends it here.
                seam_stop = resumed and self._resumed(route, wid, replay, msg, out, streamed)
                finished = finished or seam_stop
                now = time.monotonic()
                if finished:
                    u = out.finished.usage
                    metrics.finished(
                        model,
                        FINISH_NAMES.get(out.finished.reason, "unknown"),
                        u.completion_tokens,
                        now - arrived,
                        dispatched - arrived,
                        (u.queue_time_s, u.prefill_time_s, u.decode_time_s),
                    )
                if not sent_any and (msg.token_ids or finished):
                    ttft = now - arrived
                    if resumed:  # the client had its first token from the first attempt
                        if finished:
                            out.finished.usage.time_to_first_token_s = replay.ttft_s
                    else:
                        replay.ttft_s = ttft
                        if finished:
                            out.finished.usage.time_to_first_token_s = ttft
                        trace_first_token(ttft)
                        metrics.ttft_seconds.labels(model).observe(ttft)
                    self._policy.on_first_token(route, wid)
                    sent_any = True
                elif msg.token_ids:
                    per_token = (now - last_token_s) / len(msg.token_ids)
                    itl.observe(per_token)
                if msg.token_ids:
                    last_token_s = now
                    streamed += len(msg.token_ids)
                if finished and not seam_stop:  # the worker's status first: this RPC ends
                    await await_status(call)  # with its message
                sent.append(out)
                yield out
                if seam_stop:
                    return  # the worker's call is cancelled below
        except EndedEarly as exc:
            ended.attempt = Attempt(wid, exc.outcome, waited_s=first_token_s)
        except grpc.aio.AioRpcError as exc:
            code = exc.code()
            ended.cause = exc
            ended.attempt = Attempt(
                wid,
                _OUTCOME_OF.get(code, Outcome.FAILED),
                answered=sent_any or resumed,
                streamed_tokens=replay.tokens + streamed,
                code=code.name,
                details=exc.details() or "",
                cause=from_rpc_error(exc),
            )
        finally:
            call.cancel()  # no-op when finished; aborts the engine request otherwise
            self._workers.finished(wid)
            self._policy.on_finished(route, wid)
            self._active.pop(route.request_id, None)

    def _resumed(
        self,
        route: RouteRequest,
        wid: WorkerId,
        replay: Replay,
        msg: worker_pb2.WorkerGenerateResponse,
        out: router_pb2.GenerateResponse,
        streamed: int,
    ) -> bool:
        """A resumed attempt's message as the client's stream (``Replay.go_on``), counted on
        its final message. True: a stop string across the seam ended the request."""
        stopped, recomputed = replay.go_on(route.prompt_tokens, wid, msg, out, streamed)
        if out.HasField("finished"):
            self.metrics.resume_recomputed_tokens.labels(route.model).inc(recomputed)
            span = trace.get_current_span()
            span.set_attribute("resumes", replay.resumes)
            span.set_attribute("resume_recomputed_tokens", replay.recomputed)
        return stopped

    async def _resume(
        self,
        route: RouteRequest,
        model: ModelSummary,
        sampling: common_pb2.SamplingParams,
        ended: _Ended,
        step: Step,
        replay: Replay,
    ) -> tuple[RouteRequest, common_pb2.SamplingParams] | None:
        """The next attempt of a request whose worker failed mid-stream (``resume.py``): the
        prompt plus every token the client has, the rest of max_tokens, the same sampling, the
        stop strings watched across the seam (docs/failover.md). Routed as any request (the KV
        index finds who holds the blocks), the failed worker excluded. None when every
        max_tokens token was sent (only the final message was lost: nothing to generate)."""
        ids = replay.record(ended.sent, step.progress.resumes)
        failed = ended.attempt.worker_id if ended.attempt else ""
        return await self._replayed(route, model, sampling, ids, replay, failed)

    async def _replayed(
        self,
        route: RouteRequest,
        model: ModelSummary,
        sampling: common_pb2.SamplingParams,
        ids: list[int],
        replay: Replay,
        failed_worker_id: str,
    ) -> tuple[RouteRequest, common_pb2.SamplingParams] | None:
        """``_resume`` after the tokens ``ids`` were taken in (``replay``); also a client's
        resume through this router (``failed_worker_id`` empty)."""
        resumed = resumed_sampling(sampling, len(ids))
        if resumed is None:  # every token was sent, not the final message: nothing to resume
            return None
        new_route = await resumed_route(self._prompts, model, route, ids)
        stops = tuple(s for s in sampling.stop if s)
        if stops:
            replay.watch_seam(
                stops, await held_back(self._prompts, model, replay, route.request_id)
            )
        trace.get_current_span().add_event(
            "resume",
            {
                "failed_worker_id": failed_worker_id,
                "resume": replay.resumes,
                "replayed_tokens": replay.tokens,
                "max_tokens_left": resumed.max_tokens,
            },
        )
        self.metrics.resumes.labels(route.model).inc()
        return new_route, resumed

    def _routed(self, route: RouteRequest, decision: RouteDecision) -> None:
        """Logs and counts the decision an attempt is about to carry out."""
        explanation = decision.explanation
        peer = decision.peer
        log.info(
            "request %s -> worker %s (%s: %s) predicted_cached_blocks=%d of %d (gpu %d)%s",
            route.request_id,
            decision.worker_id,
            decision.policy,
            decision.reason,
            explanation.cached_blocks if explanation is not None else -1,
            len(route.block_hashes),
            explanation.cached_gpu_blocks if explanation is not None else -1,
            f" peer={peer.kvmanager_id} peer_blocks={peer.blocks}" if peer else "",
        )
        self.metrics.routed(
            route.model,
            route.prompt_tokens,
            explanation.cached_tokens if explanation is not None else 0,
        )
        if peer is not None:
            self.metrics.peer_hints.labels(route.model).inc()
            self.metrics.peer_hint_blocks.labels(route.model).inc(peer.gain_blocks)

    def _call_worker(
        self,
        wid: WorkerId,
        stub: worker_pb2_grpc.WorkerStub,
        request: worker_pb2.WorkerGenerateRequest,
        timeout_s: float,
    ) -> MuxCall | grpc.aio.UnaryStreamCall:
        """The worker call of one request: on the worker's ``GenerateMany`` stream (outputs
        batched per engine step), or its own ``Generate`` call (``--no-worker-mux``)."""
        mux = self._pool.mux(wid) if self._config.worker_mux else None
        if mux is not None:
            return mux.generate(request, timeout_s)
        return stub.Generate(request, timeout=timeout_s)

    def _start_prefill(
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
            self._prefill_fallback(route, decision.worker_id)
            return None, None
        task = asyncio.create_task(
            self._prefill(route, decision, sampling, deadline, track=False),
            name=f"prefill-{route.request_id}",
        )
        # The router ends the wait itself when the prefill falls back (it sends the decode
        # request again without the hint); the worker's own bound is a backstop past that.
        left = deadline - time.monotonic()
        wait_s = self._disagg.config.prefill_timeout_s + _HANDOFF_WAIT_MARGIN_S
        source.handoff_wait_s = max(0.001, min(left, wait_s, 600.0))
        return source, task

    def _prefill_fallback(self, route: RouteRequest, wid: WorkerId) -> None:
        stub = self._pool.stub(wid)
        fallback = Fallback.PREFILL_GONE if stub is None else Fallback.NO_KVMANAGER
        self.metrics.disagg_fallbacks.labels(route.model, fallback.value).inc()

    async def _prefill(
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
            self._prefill_fallback(route, wid)
            return None
        if track:
            self._active[route.request_id] = _Active(wid, route.tenant)
        self._workers.started(wid)
        self._policy.on_routed(route, decision)
        try:
            left = deadline - time.monotonic()
            with _tracer.start_as_current_span("prefill") as span:
                span.set_attribute("worker_id", wid)
                result = await run_prefill(
                    stub, route, sampling, min(left, self._disagg.config.prefill_timeout_s)
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

    def _with_peer(self, route: RouteRequest, decision: RouteDecision) -> RouteDecision:
        """The decision with a peer hint, when another node's kvmanager holds more of the
        prompt. Index trouble only costs the hint: the worker recomputes."""
        if self._peers is None or not route.block_hashes:
            return decision
        try:
            peer = self._peers.hint(route.block_hashes, decision.worker_id)
        except Exception:
            log.warning("peer hint for %s failed; sending none", route.request_id, exc_info=True)
            return decision
        return decision if peer is None else replace(decision, peer=peer)

    # ---- Abort, ListModels ----------------------------------------------------------------
    async def Abort(
        self, request: common_pb2.AbortRequest, context: grpc.aio.ServicerContext
    ) -> common_pb2.AbortResponse:
        active = self._active.get(request.request_id)
        caller = CALLER.get()  # with API keys: only the request's own tenant may abort it
        if active is None or (caller is not None and caller.tenant != active.tenant):
            raise errors.NotFound(f"request {request.request_id!r} is not in flight on this router")
        stub = self._pool.stub(active.worker_id)
        if stub is not None:
            try:
                await stub.Abort(
                    common_pb2.AbortRequest(request_id=request.request_id),
                    timeout=self._config.worker_call_timeout_s,
                )
            except grpc.aio.AioRpcError as exc:
                if exc.code() is not grpc.StatusCode.NOT_FOUND:  # finished meanwhile: fine
                    raise errors.Unavailable(f"abort failed: {exc.details()}") from exc
        return common_pb2.AbortResponse()

    async def ListModels(
        self, request: router_pb2.ListModelsRequest, context: grpc.aio.ServicerContext
    ) -> router_pb2.ListModelsResponse:
        return self.models()

    def models(self) -> router_pb2.ListModelsResponse:
        """The served models (``ListModels``; the HTTP front door's ``/v1/models``)."""
        return router_pb2.ListModelsResponse(
            models=[
                router_pb2.ModelInfo(
                    name=m.name,
                    max_model_len=m.max_model_len,
                    block_size=m.block_size,
                    workers=m.workers,
                )
                for m in self._workers.models()
            ]
        )

    @property
    def in_flight(self) -> int:
        return len(self._active)


def kv_source_pb(peer: PeerHint | None) -> worker_pb2.KvSource | None:
    if peer is None:
        return None
    return worker_pb2.KvSource(kvmanager_id=peer.kvmanager_id, blocks=peer.blocks)


def trace_first_token(ttft_s: float) -> None:
    trace.get_current_span().add_event("first_token", {"ttft_s": ttft_s})


def _final_after_lost_end(
    route: RouteRequest, ended: _Ended, replay: Replay
) -> router_pb2.GenerateResponse:
    """The final message of a request whose worker died after sending every one of its
    max_tokens tokens but before its final message: nothing is left to generate, so the
    answer is complete (finish reason length; cached token counts are unknown: 0)."""
    out = router_pb2.GenerateResponse(request_id=route.request_id)
    out.finished.reason = common_pb2.FINISH_REASON_LENGTH
    u = out.finished.usage
    u.prompt_tokens = replay.prompt_tokens
    u.completion_tokens = replay.tokens
    u.worker_id = ended.attempt.worker_id if ended.attempt is not None else ""
    u.resumes = max(replay.resumes - 1, 0)  # this one was not resumed: it was over
    u.resume_recomputed_tokens = replay.recomputed
    u.time_to_first_token_s = replay.ttft_s
    return out


def forced_choice(request: router_pb2.GenerateRequest) -> ForcedChoice | None:
    """A chat request's tool choice when it forces a call (REQUIRED, FUNCTION), else None."""
    if request.WhichOneof("input") != "chat":
        return None
    choice = request.chat.tool_choice
    if choice.mode == router_pb2.TOOL_CHOICE_MODE_REQUIRED:
        return ForcedChoice(ForcedKind.REQUIRED)
    if choice.mode == router_pb2.TOOL_CHOICE_MODE_FUNCTION:
        return ForcedChoice(ForcedKind.FUNCTION, choice.function_name)
    return None


def tool_defs(chat: router_pb2.ChatInput) -> list[ToolDef]:
    """``chat.tools`` with their parameter schemas parsed (``template_input`` checked them)."""
    return [
        ToolDef(t.name, json.loads(t.parameters_json) if t.parameters_json else None)
        for t in chat.tools
    ]
