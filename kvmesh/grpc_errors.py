"""The one table from domain errors to gRPC status codes, and helpers for servicers."""

from __future__ import annotations

import asyncio
import contextlib
import logging

import grpc

from kvmesh import errors

log = logging.getLogger(__name__)

STATUS_OF: dict[type[errors.KvmeshError], grpc.StatusCode] = {
    errors.InvalidArgument: grpc.StatusCode.INVALID_ARGUMENT,
    errors.NotFound: grpc.StatusCode.NOT_FOUND,
    errors.Unavailable: grpc.StatusCode.UNAVAILABLE,
    errors.ResourceExhausted: grpc.StatusCode.RESOURCE_EXHAUSTED,
    errors.DeadlineExceeded: grpc.StatusCode.DEADLINE_EXCEEDED,
}

ERROR_OF: dict[grpc.StatusCode, type[errors.KvmeshError]] = {v: k for k, v in STATUS_OF.items()}

# Trailing metadata of an INVALID_ARGUMENT status: the request field at fault
# (``errors.InvalidArgument.field``), e.g. ``sampling.temperature``.
FIELD_KEY = "kvmesh-field"


def status_for(exc: BaseException) -> grpc.StatusCode:
    for cls in type(exc).__mro__:
        if cls in STATUS_OF:
            return STATUS_OF[cls]  # type: ignore[index]
    return grpc.StatusCode.INTERNAL


async def abort_with(
    context: grpc.aio.ServicerContext, exc: BaseException, request_id: str = ""
) -> None:
    """Ends the call with the status for ``exc``. Unexpected errors become INTERNAL with the
    request id and no stack trace on the wire (the trace goes to the log)."""
    code, message = status_of(exc, request_id)
    field = field_of(exc)
    await context.abort(code, message, ((FIELD_KEY, field),) if field else ())


def field_of(exc: BaseException) -> str:
    """The request field an ``InvalidArgument`` names (``sampling.temperature``), or ""."""
    field = getattr(exc, "field", None)
    return field if isinstance(field, str) else ""


def status_of(exc: BaseException, request_id: str = "") -> tuple[grpc.StatusCode, str]:
    """The status code and message that ``exc`` is sent as (``abort_with``, and the per-request
    ends of a ``GenerateMany`` stream); an unexpected error is logged with its trace."""
    code = status_for(exc)
    if code is grpc.StatusCode.INTERNAL:
        log.exception("internal error request_id=%s", request_id, exc_info=exc)
        return code, f"internal error (request_id={request_id}); see the service log"
    return code, str(exc)


def from_rpc_error(exc: grpc.aio.AioRpcError) -> errors.KvmeshError | None:
    """The domain error a downstream status stands for, so a proxy can pass it on unchanged
    (an INVALID_ARGUMENT's field included)."""
    cls = ERROR_OF.get(exc.code())
    if cls is None:
        return None
    details = exc.details() or exc.code().name
    if issubclass(cls, errors.InvalidArgument):
        return cls(details, field=_field(exc))
    return cls(details)


def _field(exc: grpc.aio.AioRpcError) -> str | None:
    for key, value in exc.trailing_metadata() or ():
        if key == FIELD_KEY and isinstance(value, str) and value:
            return value
    return None


STATUS_WAIT_S = 5.0  # how long a stream's status is awaited after its last message (it follows)


async def await_status(call: grpc.aio.Call, timeout_s: float = STATUS_WAIT_S) -> None:
    """Waits (at most ``timeout_s``) for the status of a streaming call whose finished message
    has come. A proxy that passes its own last message on only after this leaves nothing to
    wait for once that message is sent: a client hanging up on the last message then cancels
    nothing, and a finished request is OK on every hop."""
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(call.code(), timeout_s)
