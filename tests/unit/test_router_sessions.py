"""The router's session book: what a turn retains, and a next turn's hit or miss."""

from __future__ import annotations

import pytest

from kvmesh.errors import InvalidArgument
from services.router.core.sessions import RetentionConfig, SessionBook, TurnOutcome, retained_ids
from services.router.http.errors import BadRequest
from services.router.http.extensions import extensions_from_headers


def test_retained_ids_leave_out_the_last_output_token() -> None:
    assert retained_ids([1, 2, 3], [7, 8, 9]) == [1, 2, 3, 7, 8]
    assert retained_ids([1, 2], []) == [1, 2]


@pytest.mark.parametrize(
    ("prompt_tokens", "cached", "outcome"),
    [
        (64, 64, TurnOutcome.HIT),
        (70, 64, TurnOutcome.HIT),  # the partial last block is never cached
        (64, 48, TurnOutcome.MISS),
        (64, 0, TurnOutcome.MISS),
        (10, 0, None),  # less than a block: nothing to keep
    ],
    ids=["exact", "partial-block", "short", "none", "no-block"],
)
def test_judge(prompt_tokens: int, cached: int, outcome: TurnOutcome | None) -> None:
    book = SessionBook(8)
    assert book.judge("t", "s", cached) is None  # no previous pin
    book.pinned("t", "s", prompt_tokens, 16, "w")
    assert book.judge("t", "s", cached) is outcome
    assert book.judge("other", "s", cached) is None


def test_book_is_bounded_lru() -> None:
    book = SessionBook(2)
    book.pinned("", "a", 32, 16, "w")
    book.pinned("", "b", 32, 16, "w")
    book.pinned("", "a", 32, 16, "w")  # a is the most recent
    book.pinned("", "c", 32, 16, "w")
    assert len(book) == 2
    assert book.judge("", "b", 32) is None and book.judge("", "a", 32) is TurnOutcome.HIT


@pytest.mark.parametrize("kwargs", [{"ttl_s": -1}, {"timeout_s": 0}, {"max_sessions": 0}], ids=str)
def test_bad_config(kwargs: dict[str, float]) -> None:
    with pytest.raises(InvalidArgument):
        RetentionConfig(**kwargs)  # type: ignore[arg-type]


def test_zero_ttl_is_off() -> None:
    assert not RetentionConfig(ttl_s=0).enabled and RetentionConfig().enabled


@pytest.mark.parametrize(
    ("value", "end"),
    [(None, False), ("true", True), ("1", True), ("YES", True), ("false", False), ("0", False)],
    ids=str,
)
def test_session_end_header(value: str | None, end: bool) -> None:
    headers = (
        {"x-kvmesh-session-id": "s"}
        if value is None
        else {
            "x-kvmesh-session-id": "s",
            "x-kvmesh-session-end": value,
        }
    )
    assert extensions_from_headers(headers).session_end is end


def test_a_bad_session_end_header_is_a_bad_request() -> None:
    with pytest.raises(BadRequest, match="x-kvmesh-session-end"):
        extensions_from_headers({"x-kvmesh-session-end": "maybe"})


@pytest.mark.parametrize(
    ("asked_s", "ttl_s"),
    [(0.0, 600.0), (-1.0, 600.0), (300.0, 300.0), (3600.0, 1800.0), (float("nan"), 600.0)],
    ids=["none", "negative", "5m", "capped", "nan"],
)
def test_turn_ttl_honours_the_request_within_the_maximum(asked_s: float, ttl_s: float) -> None:
    config = RetentionConfig(ttl_s=600.0, max_ttl_s=1800.0)
    assert config.turn_ttl_s(asked_s) == ttl_s


@pytest.mark.parametrize(
    "kwargs", [{"max_ttl_s": 0}, {"prefetch_timeout_s": -1}], ids=["max_ttl", "prefetch"]
)
def test_bad_ttl_and_prefetch_config(kwargs: dict[str, float]) -> None:
    with pytest.raises(InvalidArgument):
        RetentionConfig(**kwargs)  # type: ignore[arg-type]


def test_book_knows_the_worker_of_a_sessions_last_pin() -> None:
    book = SessionBook(4)
    assert book.worker_of("t", "s") is None
    book.pinned("t", "s", 64, 16, "w1")
    book.pinned("t", "s", 96, 16, "w2")
    assert book.worker_of("t", "s") == "w2"
    assert book.worker_of("other", "s") is None
    book.forget("t", "s")
    assert book.worker_of("t", "s") is None
