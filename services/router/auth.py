"""API keys on the router's gRPC API: a server interceptor around ``kvmesh.v1.Router``'s
methods (health and reflection stay open). The key rides the call's metadata as
``authorization: Bearer <key>`` (or ``x-api-key: <key>``); ``core.auth.authorize`` decides,
and a request with ``tenant`` / ``priority`` fields gets the authenticated ones written in (and
the tenant's ``cache_salt`` over whatever the client sent), so the servicer (and everything
after it) sees the tenant the key names, never a claimed one.

It sits inside the host's ``ErrorStatus`` interceptor (``ServiceHost(interceptors=...)``), so
``Unauthenticated`` / ``PermissionDenied`` become UNAUTHENTICATED / PERMISSION_DENIED through
the one table. Per call it costs one SHA-256 of the key and a dict lookup; each method's
wrapper is built once, and a streaming handler's generator is returned as is (no hop per
message)."""

from __future__ import annotations

import inspect
import logging
from collections.abc import Awaitable, Callable, Sequence
from contextvars import ContextVar
from typing import Any

import grpc

from .core.auth import Claims, Identity, KeyTable, authorize

log = logging.getLogger(__name__)

KeySource = Callable[[], KeyTable]  # the table in force (``KeyFile.current``)
# The authenticated caller of the unary call being handled (``Abort`` checks the request is
# its tenant's); None on an open router, or outside a call.
CALLER: ContextVar[Identity | None] = ContextVar("kvmesh_caller", default=None)
ROUTER_SERVICE = "kvmesh.v1.Router"
API_KEY_METADATA = "x-api-key"


def key_of(metadata: Sequence[tuple[str, str | bytes]] | None) -> str:
    """The API key in call metadata: ``authorization: Bearer <key>``, else ``x-api-key``."""
    fallback = ""
    for name, value in metadata or ():
        if not isinstance(value, str):
            continue
        if name == "authorization":
            scheme, _, key = value.partition(" ")
            if scheme.lower() == "bearer" and key.strip():
                return key.strip()
        elif name == API_KEY_METADATA:
            fallback = value.strip()
    return fallback


def authenticate(keys: KeySource, request: Any, context: grpc.aio.ServicerContext) -> Identity:
    """Checks the call's key and writes the identity into ``request`` when it has the fields."""
    tenant = getattr(request, "tenant", "")
    priority = getattr(request, "priority", 0)
    claims = Claims(
        tenant if isinstance(tenant, str) else "", priority if isinstance(priority, int) else 0
    )
    identity = authorize(keys(), key_of(context.invocation_metadata()), claims)
    if hasattr(request, "tenant"):
        request.tenant = identity.tenant
        request.priority = identity.priority
    if hasattr(request, "cache_salt"):  # the tenant's: a client cannot pick another's blocks
        request.cache_salt = identity.cache_salt
    return identity


class ApiKeys(grpc.aio.ServerInterceptor):
    """Authenticates every method of ``services`` (default: the Router service)."""

    def __init__(self, keys: KeySource, services: Sequence[str] = (ROUTER_SERVICE,)) -> None:
        self._keys = keys
        self._prefixes = tuple(f"/{s}/" for s in services)
        self._handlers: dict[str, grpc.RpcMethodHandler] = {}

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        method = handler_call_details.method  # type: ignore[attr-defined]
        name = method.decode() if isinstance(method, bytes) else method
        if not name.startswith(self._prefixes):
            return await continuation(handler_call_details)
        wrapped = self._handlers.get(name)
        if wrapped is not None:
            return wrapped
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler
        wrapped = _wrap(handler, self._keys)
        self._handlers[name] = wrapped
        return wrapped


def _wrap(handler: grpc.RpcMethodHandler, keys: KeySource) -> grpc.RpcMethodHandler:
    if handler.request_streaming:  # none in the Router service: the metadata alone is checked
        if handler.response_streaming:
            behavior, factory = handler.stream_stream, grpc.stream_stream_rpc_method_handler
        else:
            behavior, factory = handler.stream_unary, grpc.stream_unary_rpc_method_handler
    elif handler.response_streaming:
        behavior, factory = handler.unary_stream, grpc.unary_stream_rpc_method_handler
    else:
        behavior, factory = handler.unary_unary, grpc.unary_unary_rpc_method_handler
    streaming_request = handler.request_streaming

    def check(request: Any, context: grpc.aio.ServicerContext) -> Identity:
        return authenticate(keys, None if streaming_request else request, context)

    wrapped: Any
    if inspect.iscoroutinefunction(behavior):

        async def wrapped(request: Any, context: grpc.aio.ServicerContext) -> Any:
            token = CALLER.set(check(request, context))
            try:
                return await behavior(request, context)
            finally:
                CALLER.reset(token)

    else:  # returns a generator (Router.Generate): returned as is, its errors raised here

        def wrapped(request: Any, context: grpc.aio.ServicerContext) -> Any:
            check(request, context)
            return behavior(request, context)

    return factory(
        wrapped,
        request_deserializer=handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )
