"""Domain errors shared by all services. Pure: the one table mapping them to gRPC status codes
lives in ``kvmesh.grpc_errors`` (and to HTTP codes at the OpenAI front door, later).

Messages say what to fix: which field, what range, what was received.
"""

from __future__ import annotations

import math


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
    """Nothing can serve this now (no worker, draining, peer down); retry later.
    ``retry_after_s``, when set, says when: it travels as the gRPC status's ``retry-after``
    trailing metadata and the HTTP ``Retry-After`` header (``kvmesh.grpc_errors``)."""

    def __init__(self, message: str = "", retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class ResourceExhausted(KvmeshError):
    """The request is too large or the service is saturated (flow control's queue is full,
    the wait ran out, a tenant's rate limit); ``retry_after_s`` as for ``Unavailable``."""

    def __init__(self, message: str = "", retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class DeadlineExceeded(KvmeshError):
    """The caller's deadline passed before the work finished."""


def retry_after_of(exc: BaseException) -> int | None:
    """The whole seconds to wait an error names (``retry_after_s`` of ``Unavailable`` /
    ``ResourceExhausted``), rounded up and at least 1 as HTTP's Retry-After; None: none."""
    seconds = getattr(exc, "retry_after_s", None)
    if not isinstance(seconds, int | float) or isinstance(seconds, bool):
        return None
    if not math.isfinite(seconds):
        return None
    return max(math.ceil(seconds), 1)
