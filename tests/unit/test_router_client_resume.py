"""A client's resume (GenerateRequest.resume) checked against its request
(services/router/core/validation.py): every refusal names the field and says what to do."""

from __future__ import annotations

import re

import pytest

from kvmesh.errors import InvalidArgument
from services.router.core.validation import check_resume

CASES = [
    ([1, 2, 3, 4, 5], "", 4, "", "resume.token_ids has 5 tokens but sampling.max_tokens is 4"),
    ([1], "", 4, "a structured output's grammar", "this request cannot be resumed"),
    ([1, 2000], "", 4, "", "token id 2000, outside the model's vocabulary [0, 1000)"),
    ([], "abc", 4, "", "resume.text is set but resume.token_ids is empty"),
]


@pytest.mark.parametrize(
    ("ids", "text", "max_tokens", "not_resumable", "message"),
    CASES,
    ids=["past-max-tokens", "not-resumable", "outside-vocab", "text-without-tokens"],
)
def test_refused(ids: list[int], text: str, max_tokens: int, not_resumable: str, message: str):
    with pytest.raises(InvalidArgument, match=re.escape(message)):
        check_resume(ids, text, max_tokens, 1000, not_resumable)


def test_accepted() -> None:
    check_resume([], "", 4, 1000, "structured")  # no resume: nothing to check
    check_resume([1, 2, 3, 4], "abcd", 4, 1000, "")  # every token: the answer ends at once


@pytest.mark.parametrize("ttft_s", [-0.5, float("nan"), float("inf")])
def test_a_time_to_first_token_that_is_not_a_duration_is_refused(ttft_s: float) -> None:
    with pytest.raises(
        InvalidArgument, match=re.escape("resume.time_to_first_token_s must be a finite")
    ):
        check_resume([1], "a", 4, 1000, "", ttft_s)


def test_the_clients_time_to_first_token_becomes_the_replays() -> None:
    from kvmesh.v1 import router_pb2
    from services.router.resume import Replay

    replay = Replay.from_client(10, router_pb2.Resume(token_ids=[1, 2], time_to_first_token_s=0.3))
    assert replay.ttft_s == pytest.approx(0.3)
    check_resume([1, 2], "ab", 4, 1000, "", 0.3)
