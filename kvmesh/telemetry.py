"""Logging and OpenTelemetry set-up, called once from each service's ``main()``.

Trace context travels in gRPC metadata (W3C ``traceparent``): OpenTelemetry's client
interceptors inject it on outgoing calls, and ``ServerSpans`` (below) makes each incoming RPC a
server span under it, so one request is one trace across router, worker and kvmanager (see
docs/tracing.md). Library code only calls ``tracer(__name__)``; it never configures exporters.
"""

from __future__ import annotations

import inspect
import logging
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from enum import StrEnum
from typing import Any
from urllib.parse import urlsplit

import grpc
from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter
from opentelemetry.trace import Span, SpanKind, Status, StatusCode


class Exporter(StrEnum):
    NONE = "none"
    CONSOLE = "console"
    OTLP = "otlp"


def setup_logging(service: str, level: str = "INFO") -> None:
    logging.basicConfig(
        level=level.upper(),
        stream=sys.stderr,
        format=f"%(asctime)s %(levelname)s {service} %(name)s: %(message)s",
    )


def otlp_target(endpoint: str) -> tuple[str, bool]:
    """``--otlp-endpoint`` as the OTLP/gRPC exporter's (endpoint, insecure): ``host:port`` and
    ``http://host:port`` are plaintext, ``https://host:port`` is TLS. (The exporter itself
    would take a bare ``host:port`` as TLS, which a collector's default plaintext 4317 port
    refuses.)"""
    if "://" not in endpoint:
        return endpoint, True
    scheme = urlsplit(endpoint).scheme.lower()
    if scheme not in ("http", "https"):
        raise ValueError(f"--otlp-endpoint {endpoint!r}: use host:port, http:// or https://")
    return endpoint, scheme == "http"


def setup_tracing(
    service: str,
    exporter: Exporter | str = Exporter.NONE,
    otlp_endpoint: str = "",
    extra_processor: SpanProcessor | None = None,
) -> TracerProvider | None:
    """Installs the global tracer provider (``service`` is the ``service.name`` resource).
    ``extra_processor`` lets tests add an in-memory exporter. With nowhere for spans to go
    (``none`` and no extra processor) nothing is installed: OpenTelemetry's default no-op
    tracer then makes no span and propagates no context, so tracing off costs nothing per
    request, per RPC or per KV block (an SDK provider without processors still records every
    span: ids, attributes, timestamps, thrown away)."""
    processor = span_processor(exporter, otlp_endpoint)
    if processor is None and extra_processor is None:
        return None
    provider = TracerProvider(resource=Resource.create({"service.name": service}))
    if processor is not None:
        provider.add_span_processor(processor)
    if extra_processor is not None:
        provider.add_span_processor(extra_processor)
    trace.set_tracer_provider(provider)
    return provider


def span_processor(exporter: Exporter | str, otlp_endpoint: str = "") -> SpanProcessor | None:
    """Where spans go (``--trace-exporter``): nowhere, to stderr, or over OTLP/gRPC to
    ``otlp_endpoint`` (``--otlp-endpoint``) or, when that is empty, to where the standard
    ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` / ``OTEL_EXPORTER_OTLP_ENDPOINT`` environment says
    (default ``localhost:4317``). Batched: exporting never blocks a request."""
    exporter = Exporter(exporter)
    if exporter is Exporter.CONSOLE:
        return BatchSpanProcessor(ConsoleSpanExporter(out=sys.stderr))
    if exporter is Exporter.OTLP:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        if otlp_endpoint:
            endpoint, insecure = otlp_target(otlp_endpoint)
            return BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint, insecure=insecure))
        return BatchSpanProcessor(OTLPSpanExporter())
    return None


def tracer(name: str) -> trace.Tracer:
    return trace.get_tracer(name)


def tracing_on() -> bool:
    """Whether ``setup_tracing`` (or a test) installed an SDK provider: spans go somewhere."""
    return isinstance(trace.get_tracer_provider(), TracerProvider)


def server_interceptors() -> list[grpc.aio.ServerInterceptor]:
    """Interceptors for ``grpc.aio.server``: one server span per RPC, parented by the caller's
    trace context from metadata. None with tracing off: an interceptor wraps every handler and
    every message of a stream (an attach, a detach, a no-op span), work for nobody. Call it
    after ``setup_tracing``."""
    return [ServerSpans()] if tracing_on() else []


def client_interceptors() -> list:
    """Interceptors for ``grpc.aio`` channels: one client span per RPC, context injected into
    metadata. None with tracing off: gRPC then skips its intercepted-call wrappers, which cost
    a task and a queue hop per streamed message. Call it after ``setup_tracing``."""
    if not tracing_on():
        return []
    from opentelemetry.instrumentation.grpc import aio_client_interceptors

    return list(aio_client_interceptors())


# ---- server spans ---------------------------------------------------------------------------
# Server span status per OpenTelemetry's gRPC conventions: these codes are the server's fault;
# the others (CANCELLED, NOT_FOUND, INVALID_ARGUMENT, ...) are the caller's and leave it unset.
SERVER_ERRORS = frozenset(
    {
        grpc.StatusCode.UNKNOWN,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.UNIMPLEMENTED,
        grpc.StatusCode.INTERNAL,
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DATA_LOSS,
    }
)
_CODES = {c.value[0]: c for c in grpc.StatusCode}


class ServerSpans(grpc.aio.ServerInterceptor):
    """One SERVER span per RPC, named by its method (``/kvmesh.v1.Worker/Generate``), parented
    by the W3C context in the call's metadata, with the ``rpc.*`` attributes and the final
    ``rpc.grpc.status_code``; the handler runs with the span as its current context.

    Used instead of OpenTelemetry's aio server interceptor, whose response-stream wrapper keeps
    the span's context attached across each ``yield``: when a client goes away while gRPC is
    sending a message, gRPC abandons the handler's generator there and asyncio closes it later
    from a task of its own, where that detach fails (OpenTelemetry logs "Failed to detach
    context" at ERROR; every disconnect mid-stream did it). Here the context is attached only
    while the handler runs one step (an ``await`` of a unary handler, one ``anext`` of a
    stream), never across a ``yield``, and the span is ended explicitly. A streaming handler
    written as a coroutine (``context.write``, like ``grpc.health.v1.Health/Watch``) is awaited
    whole, as a unary one is.
    """

    def __init__(self) -> None:
        self._tracer = trace.get_tracer("kvmesh.grpc")

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler
        method = handler_call_details.method  # type: ignore[attr-defined]
        if isinstance(method, bytes):
            method = method.decode()
        if handler.response_streaming:
            if handler.request_streaming:
                behavior, factory = handler.stream_stream, grpc.stream_stream_rpc_method_handler
            else:
                behavior, factory = handler.unary_stream, grpc.unary_stream_rpc_method_handler
            # A coroutine handler streams with ``context.write`` (the health service's Watch
            # does); gRPC tells the two kinds apart by the function, so the wrapper is one too.
            if inspect.iscoroutinefunction(behavior):
                wrapped: Any = self._unary(method, behavior)
            else:
                wrapped = self._stream(method, behavior)
        else:
            if handler.request_streaming:
                behavior, factory = handler.stream_unary, grpc.stream_unary_rpc_method_handler
            else:
                behavior, factory = handler.unary_unary, grpc.unary_unary_rpc_method_handler
            wrapped = self._unary(method, behavior)
        return factory(
            wrapped,
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )

    def _unary(self, method: str, behavior: Any) -> Any:
        async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
            span, ctx = self._start(method, context)
            failure: BaseException | None = None
            token = otel_context.attach(ctx)
            try:
                return await behavior(request, context)
            except BaseException as exc:
                failure = exc
                raise
            finally:
                otel_context.detach(token)  # the same task and step as the attach
                _end(span, context, failure)

        return unary

    def _stream(self, method: str, behavior: Any) -> Any:
        async def stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            span, ctx = self._start(method, context)
            responses = behavior(request, context)
            failure: BaseException | None = None
            try:
                while True:
                    token = otel_context.attach(ctx)
                    try:
                        msg = await anext(responses)
                    except StopAsyncIteration:
                        break
                    finally:
                        otel_context.detach(token)
                    yield msg
            except BaseException as exc:
                failure = exc
                raise
            finally:
                try:
                    if failure is not None:  # abandoned or failed: close the handler too
                        token = otel_context.attach(ctx)
                        try:
                            await responses.aclose()
                        finally:
                            otel_context.detach(token)
                finally:
                    _end(span, context, failure)

        return stream

    def _start(self, method: str, context: grpc.aio.ServicerContext) -> tuple[Span, Any]:
        metadata = {md.key: md.value for md in context.invocation_metadata() or ()}
        parent = propagate.extract(metadata)
        service, _, name = method.lstrip("/").partition("/")
        attributes: dict[str, Any] = {
            "rpc.system": "grpc",
            "rpc.service": service,
            "rpc.method": name,
        }
        peer = _peer(context.peer())
        if peer is not None:
            attributes["net.peer.ip"], attributes["net.peer.port"] = peer
        span = self._tracer.start_span(
            method, context=parent, kind=SpanKind.SERVER, attributes=attributes
        )
        return span, trace.set_span_in_context(span, parent)


def _peer(peer: str) -> tuple[str, str] | None:
    """``ipv4:127.0.0.1:5000`` / ``ipv6:[::1]:5000`` as (ip, port); None for unix sockets."""
    kind, _, rest = peer.split(",")[0].partition(":")
    if kind not in ("ipv4", "ipv6") or ":" not in rest:
        return None
    ip, _, port = rest.rpartition(":")
    return ip, port


def _end(span: Span, context: grpc.aio.ServicerContext, failure: BaseException | None) -> None:
    code = _status_code(context, failure)
    span.set_attribute("rpc.grpc.status_code", code.value[0])
    if code in SERVER_ERRORS:
        span.set_status(Status(StatusCode.ERROR, code.name))
    if isinstance(failure, Exception) and not isinstance(failure, grpc.aio.AbortError):
        span.record_exception(failure)
    span.end()


def _status_code(
    context: grpc.aio.ServicerContext, failure: BaseException | None
) -> grpc.StatusCode:
    """The RPC's final code: what the handler set (``abort``, ``set_code``); else CANCELLED
    for a handler cancelled or abandoned by its client, UNKNOWN for an exception, OK."""
    code = context.code()
    if isinstance(code, grpc.StatusCode):
        return code
    if isinstance(code, int) and code in _CODES:
        return _CODES[code]
    if failure is None:
        return grpc.StatusCode.OK
    if isinstance(failure, Exception):
        return grpc.StatusCode.UNKNOWN
    return grpc.StatusCode.CANCELLED
