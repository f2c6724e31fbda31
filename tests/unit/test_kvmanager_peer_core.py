"""Peer fetch's pure core (services/kvmanager/peer/core.py): tickets are single use, bounded and
expire on the holder's clock; the windows of both ends bound what is held yet always let one
block through; a fetch's plan and progress say what was asked, stored and missing."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvmesh.errors import InvalidArgument, ResourceExhausted
from kvmesh.kv.events import BlockHash
from services.kvmanager.core.errors import PeerFetchFailed, PeerFetchTimedOut
from services.kvmanager.peer.core import (
    MAX_TTL_FACTOR,
    FetchPlan,
    FetchProgress,
    RecvWindow,
    SendWindow,
    TicketBook,
    grant_matches,
    split_address,
    ticket_ttl_s,
)
from services.kvmanager.peer.wire import TOKEN_BYTES, U64_MAX, Status


def token(i: int) -> bytes:
    return i.to_bytes(TOKEN_BYTES, "little")


def hashes(*hs: int) -> tuple[BlockHash, ...]:
    return tuple(BlockHash(h) for h in hs)


# ---- tickets


def test_a_ticket_is_redeemed_once() -> None:
    book = TicketBook(max_tickets=4)
    ticket = book.issue(token(1), "L", [1, 2], 30.0, now=100.0, wall_now=1_000.0)
    assert ticket.hashes == hashes(1, 2) and ticket.expires_at == 1_030.0
    assert book.redeem(token(1), now=101.0) == (Status.OK, ticket)
    assert book.redeem(token(1), now=101.0) == (Status.UNKNOWN_TICKET, None)
    assert len(book) == 0


def test_an_expired_ticket_is_refused_and_used_up() -> None:
    book = TicketBook(max_tickets=4)
    book.issue(token(1), "L", [1], 5.0, now=100.0, wall_now=0.0)
    assert book.redeem(token(1), now=105.0) == (Status.EXPIRED_TICKET, None)
    assert book.redeem(token(1), now=100.0) == (Status.UNKNOWN_TICKET, None)


def test_a_full_book_prunes_expired_tickets_before_refusing() -> None:
    book = TicketBook(max_tickets=2)
    book.issue(token(1), "L", [1], 1.0, now=0.0, wall_now=0.0)
    book.issue(token(2), "L", [2], 10.0, now=0.0, wall_now=0.0)
    book.issue(token(3), "L", [3], 10.0, now=2.0, wall_now=0.0)  # the first one expired
    assert len(book) == 2
    with pytest.raises(ResourceExhausted, match="2 data plane tickets outstanding"):
        book.issue(token(4), "L", [4], 10.0, now=3.0, wall_now=0.0)


def test_revoke_and_clear() -> None:
    book = TicketBook(max_tickets=4)
    book.issue(token(1), "L", [1], 1.0, now=0.0, wall_now=0.0)
    book.issue(token(2), "L", [2], 1.0, now=0.0, wall_now=0.0)
    assert book.revoke(token(1)) and not book.revoke(token(1))
    book.clear()
    assert book.redeem(token(2), now=0.0) == (Status.UNKNOWN_TICKET, None)


@pytest.mark.parametrize(
    ("hs", "ttl_s", "says"),
    [
        ([], 1.0, "at least one block hash"),
        ([U64_MAX + 1], 1.0, "not an unsigned 64-bit integer"),
        ([-1], 1.0, "not an unsigned 64-bit integer"),
        ([1], 0.0, "ttl_s must be > 0"),
    ],
    ids=["no-hashes", "hash-too-big", "negative-hash", "no-ttl"],
)
def test_a_bad_ticket_request_is_refused(hs: list[int], ttl_s: float, says: str) -> None:
    with pytest.raises(InvalidArgument, match=says):
        TicketBook(4).issue(token(1), "L", hs, ttl_s, now=0.0, wall_now=0.0)


@pytest.mark.parametrize(
    ("asked_s", "configured_s", "ttl_s"),
    [(0.0, 30.0, 30.0), (5.0, 30.0, 5.0), (1e6, 30.0, MAX_TTL_FACTOR * 30.0)],
    ids=["default", "asked", "capped"],
)
def test_ticket_ttl(asked_s: float, configured_s: float, ttl_s: float) -> None:
    assert ticket_ttl_s(asked_s, configured_s) == ttl_s


def test_a_negative_ticket_ttl_is_refused() -> None:
    with pytest.raises(InvalidArgument, match="ttl_s must be >= 0"):
        ticket_ttl_s(-1.0, 30.0)


# ---- windows


def test_the_send_window_hands_batches_over_and_pauses_when_full() -> None:
    w = SendWindow.of(prefetch_bytes=10, batch_bytes=4)
    assert (w.limit_bytes, w.batch_limit_bytes) == (10, 4)
    assert not w.pinned(3)
    assert w.pinned(3)  # 6 >= 4: hand the batch over
    w.handed()
    assert not w.full()
    assert w.pinned(4) and w.full()  # 10 pinned: pin nothing more until some is sent
    w.sent(3)
    assert not w.full() and w.held_bytes == 7


@pytest.mark.parametrize(
    ("prefetch_bytes", "batch_bytes", "limits"),
    [(0, 0, (1, 1)), (8, 100, (8, 8)), (100, 8, (100, 8))],
    ids=["at-least-a-byte", "batch-within-window", "as-configured"],
)
def test_send_window_limits(prefetch_bytes: int, batch_bytes: int, limits: tuple[int, int]) -> None:
    w = SendWindow.of(prefetch_bytes, batch_bytes)
    assert (w.limit_bytes, w.batch_limit_bytes) == limits


@pytest.mark.parametrize(
    ("held", "block", "fits"),
    [(0, 100, True), (4, 6, True), (4, 7, False), (10, 1, False)],
    ids=["one-block-always", "up-to-the-limit", "over-the-limit", "full"],
)
def test_the_receive_window(held: int, block: int, fits: bool) -> None:
    w = RecvWindow(limit_bytes=10, held_bytes=held)
    assert w.fits(block) is fits


@given(st.lists(st.integers(1, 64), max_size=50), st.integers(1, 128))
def test_the_receive_window_holds_at_most_its_limit_or_one_block(
    sizes: list[int], limit: int
) -> None:
    w = RecvWindow(limit)
    waiting: list[int] = []
    for size in sizes:
        while not w.fits(size):
            w.taken(waiting.pop(0))  # the consumer takes the oldest block
        w.reserve(size)
        waiting.append(size)
        assert w.held_bytes == sum(waiting)
        assert w.held_bytes <= limit or len(waiting) == 1


# ---- plan and progress


def test_a_plan_asks_for_what_is_not_held_with_each_blocks_parent() -> None:
    chain = hashes(10, 11, 12, 13)
    plan = FetchPlan.of(chain, lambda h: h in (10, 12))
    assert plan.wanted == (1, 3)
    assert plan.asked() == [11, 13]
    assert plan.parents(2, grant_parent=None) == {11: 10, 13: 12}
    assert plan.parents(1, grant_parent=None) == {11: 10}  # the peer granted a shorter run


def test_the_first_block_of_a_chain_gets_the_parent_the_peer_named() -> None:
    plan = FetchPlan.of(hashes(10, 11), lambda _h: False)
    assert plan.parents(2, grant_parent=BlockHash(9)) == {10: 9, 11: 10}


def test_progress_counts_what_was_held_granted_stored() -> None:
    plan = FetchPlan.of(hashes(1, 2, 3, 4), lambda h: h == 1)
    p = FetchProgress()
    p.planned(plan)
    p.granted(plan, 2)  # the peer holds 2 of the 3 wanted
    p.stored(True, 100)
    p.stored(False, 100)  # the store had it meanwhile
    assert (p.already_held, p.peer_missing, p.fetched, p.bytes) == (2, 1, 1, 100)


@pytest.mark.parametrize(
    ("fail", "error", "says"),
    [
        (FetchProgress.failed, PeerFetchFailed, "failed after 1 of 3 blocks (1 kept, verified;"),
        (FetchProgress.timed_out, PeerFetchTimedOut, "ran out of its deadline after 1 of 3"),
    ],
    ids=["failed", "timed-out"],
)
def test_a_broken_fetch_says_how_far_it_got(fail, error, says) -> None:
    p = FetchProgress()
    p.stored(True, 10)
    exc = fail(p, "kvmanager kvm-b", 3, "StreamBroken: reset")
    assert type(exc) is error
    assert exc.fetched == 1
    assert says in str(exc) and "kvmanager kvm-b" in str(exc) and "StreamBroken: reset" in str(exc)


@pytest.mark.parametrize(
    ("asked", "granted", "tok", "ok"),
    [
        (hashes(1, 2, 3), hashes(1, 2), token(1), True),
        (hashes(1, 2, 3), (), b"", True),
        (hashes(1, 2, 3), hashes(2, 3), token(1), False),
        (hashes(1, 2), hashes(1, 2, 3), token(1), False),
        (hashes(1, 2), hashes(1), b"short", False),
    ],
    ids=["leading-run", "nothing-held", "not-leading", "more-than-asked", "bad-token"],
)
def test_a_grant_must_match_the_request(asked, granted, tok, ok) -> None:
    assert grant_matches(asked, granted, tok) is ok


@pytest.mark.parametrize(
    ("address", "parts"),
    [
        ("10.0.0.1:7000", ("10.0.0.1", 7000)),
        ("[::1]:7000", ("::1", 7000)),
        ("host", None),
        (":7000", None),
        ("host:port", None),
        ("", None),
    ],
    ids=["v4", "v6", "no-port", "no-host", "port-not-a-number", "empty"],
)
def test_split_address(address: str, parts: tuple[str, int] | None) -> None:
    assert split_address(address) == parts
