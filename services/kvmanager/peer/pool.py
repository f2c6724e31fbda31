"""Authenticated data plane connections kept between fetches, per peer (the ``auth`` mode).

In ``--data-plane-security auth`` a connection costs a mutual TLS handshake (about 9 ms of CPU
on this machine) before its blocks flow in plaintext. A fetch that asks for it
(``wire.Request.keep_alive``) and whose server agrees (``wire.StreamHeader.kept``) leaves its
connection here after the last frame; the next fetch from the same peer sends its request on it
(in plaintext: the connection was authenticated by its handshake, and the ticket is single use)
instead of connecting and shaking hands again.

Bounded both ways: at most ``max_idle_per_peer`` idle connections a peer (more are closed), each
kept ``idle_timeout_s`` at most (set it under the server's ``keepalive_idle_s``, so the server
rarely closes one under a fetch). A connection is checked when taken: one the peer closed
(a restart, its idle timeout, a kill) or that carries unexpected bytes is closed and the next
one tried. One that breaks after that, before the answer's first byte, is the fetch's to retry
once on a fresh connection (``client._Receiver``); a failed fetch still degrades to recompute.

Thread-safe: the fetches' threads take and give back connections.
"""

from __future__ import annotations

import socket
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from kvmesh.errors import InvalidArgument

PeerKey = tuple[str, int, str]  # host, port, the TLS server name the connection was checked for


@dataclass(frozen=True, slots=True)
class PoolConfig:
    max_idle_per_peer: int = 4  # idle connections kept per peer; 0: none (every fetch shakes hands)
    idle_timeout_s: float = 30.0  # an idle connection older than this is closed, not used

    def __post_init__(self) -> None:
        if self.max_idle_per_peer < 0:
            raise InvalidArgument(f"max_idle_per_peer must be >= 0, got {self.max_idle_per_peer}")
        if not self.idle_timeout_s > 0:
            raise InvalidArgument(f"idle_timeout_s must be > 0, got {self.idle_timeout_s}")


@dataclass(slots=True)
class PoolStats:
    handshakes: int = 0  # fresh connections authenticated (TLS handshakes done by fetches)
    reused: int = 0  # fetches that ran on a kept connection
    kept: int = 0  # connections given back after a whole stream
    expired: int = 0  # idle past idle_timeout_s, closed
    broken: int = 0  # closed by the peer or unusable when taken, or broke on reuse
    overflow: int = 0  # given back while max_idle_per_peer were idle, closed


class ConnectionPool:
    """Idle authenticated connections, per peer. ``take`` hands out the most recently used
    healthy one (or None); ``give`` keeps one for later (or closes it)."""

    def __init__(
        self, config: PoolConfig | None = None, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.config = config or PoolConfig()
        self.stats = PoolStats()
        self._clock = clock
        self._lock = threading.Lock()
        self._idle: dict[PeerKey, deque[tuple[socket.socket, float]]] = {}
        self._closed = False

    def take(self, key: PeerKey) -> socket.socket | None:
        """A healthy idle connection to ``key``, now the caller's; None when there is none."""
        while True:
            with self._lock:
                idle = self._idle.get(key)
                if not idle:
                    return None
                sock, since = idle.pop()  # the most recently used: the least likely closed
                if not idle:
                    del self._idle[key]
            expired = self._clock() - since > self.config.idle_timeout_s
            usable = not expired and healthy(sock)
            with self._lock:
                if usable:
                    self.stats.reused += 1
                    return sock
                if expired:
                    self.stats.expired += 1
                else:
                    self.stats.broken += 1
            sock.close()

    def give(self, key: PeerKey, sock: socket.socket) -> None:
        """Keeps ``sock`` (a connection whose stream ended whole, nothing left to read) for the
        next fetch from ``key``, or closes it when the peer has its share idle already."""
        now = self._clock()
        with self._lock:
            idle = self._idle.setdefault(key, deque())
            keep = not self._closed and len(idle) < self.config.max_idle_per_peer
            if keep:
                idle.append((sock, now))
                self.stats.kept += 1
            else:
                self.stats.overflow += 1
                if not idle:
                    del self._idle[key]
        if not keep:
            sock.close()

    def count(self, what: str) -> None:
        """Adds one to the counter ``what`` of ``stats`` (the fetches' threads: handshakes,
        connections that broke on reuse)."""
        with self._lock:
            setattr(self.stats, what, getattr(self.stats, what) + 1)

    def idle(self, key: PeerKey | None = None) -> int:
        """Idle connections (to ``key``, or to every peer)."""
        with self._lock:
            if key is not None:
                return len(self._idle.get(key, ()))
            return sum(len(q) for q in self._idle.values())

    def close(self) -> None:
        """Closes every idle connection; connections given back later are closed too."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, {}
        for queue in idle.values():
            for sock, _since in queue:
                sock.close()


def healthy(sock: socket.socket) -> bool:
    """Whether an idle connection is still open with nothing to read: a peer that closed it
    (FIN or reset) or sent unasked bytes makes it readable, so it is not."""
    try:
        sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
    except BlockingIOError:
        return True  # open, nothing waiting: as it should be
    except OSError:
        return False
    return False  # EOF (b"") or bytes nobody asked for
