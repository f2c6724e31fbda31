"""The worker side of ``Worker.GenerateMany``: many requests on one stream, outputs batched.

The router keeps one such stream per worker for its data path. Each ``generate`` that comes up
runs as a task of its own, exactly as a unary ``Generate`` would (admission, the engine stream,
metrics, abort on cancel); its messages go to one outbox, and the stream sends whatever the
outbox holds as one ``WorkerStreamOut``. vLLM hands the outputs of one engine step to all its
requests in one pass of the event loop, so a step's tokens for every request of the stream
leave in one message: gRPC's per-message cost is paid per step, not per request per token.

Per call (the router numbers them; a retry may reuse a request id on the same stream): a
``timeout_s`` bounds it (DEADLINE_EXCEEDED); ``abort`` cancels it, and the next message is read
only once the engine has let the request go, so a retry of the same request id that follows an
abort is admitted; its end is one ``WorkerStreamEnd`` (code 0, or the status the unary RPC
would have ended with). The stream ending, or breaking, cancels every request still on it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import grpc
from opentelemetry import context as otel_context
from opentelemetry import propagate, trace

from kvmesh import errors
from kvmesh.grpc_errors import field_of, status_of
from kvmesh.telemetry import SERVER_ERRORS, tracer
from kvmesh.v1 import worker_pb2

if TYPE_CHECKING:
    from .servicer import WorkerServicer

log = logging.getLogger(__name__)
_tracer = tracer(__name__)
REQUEST_SPAN = "/kvmesh.v1.Worker/Generate"  # per request, as the unary RPC's server span
_ABORT_WAIT_S = 5.0  # at most this long for an aborted request to leave the engine


class _Cancelled(Exception):
    """A request the router aborted (or whose stream closed)."""


@dataclass(frozen=True, slots=True)
class StreamBatch:
    """A ``WorkerStreamOut``'s fields as a plain object: what an in-process reader
    (``services/node``) gets, the step's messages not copied into a container message."""

    outputs: list[worker_pb2.WorkerGenerateResponse]
    output_calls: list[int]
    ends: list[worker_pb2.WorkerStreamEnd]


class WorkerStreamServer:
    """One ``GenerateMany`` call. ``batch``: what a step's outputs leave as (the message for
    gRPC; ``StreamBatch`` in-process)."""

    def __init__(
        self,
        servicer: WorkerServicer,
        batch: Callable[..., Any] = worker_pb2.WorkerStreamOut,
    ) -> None:
        self._servicer = servicer
        self._batch = batch
        self._outputs: list[worker_pb2.WorkerGenerateResponse] = []
        self._output_calls: list[int] = []
        self._ends: list[worker_pb2.WorkerStreamEnd] = []
        self._ready = asyncio.Event()
        self._tasks: dict[int, asyncio.Task[None]] = {}  # call -> its request's task
        self._reading = True

    async def serve(
        self, requests: AsyncIterator[worker_pb2.WorkerStreamIn]
    ) -> AsyncIterator[Any]:  # of what ``batch`` makes
        reader = asyncio.create_task(self._read(requests), name="generate-many-reader")
        try:
            while True:
                await self._ready.wait()
                self._ready.clear()
                if self._outputs or self._ends:
                    batch = self._batch(
                        outputs=self._outputs, output_calls=self._output_calls, ends=self._ends
                    )
                    self._outputs, self._output_calls, self._ends = [], [], []
                    yield batch
                elif not self._reading and not self._tasks:
                    return  # the router closed its side and every request has ended
        finally:
            reader.cancel()
            tasks = [reader, *self._tasks.values()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _read(self, requests: AsyncIterator[worker_pb2.WorkerStreamIn]) -> None:
        try:
            async for msg in requests:
                kind = msg.WhichOneof("kind")
                if kind == "generate":
                    self._start(msg)
                elif kind == "abort":
                    task = self._tasks.get(msg.call)
                    if task is not None:
                        task.cancel()
                        await asyncio.wait({task}, timeout=_ABORT_WAIT_S)
        except grpc.aio.AioRpcError as exc:  # the router went away: its requests go too
            log.info("GenerateMany stream from the router ended: %s", exc.code().name)
        finally:
            self._reading = False
            self._ready.set()

    def _start(self, msg: worker_pb2.WorkerStreamIn) -> None:
        call = msg.call
        if call in self._tasks:
            self._end(call, "", errors.InvalidArgument(f"call {call} is already on this stream"))
            return
        parent = propagate.extract(dict(msg.trace_context))
        self._tasks[call] = asyncio.create_task(
            self._run(call, msg.generate, msg.timeout_s, parent),
            name=f"generate-{msg.generate.request_id}",
        )

    async def _run(
        self,
        call: int,
        request: worker_pb2.WorkerGenerateRequest,
        timeout_s: float,
        parent: otel_context.Context,
    ) -> None:
        servicer = self._servicer
        rid = request.request_id
        span = _tracer.start_span(REQUEST_SPAN, context=parent, kind=trace.SpanKind.SERVER)
        token = otel_context.attach(trace.set_span_in_context(span, parent))
        failure: BaseException | None = None
        try:
            req = await servicer.admit(request)
            admitted = object()
            servicer.track(rid, admitted)
            try:
                async with asyncio.timeout(timeout_s if timeout_s > 0 else None):
                    async for out in servicer.outputs(req):
                        self._outputs.append(out)
                        self._output_calls.append(call)
                        self._ready.set()
            finally:
                servicer.untrack(rid, admitted)
        except TimeoutError:
            failure = errors.DeadlineExceeded(f"request {rid} did not finish within its deadline")
        except asyncio.CancelledError:  # aborted by the router, or the stream is closing
            failure = _Cancelled(f"request {rid} cancelled by the router")
        except Exception as exc:
            failure = exc
        finally:
            with contextlib.suppress(ValueError):
                otel_context.detach(token)
            self._tasks.pop(call, None)
            code = self._end(call, rid, failure)
            span.set_attribute("rpc.grpc.status_code", code.value[0])
            if code in SERVER_ERRORS:  # the server's fault, as ServerSpans marks them
                span.set_status(trace.Status(trace.StatusCode.ERROR, code.name))
            span.end()

    def _end(self, call: int, rid: str, failure: BaseException | None) -> grpc.StatusCode:
        if failure is None:
            code, message = grpc.StatusCode.OK, ""
        elif isinstance(failure, _Cancelled):
            code, message = grpc.StatusCode.CANCELLED, str(failure)
        else:
            code, message = status_of(failure, rid)
        field = field_of(failure) if failure is not None else ""
        self._ends.append(
            worker_pb2.WorkerStreamEnd(call=call, code=code.value[0], message=message, field=field)
        )
        self._ready.set()
        return code
