"""The kvmanager's domain errors. Each subclasses a shared error of ``kvmesh.errors``, so the one
table in ``kvmesh.grpc_errors`` already maps it to a gRPC status code."""

from __future__ import annotations

from kvmesh.errors import (
    DeadlineExceeded,
    InvalidArgument,
    KvmeshError,
    NotFound,
    ResourceExhausted,
    Unavailable,
)


class NotPinned(InvalidArgument):
    """An unpin without a matching pin: refcounts never go below zero."""


class StoreFull(ResourceExhausted):
    """A block does not fit its tier even after evicting everything evictable: the rest is pinned
    or in flight (or the block is larger than the tier's whole budget)."""


class StoreClosed(Unavailable):
    """The store is closed (the daemon is shutting down)."""


class CorruptBlock(KvmeshError):
    """A block file failed its checks (short, bad header, bad checksum). Never sent on the wire:
    the store drops the file and answers a miss (maps to INTERNAL if it ever leaks)."""


class PeerNotFound(NotFound):
    """A peer named by kvmanager id is not registered in etcd (or etcd is not configured)."""


class DataPlaneOff(Unavailable):
    """This kvmanager's data plane is off (``--data-plane-port -1``): it cannot serve peers."""


class PeerFetchFailed(Unavailable):
    """A peer fetch ended early: the peer is unreachable, died, stalled or broke the protocol.
    ``fetched`` whole, verified blocks were stored before it; recompute the rest."""

    def __init__(self, message: str, *, fetched: int = 0) -> None:
        super().__init__(message)
        self.fetched = fetched


class PeerFetchTimedOut(DeadlineExceeded):
    """A peer fetch ran out of its deadline; ``fetched`` whole, verified blocks were stored."""

    def __init__(self, message: str, *, fetched: int = 0) -> None:
        super().__init__(message)
        self.fetched = fetched
