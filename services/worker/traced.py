"""Domain spans around an ``Engine``: the engine is wrapped, not sprinkled with tracing.

Per request: ``engine.generate`` (arrival to finish, child of the gRPC server span) with three
children laid end to end from the engine's timing:

- ``engine.queue``: arrival -> first scheduled by vLLM's scheduler (vLLM's SCHEDULED event;
  if the request never got scheduled, arrival -> end);
- ``engine.first_token``: scheduled -> the first token reached this process (prefill);
- ``engine.decode``: first token -> finish.

Attributes are counts and ids, never prompt text.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable

from opentelemetry import trace
from opentelemetry.trace import Span, Status, StatusCode

from kvmesh.telemetry import tracer

from .core import (
    Engine,
    EngineInfo,
    EngineLoad,
    GenerateRequest,
    KvEventSink,
    OutputDelta,
    Timing,
)

_tracer = tracer(__name__)


def _epoch_ns(monotonic_s: float, offset_ns: int | None = None) -> int:
    """A ``time.monotonic()`` reading as the wall-clock nanoseconds OpenTelemetry wants."""
    if offset_ns is None:
        offset_ns = _clock_offset_ns()
    return offset_ns + int(monotonic_s * 1e9)


def _clock_offset_ns() -> int:
    return time.time_ns() - time.monotonic_ns()


class TracedEngine:
    """An ``Engine`` that records spans for every request of the engine it wraps."""

    def __init__(self, inner: Engine) -> None:
        self._inner = inner

    @property
    def inner(self) -> Engine:
        return self._inner

    @property
    def info(self) -> EngineInfo:
        return self._inner.info

    def is_running(self, request_id: str) -> bool:
        return self._inner.is_running(request_id)

    def load(self) -> EngineLoad:
        return self._inner.load()

    def add_load_listener(self, listener: Callable[[], None]) -> None:
        self._inner.add_load_listener(listener)

    def set_kv_event_sink(self, sink: KvEventSink) -> None:
        self._inner.set_kv_event_sink(sink)

    async def abort(self, request_id: str) -> None:
        await self._inner.abort(request_id)

    async def close(self) -> None:
        await self._inner.close()

    async def generate(self, request: GenerateRequest) -> AsyncIterator[OutputDelta]:
        # start_span, not start_as_current_span: a context attached inside an async generator
        # may be detached from another task when the generator is closed.
        arrived = time.monotonic()
        span = _tracer.start_span(
            "engine.generate",
            start_time=_epoch_ns(arrived),
            attributes={
                "request_id": request.request_id,
                "prompt_tokens": len(request.prompt_token_ids),
                "max_tokens": request.sampling.max_tokens,
            },
        )
        last: OutputDelta | None = None
        try:
            async for delta in self._inner.generate(request):
                last = delta
                yield delta
        except BaseException as exc:
            if not isinstance(exc, GeneratorExit):
                span.record_exception(exc)
                span.set_status(Status(StatusCode.ERROR, type(exc).__name__))
            raise
        finally:
            _end(span, request.request_id, arrived, last)


def _end(span: Span, request_id: str, arrived: float, last: OutputDelta | None) -> None:
    ended = time.monotonic()
    timing = last.timing if last is not None and last.timing is not None else Timing(arrived)
    if last is not None:
        span.set_attribute("cached_tokens", last.cached_tokens)
        span.set_attribute("completion_tokens", last.completion_tokens)
        if last.finish is not None:
            span.set_attribute("finish_reason", last.finish.reason.value)
    span.set_attribute("time_to_first_token_s", timing.time_to_first_token_s)
    finished = timing.finished_s or ended
    offset = _clock_offset_ns()  # one offset, so spans laid end to end share their edges
    ctx = trace.set_span_in_context(span)
    attrs = {"request_id": request_id}
    marks = [
        ("engine.queue", timing.arrived_s, timing.scheduled_s or finished),
        ("engine.first_token", timing.scheduled_s, timing.first_token_s),
        ("engine.decode", timing.first_token_s, finished),
    ]
    for name, start, end in marks:
        if start is None or end is None or end < start:
            continue
        child = _tracer.start_span(
            name, context=ctx, start_time=_epoch_ns(start, offset), attributes=attrs
        )
        child.end(end_time=_epoch_ns(end, offset))
    span.end(end_time=_epoch_ns(max(finished, ended), offset))
