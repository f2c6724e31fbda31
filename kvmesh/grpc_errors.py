"""The one table from domain errors to gRPC status codes, and helpers for servicers."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, NoReturn

import grpc

from kvmesh import errors

log = logging.getLogger(__name__)

STATUS_OF: dict[type[errors.KvmeshError], grpc.StatusCode] = {
    errors.InvalidArgument: grpc.StatusCode.INVALID_ARGUMENT,
    errors.NotFound: grpc.StatusCode.NOT_FOUND,
    errors.Unavailable: grpc.StatusCode.UNAVAILABLE,
    errors.ResourceExhausted: grpc.StatusCode.RESOURCE_EXHAUSTED,
    errors.DeadlineExceeded: grpc.StatusCode.DEADLINE_EXCEEDED,
    errors.Unauthenticated: grpc.StatusCode.UNAUTHENTICATED,
    errors.PermissionDenied: grpc.StatusCode.PERMISSION_DENIED,
}

ERROR_OF: dict[grpc.StatusCode, type[errors.KvmeshError]] = {v: k for k, v in STATUS_OF.items()}

# Trailing metadata of an INVALID_ARGUMENT status: the request field at fault
# (``errors.InvalidArgument.field``), e.g. ``sampling.temperature``.
FIELD_KEY = "kvmesh-field"
# Trailing metadata of a RESOURCE_EXHAUSTED or UNAVAILABLE status: seconds to wait before
# retrying, whole seconds as HTTP's Retry-After (``retry_after_s`` of the domain error).
RETRY_AFTER_KEY = "retry-after"


def status_for(exc: BaseException) -> grpc.StatusCode:
    for cls in type(exc).__mro__:
        if cls in STATUS_OF:
            return STATUS_OF[cls]  # type: ignore[index]
    return grpc.StatusCode.INTERNAL


async def abort_with(
    context: grpc.aio.ServicerContext, exc: BaseException, request_id: str = "", method: str = ""
) -> NoReturn:
    """Ends the call with the status for ``exc`` (raises ``grpc.aio.AbortError``). Unexpected
    errors become INTERNAL with the request id and no stack trace on the wire (the trace goes
    to the log)."""
    code, message = status_of(exc, request_id, method)
    await context.abort(code, message, trailers_of(exc))
    # abort() always raises; its stub is not typed NoReturn, so the one such line lives here.
    raise RuntimeError("grpc.aio ServicerContext.abort() returned")


def trailers_of(exc: BaseException) -> tuple[tuple[str, str], ...]:
    """The trailing metadata a domain error's status carries: its field, its retry-after."""
    out: list[tuple[str, str]] = []
    field = field_of(exc)
    if field:
        out.append((FIELD_KEY, field))
    retry = errors.retry_after_of(exc)
    if retry is not None:
        out.append((RETRY_AFTER_KEY, str(retry)))
    return tuple(out)


def field_of(exc: BaseException) -> str:
    """The request field an ``InvalidArgument`` names (``sampling.temperature``), or ""."""
    field = getattr(exc, "field", None)
    return field if isinstance(field, str) else ""


def status_of(
    exc: BaseException, request_id: str = "", method: str = ""
) -> tuple[grpc.StatusCode, str]:
    """The status code and message that ``exc`` is sent as (``abort_with``, and the per-request
    ends of a ``GenerateMany`` stream); an unexpected error is logged with its trace."""
    code = status_for(exc)
    if code is grpc.StatusCode.INTERNAL:
        where = f" in {method}" if method else ""
        log.exception("internal error%s request_id=%s", where, request_id, exc_info=exc)
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
        return cls(details, field=_trailer(exc, FIELD_KEY))
    if issubclass(cls, errors.Unavailable | errors.ResourceExhausted):
        retry = _trailer(exc, RETRY_AFTER_KEY)
        try:
            return cls(details, float(retry) if retry else None)
        except ValueError:
            return cls(details)
    return cls(details)


def _trailer(exc: grpc.aio.AioRpcError, name: str) -> str | None:
    for key, value in exc.trailing_metadata() or ():
        if key == name and isinstance(value, str) and value:
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


# ---- the server interceptor -----------------------------------------------------------------
class ErrorStatus(grpc.aio.ServerInterceptor):
    """Ends every RPC whose handler raises with the status of ``status_of``: a domain error
    with its code (an INVALID_ARGUMENT with its field), anything else INTERNAL naming a request
    id (the request's ``request_id``, else a fresh one, logged with the trace). Handlers just
    raise; an ``abort`` of their own and cancellations pass through.

    The cost is per call, never per message: each method's wrapped handler is built once, a
    unary handler (or a streaming one written as a coroutine, like ``Health/Watch``) is awaited
    whole, and a streaming one returns its generator from a plain function, so this wrapper's
    generator takes the place of the handler's own (see services/router/servicer.py's
    ``Generate``) rather than adding a hop per message."""

    def __init__(self) -> None:
        self._handlers: dict[str, grpc.RpcMethodHandler] = {}

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        method = handler_call_details.method  # type: ignore[attr-defined]
        wrapped = self._handlers.get(method)
        if wrapped is not None:
            return wrapped
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler
        name = method.decode() if isinstance(method, bytes) else method
        wrapped = _wrap(handler, name.rpartition("/")[2])
        self._handlers[method] = wrapped
        return wrapped


def _wrap(handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
    if handler.response_streaming:
        if handler.request_streaming:
            behavior, factory = handler.stream_stream, grpc.stream_stream_rpc_method_handler
        else:
            behavior, factory = handler.unary_stream, grpc.unary_stream_rpc_method_handler
        # gRPC tells a coroutine handler (streaming with context.write) from a generator one by
        # the function, so the wrapper is of the same kind.
        if inspect.iscoroutinefunction(behavior):
            wrapped: Any = _unary(behavior, method)
        else:
            wrapped = _stream(behavior, method)
    else:
        if handler.request_streaming:
            behavior, factory = handler.stream_unary, grpc.stream_unary_rpc_method_handler
        else:
            behavior, factory = handler.unary_unary, grpc.unary_unary_rpc_method_handler
        wrapped = _unary(behavior, method)
    return factory(
        wrapped,
        request_deserializer=handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )


def request_id_of(request: Any) -> str:
    """The request's ``request_id`` when it has one, else a fresh id for the log and status."""
    rid = getattr(request, "request_id", "")
    return rid if isinstance(rid, str) and rid else uuid.uuid4().hex[:16]


def _unary(behavior: Any, method: str) -> Any:
    async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            return await behavior(request, context)
        except grpc.aio.AbortError:
            raise
        except Exception as exc:
            await abort_with(context, exc, request_id_of(request), method)

    return unary


def _stream(behavior: Any, method: str) -> Any:
    async def stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        try:
            async with contextlib.aclosing(behavior(request, context)) as responses:
                async for msg in responses:
                    yield msg
        except grpc.aio.AbortError:
            raise
        except Exception as exc:
            await abort_with(context, exc, request_id_of(request), method)

    return stream
