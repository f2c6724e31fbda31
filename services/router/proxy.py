"""A request's worker attempts, until one sends the final message: each attempt that ends
without it goes to the lifecycle core (``core/lifecycle.py``), whose step this carries out: pick
another worker, resend without the hand-off, resume the stream elsewhere (``resume.py``), or
fail. One attempt's stream is ``attempt.py``'s, a disaggregated request's prefill
``disagg.py``'s.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncGenerator
from dataclasses import replace

from opentelemetry import trace

from kvmesh import errors
from kvmesh.telemetry import tracer
from kvmesh.v1 import common_pb2, router_pb2, worker_pb2

from .attempt import AttemptRunner, Ended
from .config import RouterConfig
from .core.disagg import DisaggHandler
from .core.lifecycle import Action, Outcome, Progress, RetryPolicy, Step, next_step
from .core.peers import PeerHints
from .core.types import RouteDecision, RouteRequest
from .core.workers import ModelSummary, WorkerSet
from .decode import Overlap, fell_back
from .metrics import RouterMetrics
from .prefill import Prefills
from .prompt import PromptBuilder
from .resume import Replay, held_back, resumed_route, resumed_sampling

log = logging.getLogger(__name__)
_tracer = tracer(__name__)


class Proxy:
    """Carries a request through its attempts (``run``)."""

    def __init__(
        self,
        config: RouterConfig,
        workers: WorkerSet,
        prompts: PromptBuilder,
        metrics: RouterMetrics,
        disagg: DisaggHandler,
        peers: PeerHints | None,
        attempts: AttemptRunner,
        prefills: Prefills,
    ) -> None:
        self._config = config
        self._retry = RetryPolicy(config.max_retries, config.max_resumes)
        self._workers = workers
        self._prompts = prompts
        self.metrics = metrics
        self._disagg = disagg
        self._peers = peers  # None: no peer hints
        self._attempts = attempts
        self._prefills = prefills

    async def run(
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
                yield _final_after_lost_end(route, Ended(), replay)
                return
            route, sampling = resumed
        overlap = Overlap()
        handoff: worker_pb2.KvSource | None = None  # set once a prefill worker computed the KV
        try:
            while True:
                decision, prefill = self._route(route, progress, handoff is not None)
                if prefill is not None:
                    handoff = await self._prefills.hand_off(
                        route, prefill, sampling, deadline, overlap
                    )
                if overlap.task is not None and fell_back(overlap.task):
                    handoff, overlap.task = None, None  # the prefill fell back: nothing to wait for
                ended = Ended()
                attempt = self._attempts.run(
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

    def _carry_out(self, route: RouteRequest, ended: Ended, step: Step) -> None:
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

    async def _resume(
        self,
        route: RouteRequest,
        model: ModelSummary,
        sampling: common_pb2.SamplingParams,
        ended: Ended,
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

    def _with_peer(self, route: RouteRequest, decision: RouteDecision) -> RouteDecision:
        """The decision with a peer hint, when another node's kvmanager holds more of the
        prompt. Index trouble only costs the hint: the worker recomputes."""
        if self._peers is None or not route.block_hashes:
            return decision
        try:
            choice = self._peers.decide(route.block_hashes, decision.worker_id)
        except Exception:
            log.warning("peer hint for %s failed; sending none", route.request_id, exc_info=True)
            return decision
        if choice.hint is None and choice.skipped is None and choice.store_blocks is None:
            return decision
        return replace(
            decision,
            peer=choice.hint,
            peer_skipped=choice.skipped,
            store_prefix_blocks=choice.store_blocks,
        )


def _final_after_lost_end(
    route: RouteRequest, ended: Ended, replay: Replay
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
