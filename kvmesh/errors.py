"""Domain errors shared by all services. Pure: the one table mapping them to gRPC status codes
lives in ``kvmesh.grpc_errors`` (and to HTTP codes at the OpenAI front door, later).

Messages say what to fix: which field, what range, what was received.
"""

from __future__ import annotations


class KvmeshError(Exception):
    """Base of every error we raise on purpose."""


class InvalidArgument(KvmeshError):
    """The request is malformed or out of range; retrying it unchanged will fail again.
    ``field``, when known, names the request field at fault as its path in the kvmesh.v1
    request message (``sampling.temperature``, ``model``; ``input`` for the prompt); it travels
    with the gRPC status (``kvmesh.grpc_errors``), so the OpenAI front door can name the
    parameter."""

    def __init__(self, message: str = "", field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


class Unauthenticated(KvmeshError):
    """No credentials, or ones this service does not know; send a valid API key."""


class PermissionDenied(KvmeshError):
    """The caller is known but may not ask this (another tenant's name, a higher priority
    than its tenant holds); the message says what to change."""


class NotFound(KvmeshError):
    """A named thing (model, request id) does not exist."""


class Unavailable(KvmeshError):
    """Nothing can serve this now (no worker, draining, peer down); retry later."""


class ResourceExhausted(KvmeshError):
    """The request is too large or the service is saturated."""


class DeadlineExceeded(KvmeshError):
    """The caller's deadline passed before the work finished."""
