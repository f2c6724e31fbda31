"""The life of one request across its worker attempts: after each attempt that ended without
the final message, what comes next. Pure: no grpc, asyncio or I/O; the router
(``services/router/attempt.py``) turns a worker call's end into an ``Attempt``, and
``services/router/proxy.py`` asks ``next_step`` and carries the ``Step`` out (picks again, resends, raises the error, counts).

One request, one ``Progress`` (which workers were tried, why the last one was given up); one
``Step`` per ended attempt, never per token:

| the attempt ended                           | next                                        |
|---------------------------------------------|---------------------------------------------|
| worker gone between the pick and the call   | retry elsewhere (not counted as a retry)    |
| overlapped hand-off lost, nothing sent yet  | resend without the hand-off (same request)  |
| no first token within the timeout           | retry elsewhere, within ``max_retries``     |
| unavailable before the first token          | retry elsewhere within ``max_retries``, the |
|                                             | worker marked draining; else fail           |
| the request's own deadline                  | fail: DEADLINE_EXCEEDED                     |
| any failure after tokens were streamed      | resume elsewhere (prompt + the tokens the   |
|                                             | client has), within ``max_resumes``, unless |
|                                             | the request cannot be replayed; else fail:  |
|                                             | UNAVAILABLE, naming the worker              |
| any other status before the first token     | fail with the worker's own error            |

Every failure is one the client may retry as a whole, except the worker's own errors (an
INVALID_ARGUMENT stays one) and the deadline.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import StrEnum

from kvmesh.discovery.keys import WorkerId
from kvmesh.errors import DeadlineExceeded, KvmeshError, Unavailable


class Outcome(StrEnum):
    """How a worker attempt ended without its final message (a closed set, safe as a label)."""

    WORKER_GONE = "worker-gone"  # the picked worker left between the pick and the call
    HANDOFF_LOST = "handoff-lost"  # the overlapped prefill fell back before any output came
    NO_FIRST_TOKEN = "no-first-token"  # nothing within the first-token timeout
    UNAVAILABLE = "unavailable"  # the call ended UNAVAILABLE (died, draining, unreachable)
    DEADLINE = "deadline"  # the call ran out of the request's own deadline
    FAILED = "failed"  # any other status of the call


class Action(StrEnum):
    """What the router does next."""

    RETRY_ELSEWHERE = "retry-elsewhere"  # pick another worker (not tried yet) and call it
    RESEND_WITHOUT_HANDOFF = "resend-without-handoff"  # pick again, aggregated: no kv_source
    # Continue the stream on another worker (not tried yet): the prompt plus the tokens the
    # client has, the rest of max_tokens (docs/failover.md). ``Step.error``: what the client
    # gets if that cannot be done (no worker left, nothing left to generate).
    RESUME_ELSEWHERE = "resume-elsewhere"
    FAIL = "fail"  # raise ``Step.error``


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    max_retries: int = 1  # other workers tried after failures before the first token
    # Mid-stream failures resumed on another worker (``Action.RESUME_ELSEWHERE``) per request;
    # past it (or 0) they fail. Not counted against ``max_retries``.
    max_resumes: int = 0


@dataclass(frozen=True, slots=True)
class Attempt:
    """One worker attempt that ended without its final message."""

    worker_id: WorkerId
    outcome: Outcome
    # The client has output (a token or the final message): from this attempt, or from the
    # attempts a resumed request replays.
    answered: bool = False
    streamed_tokens: int = 0  # tokens the client has (all attempts of the request)
    code: str = ""  # the call's gRPC status name (UNAVAILABLE ...), when it ended with one
    details: str = ""  # the status details
    waited_s: float = 0.0  # NO_FIRST_TOKEN: how long the worker had for its first output
    # FAILED: the worker's status as a domain error (the one table), passed on unchanged when
    # nothing was streamed; None: a status the table does not know.
    cause: KvmeshError | None = None


@dataclass(frozen=True, slots=True)
class Progress:
    """One request's state between attempts."""

    request_id: str
    tried: frozenset[WorkerId] = frozenset()  # given up for this request: never picked again
    last_failure: str = ""  # why the last worker was given up (the final error says it)
    attempts: int = 0  # attempts ended so far (0: the first pick makes the P/D decision)
    resumes: int = 0  # mid-stream failures resumed elsewhere so far
    # Why this request cannot be resumed mid-stream (e.g. a structured output, whose grammar
    # state a replay does not restore); empty: it can.
    not_resumable: str = ""

    def exhausted(self) -> Unavailable | None:
        """The error when no untried candidate is left: the last failure's, when there was one
        (None: nothing failed yet, the pick itself says why there is no worker)."""
        if not self.last_failure:
            return None
        return Unavailable(f"{self.last_failure}; no other serving worker to try")


@dataclass(frozen=True, slots=True)
class Step:
    action: Action
    progress: Progress  # the request's state for the next attempt
    error: KvmeshError | None = None  # FAIL: what the client gets (RESUME: if it cannot resume)
    counted: bool = False  # a retry, as ``kvmesh_router_retries_total`` counts them
    drain_worker: bool = False  # route nothing more to the worker until discovery says otherwise


def next_step(progress: Progress, attempt: Attempt, policy: RetryPolicy) -> Step:
    """What comes after ``attempt`` ended without its final message."""
    wid = attempt.worker_id
    done = replace(progress, attempts=progress.attempts + 1)
    outcome = attempt.outcome
    if outcome is Outcome.WORKER_GONE:
        return Step(Action.RETRY_ELSEWHERE, replace(done, tried=done.tried | {wid}))
    if outcome is Outcome.HANDOFF_LOST:
        return Step(Action.RESEND_WITHOUT_HANDOFF, done)
    # Workers given up mid-stream are resumes (their own budget), not retries.
    retries_left = len(progress.tried) - progress.resumes < policy.max_retries
    if outcome is Outcome.NO_FIRST_TOKEN:
        why = f"worker {wid} sent no token in {attempt.waited_s:.1f}s (--first-token-timeout-s)"
        gave_up = replace(done, tried=done.tried | {wid}, last_failure=why)
        if retries_left:
            return Step(Action.RETRY_ELSEWHERE, gave_up, counted=True)
        return Step(Action.FAIL, gave_up, Unavailable(f"{why}; retry the request"))
    if outcome is Outcome.DEADLINE:
        return Step(
            Action.FAIL,
            done,
            DeadlineExceeded(f"request {progress.request_id} did not finish within its deadline"),
        )
    if outcome is Outcome.UNAVAILABLE and not attempt.answered and retries_left:
        why = f"worker {wid} unavailable: {attempt.details}"
        gave_up = replace(done, tried=done.tried | {wid}, last_failure=why)
        return Step(Action.RETRY_ELSEWHERE, gave_up, counted=True, drain_worker=True)
    if attempt.answered:
        return _after_tokens(done, attempt, policy)
    if outcome is Outcome.UNAVAILABLE:  # nobody else can take it over
        return Step(Action.FAIL, done, decode_failed(wid, attempt.code, attempt.details, 0))
    if attempt.cause is not None:
        return Step(Action.FAIL, done, attempt.cause)
    return Step(
        Action.FAIL, done, Unavailable(f"worker {wid} failed: {attempt.code}: {attempt.details}")
    )


def _after_tokens(done: Progress, attempt: Attempt, policy: RetryPolicy) -> Step:
    """A failure after the client got tokens: resumed elsewhere while the request may be, else
    the retryable error saying why not."""
    wid = attempt.worker_id
    failed = decode_failed(wid, attempt.code, attempt.details, attempt.streamed_tokens)
    if done.not_resumable:
        return Step(Action.FAIL, done, Unavailable(f"{failed} (not resumed: {done.not_resumable})"))
    if done.resumes >= policy.max_resumes:
        why = (
            f"resumed {done.resumes} time(s) already, --max-resumes {policy.max_resumes}"
            if policy.max_resumes > 0
            else "resuming is off, --max-resumes 0"
        )
        return Step(Action.FAIL, done, Unavailable(f"{failed} (not resumed: {why})"))
    resumed = replace(
        done, tried=done.tried | {wid}, last_failure=str(failed), resumes=done.resumes + 1
    )
    drain = attempt.outcome is Outcome.UNAVAILABLE  # as before the first token
    return Step(Action.RESUME_ELSEWHERE, resumed, failed, drain_worker=drain)


def decode_failed(
    worker_id: WorkerId, code: str, details: str, streamed_tokens: int
) -> Unavailable:
    """What the client gets when the worker streaming its answer fails and no other worker can
    take over: after tokens were streamed (they cannot be taken back) when the request is not
    resumed elsewhere, or before when no other worker is left. Whatever the worker's
    status (``code``, a gRPC status name; a killed worker's connection says only "Socket
    closed"), the request as a whole may be sent again: UNAVAILABLE, saying so and naming the
    worker. The caller's own deadline is not this (DEADLINE_EXCEEDED)."""
    when = (
        f"after {streamed_tokens} streamed token(s)"
        if streamed_tokens > 0
        else "before its first token, and no other worker could take the request"
    )
    return Unavailable(
        f"worker {worker_id} failed {when} ({code}: {details or 'no details'}); "
        "the answer is incomplete: retry the request"
    )
