"""The router side of ``Worker.GenerateMany``: one stream per worker for all its requests.

Per token, a unary-stream ``Worker.Generate`` costs a gRPC message on each side (about 150 us of
CPU on the machines BENCHMARKS.md was measured on); the worker's ``GenerateMany`` sends one
message per engine step for all the requests of a stream instead. ``WorkerMux.generate`` gives a
call object with the shape the proxy loop already uses for ``stub.Generate``: an async iterator
of ``WorkerGenerateResponse``, ``cancel()``, ``code()``; errors are ``grpc.aio.AioRpcError`` with
the status the unary RPC would have had, so retries and error mapping are unchanged.

A broken stream ends every request on it with UNAVAILABLE (the proxy retries those that had no
token yet, as for a worker that went away); the next request opens a new stream. A request's
deadline goes to the worker (``timeout_s``), which ends it with DEADLINE_EXCEEDED; the router
keeps a timer of its own a little later, for a worker that cannot answer.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import AsyncIterator, Callable
from typing import Protocol

import grpc
from opentelemetry import context as otel_context
from opentelemetry import propagate, trace

from kvmesh.grpc_errors import FIELD_KEY
from kvmesh.telemetry import SERVER_ERRORS, tracer
from kvmesh.v1 import worker_pb2

log = logging.getLogger(__name__)
_tracer = tracer(__name__)
CALL_SPAN = "/kvmesh.v1.Worker/Generate"  # per request, as the unary call's client span
_CALL_ATTRIBUTES = {
    "rpc.system": "grpc",
    "rpc.service": "kvmesh.v1.Worker",
    "rpc.method": "Generate",
}

_BACKSTOP_S = 2.0  # the router's own deadline timer fires this long after the worker's
_CODES = {c.value[0]: c for c in grpc.StatusCode}


def _rpc_error(code: grpc.StatusCode, details: str, field: str = "") -> grpc.aio.AioRpcError:
    trailing = grpc.aio.Metadata((FIELD_KEY, field)) if field else grpc.aio.Metadata()
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), trailing, details=details)


class MuxCall:
    """One request on a ``GenerateMany`` stream (used like a unary-stream call)."""

    def __init__(self, stream: _Stream, call: int, span: trace.Span) -> None:
        self._stream = stream
        self.call = call
        self._span = span
        self._items: collections.deque[worker_pb2.WorkerGenerateResponse] = collections.deque()
        self._waiter: asyncio.Future[None] | None = None
        self._code: grpc.StatusCode | None = None
        self._error: grpc.aio.AioRpcError | None = None
        self._ended = asyncio.get_running_loop().create_future()  # resolves with the code
        self._timer: asyncio.TimerHandle | None = None

    # ---- the proxy's side ----------------------------------------------------------------
    def __aiter__(self) -> AsyncIterator[worker_pb2.WorkerGenerateResponse]:
        return self

    async def __anext__(self) -> worker_pb2.WorkerGenerateResponse:
        while not self._items:
            if self._code is not None:
                if self._error is not None:
                    raise self._error
                raise StopAsyncIteration
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        return self._items.popleft()

    async def code(self) -> grpc.StatusCode:
        """The request's final status, once it has ended (``kvmesh.grpc_errors.await_status``)."""
        return await asyncio.shield(self._ended)

    def cancel(self) -> bool:
        """Aborts the request on the worker unless it has ended; a no-op afterwards."""
        if self._code is not None:
            return False
        self._stream.abort(self.call)
        self._end(grpc.StatusCode.CANCELLED, _rpc_error(grpc.StatusCode.CANCELLED, "cancelled"))
        return True

    # ---- the stream's side ---------------------------------------------------------------
    def _push(self, msg: worker_pb2.WorkerGenerateResponse) -> None:
        if self._code is not None:
            return
        self._items.append(msg)
        self._wake()

    def _end(self, code: grpc.StatusCode, error: grpc.aio.AioRpcError | None) -> None:
        if self._code is not None:
            return
        self._code, self._error = code, error
        if self._timer is not None:
            self._timer.cancel()
        if not self._ended.done():
            self._ended.set_result(code)
        self._stream.forget(self.call)
        self._span.set_attribute("rpc.grpc.status_code", code.value[0])
        if code in SERVER_ERRORS:
            self._span.set_status(trace.Status(trace.StatusCode.ERROR, code.name))
        self._span.end()
        self._wake()

    def _expire(self) -> None:
        if self._code is None:
            self._stream.abort(self.call)
            error = _rpc_error(
                grpc.StatusCode.DEADLINE_EXCEEDED,
                "the worker did not end the request by its deadline",
            )
            self._end(grpc.StatusCode.DEADLINE_EXCEEDED, error)

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)


class _StreamCall(Protocol):
    """What ``_Stream`` needs of a ``GenerateMany`` call."""

    def __aiter__(self) -> AsyncIterator[worker_pb2.WorkerStreamOut]: ...

    def cancel(self) -> bool: ...


class StreamStub(Protocol):
    """What ``WorkerMux`` needs of a worker: a gRPC ``WorkerStub``, or ``InProcessStub``."""

    def GenerateMany(self, requests: AsyncIterator[worker_pb2.WorkerStreamIn]) -> _StreamCall: ...


ServeStream = Callable[
    [AsyncIterator[worker_pb2.WorkerStreamIn]], AsyncIterator[worker_pb2.WorkerStreamOut]
]
"""A worker's ``GenerateMany`` handler as a function of the request stream (in-process)."""


class _InProcessCall:
    def __init__(self, batches: AsyncIterator[worker_pb2.WorkerStreamOut]) -> None:
        self._batches = batches

    def __aiter__(self) -> AsyncIterator[worker_pb2.WorkerStreamOut]:
        return self._batches

    def cancel(self) -> bool:
        # The reader's task is cancelled right after (``_Stream.close``): that ends the
        # handler's generator where it waits, and its ``finally`` cancels its requests.
        return False


class InProcessStub:
    """A worker in this process (``services/node``): its ``GenerateMany`` handler called
    directly, the same messages passed as objects, never serialized. Everything else of the
    worker (load, KV events, other RPCs) still goes over its gRPC port."""

    def __init__(self, serve: ServeStream) -> None:
        self._serve = serve

    def GenerateMany(self, requests: AsyncIterator[worker_pb2.WorkerStreamIn]) -> _InProcessCall:
        return _InProcessCall(self._serve(requests))


class _Stream:
    """One ``GenerateMany`` call and the requests on it."""

    def __init__(self, stub: StreamStub, worker_id: str) -> None:
        self.worker_id = worker_id
        self.broken = False
        self._calls: dict[int, MuxCall] = {}
        self._next_call = 1
        self._up: asyncio.Queue[worker_pb2.WorkerStreamIn | None] = asyncio.Queue()
        self._call = stub.GenerateMany(self._requests())
        self._reader = asyncio.create_task(self._read(), name=f"generate-many-{worker_id}")

    def open(self, request: worker_pb2.WorkerGenerateRequest, timeout_s: float) -> MuxCall:
        number = self._next_call
        self._next_call += 1
        # The request's trace goes on through a client span of its own (the stream's is not
        # any request's); its context rides the message (nothing when tracing is off).
        span = _tracer.start_span(
            CALL_SPAN, kind=trace.SpanKind.CLIENT, attributes=_CALL_ATTRIBUTES
        )
        call = MuxCall(self, number, span)
        self._calls[number] = call
        carrier: dict[str, str] = {}
        propagate.inject(carrier, context=trace.set_span_in_context(span))
        self._up.put_nowait(
            worker_pb2.WorkerStreamIn(
                call=number, generate=request, timeout_s=timeout_s, trace_context=carrier
            )
        )
        loop = asyncio.get_running_loop()
        call._timer = loop.call_later(timeout_s + _BACKSTOP_S, call._expire)
        return call

    def abort(self, call: int) -> None:
        if not self.broken:
            self._up.put_nowait(worker_pb2.WorkerStreamIn(call=call, abort=True))

    def forget(self, call: int) -> None:
        self._calls.pop(call, None)

    async def close(self) -> None:
        self._up.put_nowait(None)
        self._call.cancel()
        self._reader.cancel()
        await asyncio.gather(self._reader, return_exceptions=True)

    async def _requests(self) -> AsyncIterator[worker_pb2.WorkerStreamIn]:
        while True:
            msg = await self._up.get()
            if msg is None:
                return
            yield msg

    async def _read(self) -> None:
        reason = "the worker ended the stream"
        try:
            async for batch in self._call:
                calls = self._calls
                for out, number in zip(batch.outputs, batch.output_calls, strict=True):
                    call = calls.get(number)
                    if call is not None:
                        call._push(out)
                for end in batch.ends:
                    call = calls.get(end.call)
                    if call is None:
                        continue
                    code = _CODES.get(end.code, grpc.StatusCode.UNKNOWN)
                    error = None
                    if code is not grpc.StatusCode.OK:
                        error = _rpc_error(code, end.message, end.field)
                    call._end(code, error)
        except grpc.aio.AioRpcError as exc:
            reason = f"{exc.code().name}: {exc.details()}"
        except asyncio.CancelledError:
            reason = "the router closed the stream"
            raise
        finally:
            self.broken = True
            pending = list(self._calls.values())
            if pending:
                log.warning(
                    "GenerateMany stream to worker %s broke (%s); ending %d requests on it",
                    self.worker_id,
                    reason,
                    len(pending),
                )
            for call in pending:
                call._end(
                    grpc.StatusCode.UNAVAILABLE,
                    _rpc_error(grpc.StatusCode.UNAVAILABLE, f"worker stream broke: {reason}"),
                )


class WorkerMux:
    """The router's data path to one worker: a ``GenerateMany`` stream, opened on first use and
    again after it breaks."""

    def __init__(self, stub: StreamStub, worker_id: str, rank: int | None = None) -> None:
        """``rank``: the target is that data-parallel rank of the worker: every request sent
        here names it (``data_parallel_rank``)."""
        self._stub = stub
        self._worker_id = worker_id
        self._rank = rank
        self._stream: _Stream | None = None

    def generate(self, request: worker_pb2.WorkerGenerateRequest, timeout_s: float) -> MuxCall:
        if self._rank is not None:
            request.data_parallel_rank = self._rank
        stream = self._stream
        if stream is None or stream.broken:
            # Opened outside the request's trace: the stream outlives it and serves others.
            token = otel_context.attach(otel_context.Context())
            try:
                stream = self._stream = _Stream(self._stub, self._worker_id)
            finally:
                otel_context.detach(token)
        return stream.open(request, timeout_s)

    async def close(self) -> None:
        if self._stream is not None:
            await self._stream.close()
            self._stream = None
