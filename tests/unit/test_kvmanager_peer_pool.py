"""The data plane's connection pool (services/kvmanager/peer/pool.py) on real socket pairs:
connections come back most recent first, per peer; the cap, the idle timeout and a peer that
closed its end each close a connection instead of handing it out; closing the pool closes what
it holds and what is given back later."""

from __future__ import annotations

import socket

import pytest

from kvmesh.errors import InvalidArgument
from services.kvmanager.peer.pool import ConnectionPool, PoolConfig, healthy

A = ("10.0.0.1", 7000, "node-a")
B = ("10.0.0.2", 7000, "node-b")


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def pairs():  # type: ignore[no-untyped-def]
    made: list[tuple[socket.socket, socket.socket]] = []

    def _pair() -> tuple[socket.socket, socket.socket]:
        made.append(socket.socketpair())
        return made[-1]

    yield _pair
    for ours, theirs in made:
        ours.close()
        theirs.close()


def test_take_gives_back_the_most_recent_connection_of_that_peer(pairs) -> None:  # type: ignore[no-untyped-def]
    pool = ConnectionPool()
    (a1, _), (a2, _), (b1, _) = pairs(), pairs(), pairs()
    pool.give(A, a1)
    pool.give(A, a2)
    pool.give(B, b1)
    assert pool.idle() == 3 and pool.idle(A) == 2
    assert pool.take(A) is a2 and pool.take(A) is a1 and pool.take(A) is None
    assert pool.take(B) is b1
    assert pool.stats.reused == 3 and pool.stats.kept == 3


def test_the_cap_and_the_idle_timeout_close_connections(pairs) -> None:  # type: ignore[no-untyped-def]
    clock = Clock()
    pool = ConnectionPool(PoolConfig(max_idle_per_peer=1, idle_timeout_s=5.0), clock=clock)
    (a1, _), (a2, _) = pairs(), pairs()
    pool.give(A, a1)
    pool.give(A, a2)  # over the cap: closed
    assert a2.fileno() == -1 and pool.stats.overflow == 1 and pool.idle(A) == 1
    clock.now += 5.1
    assert pool.take(A) is None and a1.fileno() == -1 and pool.stats.expired == 1
    none = ConnectionPool(PoolConfig(max_idle_per_peer=0))
    (a3, _) = pairs()
    none.give(A, a3)
    assert a3.fileno() == -1 and none.idle() == 0


def test_a_connection_the_peer_closed_or_wrote_on_is_not_handed_out(pairs) -> None:  # type: ignore[no-untyped-def]
    pool = ConnectionPool()
    (a1, p1), (a2, p2), (a3, _) = pairs(), pairs(), pairs()
    assert healthy(a1)
    pool.give(A, a3)
    pool.give(A, a2)
    pool.give(A, a1)
    p1.close()  # the peer went away (its idle timeout, a restart, a kill)
    p2.sendall(b"x")  # bytes nobody asked for
    assert not healthy(a1) and not healthy(a2)
    assert pool.take(A) is a3  # the two broken ones skipped and closed
    assert a1.fileno() == -1 and a2.fileno() == -1 and pool.stats.broken == 2


def test_close_closes_held_and_later_connections(pairs) -> None:  # type: ignore[no-untyped-def]
    pool = ConnectionPool()
    (a1, _), (a2, _) = pairs(), pairs()
    pool.give(A, a1)
    pool.close()
    assert a1.fileno() == -1 and pool.idle() == 0
    pool.give(A, a2)
    assert a2.fileno() == -1 and pool.take(A) is None


def test_bad_configs_are_refused() -> None:
    with pytest.raises(InvalidArgument, match="max_idle_per_peer"):
        PoolConfig(max_idle_per_peer=-1)
    with pytest.raises(InvalidArgument, match="idle_timeout_s"):
        PoolConfig(idle_timeout_s=0)
