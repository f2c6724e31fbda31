"""The kvmanager's domain errors. Each subclasses a shared error of ``kvmesh.errors``, so the one
table in ``kvmesh.grpc_errors`` already maps it to a gRPC status code."""

from __future__ import annotations

from kvmesh.errors import InvalidArgument, KvmeshError, ResourceExhausted, Unavailable


class BadLayout(InvalidArgument):
    """A KV layout field is out of range (the message names the field and the value)."""


class BadBlock(InvalidArgument):
    """A block does not fit its layout (payload size) or its hash is not an unsigned 64-bit int."""


class LayoutMismatch(InvalidArgument):
    """A block or peer uses another KV layout than the one expected (the message names the
    fields that differ)."""


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
