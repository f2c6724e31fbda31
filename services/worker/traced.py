"""Domain spans around an ``Engine``: the engine is wrapped, not sprinkled with tracing.

Per request, ``engine.generate`` (admission to finish; child of the gRPC ``Worker/Generate``
server span) with two phases laid end to end:

- ``engine.prefill``: admission -> the first token reached this process. Its child
  ``engine.queue`` is admission -> first scheduled by vLLM's scheduler (vLLM's SCHEDULED
  event). While the request is in prefill, ``engine.prefill`` is the current context of the
  inner engine, so the trace context the KV connector sends to the kvmanager (``Lookup``,
  ``GetBlocks``, ``FetchFromPeer``) makes the kvmanager's spans its descendants.
- ``engine.decode``: the first token -> finish (absent when no token came).

Times are measured at the ``AsyncLLM`` boundary, not inside vLLM: admission is when this
wrapper hands the request to the engine adapter (which submits it to ``AsyncLLM.generate``
microseconds later); the first token and the finish are when the adapter took them out of
``AsyncLLM``'s output stream (``engine.py``'s ``Timing``); the end of ``engine.queue`` is vLLM's
own scheduled timestamp. All are ``time.monotonic()`` readings, set as explicit ``start_time`` /
``end_time`` (wall-clock nanoseconds, through one clock offset per request, so spans laid end to
end share their edges exactly). The phases are ended when the request ends, with its final
counts. Cheap: four spans per request, no per-token events or attribute updates.

Attributes are counts and ids, never prompt text.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable

from opentelemetry import context as otel_context
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
)

_tracer = tracer(__name__)


def _epoch_ns(monotonic_s: float, offset_ns: int) -> int:
    """A ``time.monotonic()`` reading as the wall-clock nanoseconds OpenTelemetry wants."""
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

    # RankedEngine (an inner engine with data-parallel ranks; the servicer asks only then)
    def rank_load(self, rank: int) -> EngineLoad:
        return self._inner.rank_load(rank)  # type: ignore[attr-defined,no-any-return]

    def rank_of(self, request_id: str) -> int | None:
        return self._inner.rank_of(request_id)  # type: ignore[attr-defined,no-any-return]

    def set_rank_kv_event_sink(self, rank: int, sink: KvEventSink) -> None:
        self._inner.set_rank_kv_event_sink(rank, sink)  # type: ignore[attr-defined]

    async def abort(self, request_id: str) -> None:
        await self._inner.abort(request_id)

    async def close(self) -> None:
        await self._inner.close()

    async def generate(self, request: GenerateRequest) -> AsyncIterator[OutputDelta]:
        # start_span, not start_as_current_span: a context attached inside an async generator
        # and held across a yield may be detached from another task when it is closed.
        rec = _Request(request)
        prefill_ctx = trace.set_span_in_context(rec.prefill)
        stream = self._inner.generate(request)
        try:
            while True:
                # Attached for one step only (never across our yield): the inner engine admits
                # the request in its first step and reads the current context for the KV
                # connector there.
                token = otel_context.attach(prefill_ctx) if rec.in_prefill else None
                try:
                    delta = await anext(stream)
                except StopAsyncIteration:
                    break
                finally:
                    if token is not None:
                        otel_context.detach(token)
                rec.saw(delta)
                yield delta
        except BaseException as exc:
            rec.failed(exc)
            raise
        finally:
            try:
                if isinstance(stream, AsyncGenerator):  # closed early: the engine aborts it now
                    await stream.aclose()
            finally:
                rec.end()


class _Request:
    """The spans of one request: ``engine.generate`` and ``engine.prefill`` start at admission
    (prefill's context must exist before the KV connector's calls); everything ends in
    ``end()``, with explicit times."""

    def __init__(self, request: GenerateRequest) -> None:
        self.request_id = request.request_id
        self.offset_ns = _clock_offset_ns()  # one offset: spans laid end to end share edges
        self.arrived = time.monotonic()
        start = _epoch_ns(self.arrived, self.offset_ns)
        prompt_tokens = len(request.prompt_token_ids)
        self.span = _tracer.start_span(
            "engine.generate",
            start_time=start,
            attributes={
                "request_id": request.request_id,
                "prompt_tokens": prompt_tokens,
                "max_tokens": request.sampling.max_tokens,
            },
        )
        prefill_attrs: dict[str, str | int] = {
            "request_id": request.request_id,
            "prompt_tokens": prompt_tokens,
        }
        if request.kv_source is not None:  # the router's hint: a peer kvmanager holds more
            prefill_attrs["kv_source.kvmanager_id"] = request.kv_source.kvmanager_id
            prefill_attrs["kv_source.blocks"] = request.kv_source.blocks
        self.prefill = _tracer.start_span(
            "engine.prefill",
            context=trace.set_span_in_context(self.span),
            start_time=start,
            attributes=prefill_attrs,
        )
        self.first_token_s: float | None = None  # seen here; the engine's Timing wins
        self.last: OutputDelta | None = None
        self.failure: BaseException | None = None

    @property
    def in_prefill(self) -> bool:
        return self.first_token_s is None

    def saw(self, delta: OutputDelta) -> None:
        self.last = delta
        if self.first_token_s is None and delta.token_ids:
            self.first_token_s = time.monotonic()

    def failed(self, exc: BaseException) -> None:
        self.failure = exc

    def end(self) -> None:
        ended = time.monotonic()
        last, offset = self.last, self.offset_ns
        timing = last.timing if last is not None else None  # on the final delta only
        finished = max((timing.finished_s if timing else None) or ended, self.arrived)
        first_token = (timing.first_token_s if timing else None) or self.first_token_s
        if first_token is not None:
            first_token = min(max(first_token, self.arrived), finished)
        prefill_end = finished if first_token is None else first_token
        cancelled = isinstance(self.failure, GeneratorExit | asyncio.CancelledError)
        error = None if cancelled else self.failure

        out: dict[str, str | int] = {}  # the output so far
        if last is not None:
            out["completion_tokens"] = last.completion_tokens
            if last.finish is not None:
                out["finish_reason"] = last.finish.reason.value
        # vLLM's num_cached_tokens: prefix cache hits plus tokens the KV connector loaded
        cached = last.cached_tokens if last is not None else 0

        span = self.span
        span.set_attributes({**out, "cached_tokens": cached})
        ttft = 0.0 if first_token is None else first_token - self.arrived
        span.set_attribute("time_to_first_token_s", ttft)
        if cancelled:
            span.set_attribute("cancelled", True)
        if error is not None:
            span.record_exception(error)
            span.set_status(Status(StatusCode.ERROR, type(error).__name__))

        if timing is not None and timing.scheduled_s is not None:
            queue = _tracer.start_span(
                "engine.queue",
                context=trace.set_span_in_context(self.prefill),
                start_time=_epoch_ns(self.arrived, offset),
                attributes={"request_id": self.request_id},
            )
            queued = min(max(timing.scheduled_s, self.arrived), prefill_end)
            queue.end(end_time=_epoch_ns(queued, offset))
        self.prefill.set_attribute("cached_tokens", cached)
        if first_token is None:
            _phase_status(self.prefill, error, cancelled)
        self.prefill.end(end_time=_epoch_ns(prefill_end, offset))
        if first_token is not None:
            decode = _tracer.start_span(
                "engine.decode",
                context=trace.set_span_in_context(span),
                start_time=_epoch_ns(first_token, offset),
                attributes={"request_id": self.request_id, **out},
            )
            _phase_status(decode, error, cancelled)
            decode.end(end_time=_epoch_ns(finished, offset))
        span.end(end_time=_epoch_ns(max(finished, ended), offset))


def _phase_status(span: Span, error: BaseException | None, cancelled: bool) -> None:
    """Marks the phase the request was in when it failed (the exception is on its parent)."""
    if error is not None:
        span.set_status(Status(StatusCode.ERROR, type(error).__name__))
    elif cancelled:
        span.set_attribute("cancelled", True)
