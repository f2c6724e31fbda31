"""Logging and OpenTelemetry set-up, called once from each service's ``main()``.

Trace context travels in gRPC metadata (W3C ``traceparent``) through OpenTelemetry's gRPC
interceptors, so one request is one trace across router and worker. Library code only calls
``tracer(__name__)``; it never configures exporters.
"""

from __future__ import annotations

import logging
import sys
from enum import StrEnum

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter


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


def setup_tracing(
    service: str,
    exporter: Exporter | str = Exporter.NONE,
    otlp_endpoint: str = "",
    extra_processor: SpanProcessor | None = None,
) -> TracerProvider:
    """Installs the global tracer provider. ``extra_processor`` lets tests add an in-memory
    exporter."""
    provider = TracerProvider(resource=Resource.create({"service.name": service}))
    exporter = Exporter(exporter)
    if exporter is Exporter.CONSOLE:
        provider.add_span_processor(BatchSpanProcessor(ConsoleSpanExporter(out=sys.stderr)))
    elif exporter is Exporter.OTLP:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        otlp = OTLPSpanExporter(endpoint=otlp_endpoint) if otlp_endpoint else OTLPSpanExporter()
        provider.add_span_processor(BatchSpanProcessor(otlp))
    if extra_processor is not None:
        provider.add_span_processor(extra_processor)
    trace.set_tracer_provider(provider)
    return provider


def tracer(name: str) -> trace.Tracer:
    return trace.get_tracer(name)


def server_interceptors() -> list:
    """Interceptors for ``grpc.aio.server``: one server span per RPC, parented by the caller's
    trace context from metadata."""
    from opentelemetry.instrumentation.grpc import aio_server_interceptor

    return [aio_server_interceptor()]


def client_interceptors() -> list:
    """Interceptors for ``grpc.aio`` channels: one client span per RPC, context injected into
    metadata."""
    from opentelemetry.instrumentation.grpc import aio_client_interceptors

    return list(aio_client_interceptors())
