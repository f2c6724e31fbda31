"""One worker attempt of a request: the worker call, proxied message by message (the only
per-token work of the router), with its metrics, first-token and resume bookkeeping. An attempt
that stops short of the final message says how in ``Ended``; the request's loop (``proxy.py``)
asks the lifecycle core what comes next.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncGenerator, Callable, Sequence
from dataclasses import dataclass, field

import grpc
from opentelemetry import trace

from kvmesh.discovery.keys import WorkerId
from kvmesh.grpc_errors import await_status, from_rpc_error
from kvmesh.kv.events import BlockHash
from kvmesh.v1 import common_pb2, router_pb2, worker_pb2, worker_pb2_grpc

from .config import RouterConfig
from .core.lifecycle import Attempt, Outcome
from .core.routing import RoutingPolicy
from .core.types import PeerHint, RouteDecision, RouteRequest
from .core.workers import WorkerSet
from .decode import EndedEarly, Overlap, decode_stream
from .metrics import RouterMetrics
from .mux import MuxCall
from .pool import WorkerPool
from .resume import Replay

log = logging.getLogger(__name__)
# A final message's finish reason, as the metrics label it (vLLM's finished_reason values).
FINISH_NAMES = {
    common_pb2.FINISH_REASON_STOP: "stop",
    common_pb2.FINISH_REASON_LENGTH: "length",
    common_pb2.FINISH_REASON_ABORT: "abort",
}


@dataclass(slots=True)
class Active:
    """A request in flight on this router: the worker that has it (Abort goes there)."""

    worker_id: WorkerId
    tenant: str = ""  # whose request it is (Abort by another tenant: NOT_FOUND)


@dataclass(slots=True)
class Ended:
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


class AttemptRunner:
    """Carries out worker attempts (``run``: one worker call each). ``active`` is the router's
    in-flight table (request id -> worker, for Abort), shared with ``disagg.Prefills``."""

    def __init__(
        self,
        config: RouterConfig,
        workers: WorkerSet,
        pool: WorkerPool,
        policy: RoutingPolicy,
        metrics: RouterMetrics,
        active: dict[str, Active],
        computed: Callable[[Sequence[BlockHash], WorkerId], None] | None = None,
    ) -> None:
        self._config = config
        # Told of each prompt a worker has just computed (its first token): PeerHints.computed.
        self._computed = computed
        self._workers = workers
        self._pool = pool
        self._policy = policy
        self.metrics = metrics
        self._active = active

    async def run(
        self,
        route: RouteRequest,
        decision: RouteDecision,
        sampling: common_pb2.SamplingParams,
        handoff: worker_pb2.KvSource | None,
        deadline: float,
        arrived: float,
        overlap: Overlap,
        ended: Ended,
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
        self._active[route.request_id] = Active(wid, route.tenant)
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
                cache_salt=route.cache_salt,
                priority=route.priority,
                store_prefix_blocks=decision.store_prefix_blocks,
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
                    if self._computed is not None and handoff is None and route.block_hashes:
                        # It computed the prompt (a disaggregated decode loaded it: its
                        # prefill worker's save is what the hand-off already waits for).
                        self._computed(route.block_hashes, wid)
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
            _peer_text(peer, decision.peer_skipped),
        )
        self.metrics.routed(
            route.model,
            route.prompt_tokens,
            explanation.cached_tokens if explanation is not None else 0,
        )
        if peer is not None:
            self.metrics.peer_hints.labels(route.model).inc()
            self.metrics.peer_hint_blocks.labels(route.model).inc(peer.gain_blocks)
        if decision.peer_skipped is not None:
            self.metrics.peer_hints_skipped.labels(route.model).inc()

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


def kv_source_pb(peer: PeerHint | None) -> worker_pb2.KvSource | None:
    if peer is None:
        return None
    return worker_pb2.KvSource(
        kvmanager_id=peer.kvmanager_id,
        blocks=peer.blocks,
        max_fetch_s=peer.max_fetch_s,
        handoff_wait_s=peer.wait_s,
    )


def _peer_text(peer: PeerHint | None, skipped: PeerHint | None) -> str:
    """The routing log line's peer part: the peer named (and its price, when priced), and one
    left out as slower than recomputing."""
    out = ""
    if peer is not None:
        out = f" peer={peer.kvmanager_id} peer_blocks={peer.blocks}"
        if peer.wait_s:  # the node's own store, a sibling's save on the way (core/peers.py)
            out += f" wait_s={peer.wait_s:.3f}"
        elif peer.max_fetch_s:
            out += (
                f" fetch_s={peer.fetch_s:.3f} recompute_s={peer.recompute_s:.3f}"
                f" max_fetch_s={peer.max_fetch_s:.3f}{' probe' if peer.probe else ''}"
            )
    if skipped is not None:
        out += f" {skipped.skipped_text()}"
    return out


def trace_first_token(ttft_s: float) -> None:
    trace.get_current_span().add_event("first_token", {"ttft_s": ttft_s})
