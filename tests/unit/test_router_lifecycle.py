"""The request lifecycle across worker attempts (services/router/core/lifecycle.py): given how
an attempt ended, the next action, the error a failing request gets, and what is counted."""

from __future__ import annotations

from dataclasses import dataclass, replace

import grpc
import pytest

from kvmesh.discovery.keys import WorkerId
from kvmesh.errors import DeadlineExceeded, InvalidArgument, KvmeshError, Unavailable
from kvmesh.grpc_errors import status_for
from services.router.core.lifecycle import (
    Action,
    Attempt,
    Outcome,
    Progress,
    RetryPolicy,
    decode_failed,
    next_step,
)

W1, W2 = WorkerId("w1"), WorkerId("w2")
FRESH = Progress("req-1")
ONE_RETRY = RetryPolicy(max_retries=1)
RETRIED = Progress(
    "req-1", tried=frozenset({W2}), last_failure="worker w2 sent no token", attempts=1
)
RESUMING = RetryPolicy(max_retries=1, max_resumes=2)
ONCE_RESUMED = Progress(
    "req-1", tried=frozenset({W2}), last_failure="worker w2 failed", attempts=1, resumes=1
)


@dataclass(frozen=True)
class Row:
    progress: Progress
    attempt: Attempt
    action: Action
    error: type[KvmeshError] | None = None
    says: tuple[str, ...] = ()  # in the error's message
    counted: bool = False
    drain: bool = False
    tried: frozenset[WorkerId] = frozenset()  # after the step
    policy: RetryPolicy = ONE_RETRY
    resumes: int = 0  # after the step


def unavailable(
    answered: bool = False, streamed: int = 0, details: str = "Socket closed"
) -> Attempt:
    return Attempt(W1, Outcome.UNAVAILABLE, answered, streamed, "UNAVAILABLE", details)


ROWS = {
    "worker-gone-retries-uncounted": Row(
        FRESH, Attempt(W1, Outcome.WORKER_GONE), Action.RETRY_ELSEWHERE, tried=frozenset({W1})
    ),
    "worker-gone-even-past-max-retries": Row(
        RETRIED,
        Attempt(W1, Outcome.WORKER_GONE),
        Action.RETRY_ELSEWHERE,
        tried=frozenset({W1, W2}),
    ),
    "handoff-lost-resends-aggregated": Row(
        FRESH, Attempt(W1, Outcome.HANDOFF_LOST), Action.RESEND_WITHOUT_HANDOFF
    ),
    "handoff-lost-does-not-use-a-retry": Row(
        RETRIED,
        Attempt(W1, Outcome.HANDOFF_LOST),
        Action.RESEND_WITHOUT_HANDOFF,
        tried=RETRIED.tried,
    ),
    "no-first-token-retries": Row(
        FRESH,
        Attempt(W1, Outcome.NO_FIRST_TOKEN, waited_s=300.0),
        Action.RETRY_ELSEWHERE,
        counted=True,
        tried=frozenset({W1}),
    ),
    "no-first-token-out-of-retries-fails": Row(
        RETRIED,
        Attempt(W1, Outcome.NO_FIRST_TOKEN, waited_s=0.3),
        Action.FAIL,
        Unavailable,
        ("worker w1 sent no token in 0.3s (--first-token-timeout-s)", "; retry the request"),
        tried=frozenset({W1, W2}),
    ),
    "no-first-token-without-retries-fails": Row(
        FRESH,
        Attempt(W1, Outcome.NO_FIRST_TOKEN, waited_s=1.0),
        Action.FAIL,
        Unavailable,
        ("sent no token in 1.0s",),
        tried=frozenset({W1}),
        policy=RetryPolicy(max_retries=0),
    ),
    "unavailable-before-first-token-retries-and-drains": Row(
        FRESH,
        unavailable(),
        Action.RETRY_ELSEWHERE,
        counted=True,
        drain=True,
        tried=frozenset({W1}),
    ),
    "unavailable-before-first-token-out-of-retries-fails": Row(
        RETRIED,
        unavailable(details="failed to connect"),
        Action.FAIL,
        Unavailable,
        ("worker w1 failed before its first token, and no other worker could take", "UNAVAILABLE"),
        tried=RETRIED.tried,
    ),
    "unavailable-after-tokens-fails": Row(
        FRESH,
        unavailable(answered=True, streamed=37),
        Action.FAIL,
        Unavailable,
        ("after 37 streamed token(s)", "Socket closed", "retry the request"),
    ),
    "deadline-fails-with-deadline": Row(
        FRESH,
        Attempt(W1, Outcome.DEADLINE, code="DEADLINE_EXCEEDED"),
        Action.FAIL,
        DeadlineExceeded,
        ("request req-1 did not finish within its deadline",),
    ),
    "deadline-after-tokens-is-still-the-deadline": Row(
        FRESH,
        Attempt(W1, Outcome.DEADLINE, answered=True, streamed_tokens=3, code="DEADLINE_EXCEEDED"),
        Action.FAIL,
        DeadlineExceeded,
    ),
    "failed-after-tokens-is-unavailable": Row(
        FRESH,
        Attempt(W1, Outcome.FAILED, True, 1, "INTERNAL", "engine died", cause=None),
        Action.FAIL,
        Unavailable,
        ("after 1 streamed token(s)", "INTERNAL: engine died"),
    ),
    "failed-before-tokens-passes-the-worker-error-on": Row(
        FRESH,
        Attempt(W1, Outcome.FAILED, code="INVALID_ARGUMENT", cause=InvalidArgument("bad", "x")),
        Action.FAIL,
        InvalidArgument,
        ("bad",),
    ),
    "failed-before-tokens-unknown-status": Row(
        FRESH,
        Attempt(W1, Outcome.FAILED, code="INTERNAL", details="boom"),
        Action.FAIL,
        Unavailable,
        ("worker w1 failed: INTERNAL: boom",),
    ),
    "killed-mid-stream-resumes-elsewhere": Row(
        FRESH,
        unavailable(answered=True, streamed=5),
        Action.RESUME_ELSEWHERE,
        Unavailable,  # what the client gets if the stream cannot be resumed
        ("after 5 streamed token(s)",),
        drain=True,
        tried=frozenset({W1}),
        resumes=1,
        policy=RESUMING,
    ),
    "engine-died-mid-stream-resumes-without-draining": Row(
        FRESH,
        Attempt(W1, Outcome.FAILED, True, 5, "INTERNAL", "engine died"),
        Action.RESUME_ELSEWHERE,
        Unavailable,
        ("after 5 streamed token(s)", "INTERNAL: engine died"),
        tried=frozenset({W1}),
        resumes=1,
        policy=RESUMING,
    ),
    "resume-does-not-use-a-retry": Row(
        RETRIED,  # its one retry is spent
        unavailable(answered=True, streamed=5),
        Action.RESUME_ELSEWHERE,
        Unavailable,
        drain=True,
        tried=frozenset({W1, W2}),
        resumes=1,
        policy=RESUMING,
    ),
    "resumed-attempt-failing-before-its-first-token-resumes-again": Row(
        ONCE_RESUMED,  # answered: the client has the first attempt's tokens
        unavailable(answered=True, streamed=9),
        Action.RESUME_ELSEWHERE,
        Unavailable,
        ("after 9 streamed token(s)",),
        drain=True,
        tried=frozenset({W1, W2}),
        resumes=2,
        policy=RESUMING,
    ),
    "resumed-request-still-has-its-retry": Row(
        ONCE_RESUMED,  # W2 was resumed from, not retried
        Attempt(W1, Outcome.NO_FIRST_TOKEN, answered=True, waited_s=1.0),
        Action.RETRY_ELSEWHERE,
        counted=True,
        tried=frozenset({W1, W2}),
        resumes=1,
        policy=RESUMING,
    ),
    "past-max-resumes-fails-saying-so": Row(
        replace(ONCE_RESUMED, resumes=2),
        unavailable(answered=True, streamed=9),
        Action.FAIL,
        Unavailable,
        ("after 9 streamed token(s)", "retry the request", "resumed 2 time(s) already"),
        tried=frozenset({W2}),
        resumes=2,
        policy=RESUMING,
    ),
    "max-resumes-0-fails-mid-stream": Row(
        FRESH,
        Attempt(W1, Outcome.FAILED, True, 5, "INTERNAL", "engine died"),
        Action.FAIL,
        Unavailable,
        ("after 5 streamed token(s)", "resuming is off, --max-resumes 0"),
        policy=RetryPolicy(max_retries=1, max_resumes=0),
    ),
    "not-resumable-fails-saying-why": Row(
        replace(FRESH, not_resumable="a structured output"),
        unavailable(answered=True, streamed=5),
        Action.FAIL,
        Unavailable,
        ("after 5 streamed token(s)", "not resumed: a structured output"),
        policy=RESUMING,
    ),
    "deadline-mid-stream-is-not-resumed": Row(
        FRESH,
        Attempt(W1, Outcome.DEADLINE, answered=True, streamed_tokens=3, code="DEADLINE_EXCEEDED"),
        Action.FAIL,
        DeadlineExceeded,
        policy=RESUMING,
    ),
}


@pytest.mark.parametrize("row", ROWS.values(), ids=ROWS.keys())
def test_next_step(row: Row) -> None:
    step = next_step(row.progress, row.attempt, row.policy)
    assert step.action is row.action
    assert step.counted is row.counted
    assert step.drain_worker is row.drain
    assert step.progress.tried == row.tried
    assert step.progress.attempts == row.progress.attempts + 1
    assert step.progress.resumes == row.resumes
    if row.error is None:
        assert step.error is None
    else:
        assert type(step.error) is row.error
        for text in row.says:
            assert text in str(step.error)


def test_a_given_up_worker_is_why_the_request_fails_when_none_is_left() -> None:
    assert FRESH.exhausted() is None  # nothing failed yet: the pick says why there is no worker
    step = next_step(FRESH, unavailable(details="connection refused"), RetryPolicy(max_retries=1))
    exhausted = step.progress.exhausted()
    assert isinstance(exhausted, Unavailable)
    assert str(exhausted) == (
        "worker w1 unavailable: connection refused; no other serving worker to try"
    )


def test_the_worker_error_passed_on_keeps_its_field() -> None:
    cause = InvalidArgument("temperature out of range", "sampling.temperature")
    step = next_step(
        FRESH, Attempt(W1, Outcome.FAILED, code="INVALID_ARGUMENT", cause=cause), RetryPolicy()
    )
    assert step.error is cause


def test_max_retries_bounds_the_retries_of_a_request() -> None:
    policy = RetryPolicy(max_retries=2)
    progress, actions = FRESH, []
    for wid in ("a", "b", "c"):
        step = next_step(progress, Attempt(WorkerId(wid), Outcome.NO_FIRST_TOKEN), policy)
        progress = step.progress
        actions.append(step.action)
    assert actions == [Action.RETRY_ELSEWHERE, Action.RETRY_ELSEWHERE, Action.FAIL]


@pytest.mark.parametrize(
    ("code", "details", "streamed", "says"),
    [
        # what a SIGKILLed worker's connection says mid-stream (tests/e2e/test_disagg_failures.py)
        (grpc.StatusCode.UNAVAILABLE, "Socket closed", 37, "after 37 streamed token(s)"),
        (grpc.StatusCode.INTERNAL, "engine died", 1, "after 1 streamed token(s)"),
        (grpc.StatusCode.CANCELLED, "", 5, "(CANCELLED: no details)"),
        (grpc.StatusCode.UNAVAILABLE, "failed to connect", 0, "no other worker could take"),
    ],
    ids=["killed-mid-stream", "internal-mid-stream", "cancelled-by-worker", "none-left-before"],
)
def test_a_failed_decode_worker_is_a_retryable_unavailable(code, details, streamed, says) -> None:
    exc = decode_failed(WorkerId("decode-1"), code.name, details, streamed)
    assert status_for(exc) is grpc.StatusCode.UNAVAILABLE
    msg = str(exc)
    assert says in msg
    assert "worker decode-1" in msg and "retry the request" in msg
    assert details in msg


def test_max_resumes_bounds_the_resumes_of_a_request() -> None:
    progress, actions = FRESH, []
    for wid in ("a", "b", "c"):
        failed = Attempt(WorkerId(wid), Outcome.UNAVAILABLE, True, 4, "UNAVAILABLE", "gone")
        step = next_step(progress, failed, RESUMING)
        progress = step.progress
        actions.append(step.action)
    assert actions == [Action.RESUME_ELSEWHERE, Action.RESUME_ELSEWHERE, Action.FAIL]
    assert progress.tried == {"a", "b"}


def test_max_resumes_flag() -> None:
    from services.router.main import parse_args

    assert parse_args([]).max_resumes == 2
    assert parse_args(["--max-resumes", "0"]).max_resumes == 0
    with pytest.raises(SystemExit):
        parse_args(["--max-resumes", "-1"])
