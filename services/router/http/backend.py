"""How the HTTP front door reaches the router: a small protocol, and its gRPC implementation on
a channel it owns (for a front door in another process), and the in-process one the router
serves HTTP with (calling its servicer directly). Implementations raise domain errors (``kvmesh.errors``), never
transport errors."""

from __future__ import annotations

import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any, Protocol, runtime_checkable

import grpc
from opentelemetry import context as otel_context
from opentelemetry import trace

from kvmesh import errors
from kvmesh.grpc_errors import await_status, from_rpc_error
from kvmesh.telemetry import tracer
from kvmesh.tls import Tls, open_channel
from kvmesh.v1 import router_pb2, router_pb2_grpc

from ..continuation import Prior
from . import parsing

_tracer = tracer(__name__)
GENERATE_SPAN = "/kvmesh.v1.Router/Generate"  # the name the gRPC API's server span has


async def first_message(stream: AsyncIterator[Any]) -> Any:
    """A ``generate`` stream's first message, where the front doors tell an error (unknown
    model, bad prompt, no worker) by its own HTTP status; a stream that ends before any message
    is ``Unavailable``."""
    try:
        return await anext(stream)
    except StopAsyncIteration:
        raise errors.Unavailable("the router ended the stream without an answer") from None


async def served_model(
    backend: RouterBackend, chat: parsing.ParsedRequest, timeout_s: float
) -> tuple[parsing.ParsedRequest, int]:
    """``chat`` for the model served when it names none and one is served, and that model's
    block size (0: not served; the router then answers not found): the Anthropic and Responses
    front doors report cached tokens in whole blocks."""
    chat, model = await served_model_info(backend, chat, timeout_s)
    return chat, model.block_size if model is not None else 0


async def served_model_info(
    backend: RouterBackend, chat: parsing.ParsedRequest, timeout_s: float
) -> tuple[parsing.ParsedRequest, router_pb2.ModelInfo | None]:
    """``served_model``, with the model's whole description (None: not served)."""
    models = (await backend.list_models(timeout_s)).models
    if not chat.model and len(models) == 1:
        chat = parsing.with_model(chat, models[0].name)
    return chat, next((m for m in models if m.name == chat.model), None)


class RouterBackend(Protocol):
    def generate(
        self, request: router_pb2.GenerateRequest, timeout_s: float
    ) -> AsyncGenerator[router_pb2.GenerateResponse, None]:
        """An async generator over the router's stream. Closing it before the finished message
        (``aclose``, or the consuming task being cancelled) cancels the request, so the worker
        aborts it. The finished message comes once the call has ended (OK): a consumer that
        stops there, or goes away after it, cancels nothing."""
        ...

    async def list_models(self, timeout_s: float) -> router_pb2.ListModelsResponse: ...

    async def close(self) -> None: ...


@runtime_checkable
class TokenCounter(Protocol):
    """A backend that counts a request's prompt tokens without generating (the in-process
    router: its tokenizer and chat template)."""

    async def count_tokens(self, request: router_pb2.GenerateRequest, timeout_s: float) -> int: ...


async def count_tokens(
    backend: RouterBackend, request: router_pb2.GenerateRequest, timeout_s: float
) -> int:
    """The prompt tokens of ``request`` (its chat template rendered, tools included). A router
    reached over gRPC has no count RPC: there it is one generated token's usage (a prefill on
    a worker, whose blocks the next request then finds cached)."""
    if isinstance(backend, TokenCounter):
        return await backend.count_tokens(request, timeout_s)
    one = router_pb2.GenerateRequest()
    one.CopyFrom(request)
    one.sampling.max_tokens = 1
    del one.sampling.stop[:]
    stream = backend.generate(one, timeout_s)
    try:
        async for msg in stream:
            if msg.HasField("finished"):
                return msg.finished.usage.prompt_tokens
    finally:
        await stream.aclose()
    raise errors.Unavailable("the router ended the stream without an answer")


@runtime_checkable
class PromptRenderer(Protocol):
    """A backend that renders a chat request's prompt to token ids, extending a previous turn's
    ids exactly when it can (the in-process router: its tokenizer and chat template). The
    Responses API's stored conversations need it: the next turn's prompt is built from the
    stored ids, and sent as token ids."""

    async def render_prompt(
        self, request: router_pb2.GenerateRequest, prior: Prior | None, new_from: int
    ) -> tuple[list[int], bool]: ...


def error_from_rpc(exc: grpc.aio.AioRpcError) -> errors.KvmeshError:
    mapped = from_rpc_error(exc)
    if mapped is not None:
        return mapped
    if exc.code() is grpc.StatusCode.CANCELLED:  # the router went away mid-call
        return errors.Unavailable(f"the router cancelled the call: {exc.details()}")
    return errors.KvmeshError(f"router error {exc.code().name}: {exc.details()}")


class GrpcRouterBackend:
    """kvmesh.v1.Router over a gRPC channel to ``address`` (host:port). Create it on the loop
    that will use it."""

    def __init__(self, address: str, tls: Tls | None = None) -> None:
        self.address = address
        self._channel = open_channel(address, tls)
        self._stub = router_pb2_grpc.RouterStub(self._channel)

    async def generate(
        self, request: router_pb2.GenerateRequest, timeout_s: float
    ) -> AsyncGenerator[router_pb2.GenerateResponse, None]:
        call = self._stub.Generate(request, timeout=timeout_s)
        try:
            async for msg in call:
                if msg.HasField("finished"):  # its status first: nothing is left to cancel
                    await await_status(call)
                yield msg
        except grpc.aio.AioRpcError as exc:
            raise error_from_rpc(exc) from None
        finally:
            call.cancel()  # no-op once finished; aborts the request otherwise

    async def list_models(self, timeout_s: float) -> router_pb2.ListModelsResponse:
        try:
            return await self._stub.ListModels(router_pb2.ListModelsRequest(), timeout=timeout_s)
        except grpc.aio.AioRpcError as exc:
            raise error_from_rpc(exc) from None

    async def close(self) -> None:
        await self._channel.close()


class RouterStream(Protocol):
    """What ``InProcessRouterBackend`` calls: ``services.router.servicer.RouterServicer``."""

    def stream(
        self, request: router_pb2.GenerateRequest, rid: str, time_remaining_s: float | None
    ) -> AsyncGenerator[router_pb2.GenerateResponse, None]: ...

    def models(self) -> router_pb2.ListModelsResponse: ...

    async def count_tokens(self, request: router_pb2.GenerateRequest) -> int: ...

    async def render_prompt(
        self, request: router_pb2.GenerateRequest, prior: Prior | None, new_from: int
    ) -> tuple[list[int], bool]: ...


class InProcessRouterBackend:
    """The router's own servicer, called in its process: what ``kvmesh router`` serves HTTP
    with. No loopback gRPC hop: per streamed chunk it saves a protobuf encode and decode and
    two passes through gRPC's stack (the router's CPU per token, see BENCHMARKS.md). Each
    request gets a server span of its own (``Router/Generate``, as the gRPC API's)."""

    def __init__(self, servicer: RouterStream) -> None:
        self._servicer = servicer

    async def generate(
        self, request: router_pb2.GenerateRequest, timeout_s: float
    ) -> AsyncGenerator[router_pb2.GenerateResponse, None]:
        rid = request.request_id or uuid.uuid4().hex
        span = _tracer.start_span(GENERATE_SPAN, kind=trace.SpanKind.SERVER)
        ctx = trace.set_span_in_context(span)
        # The span is current only while the servicer runs (around each step), never across a
        # yield: the consumer's context stays its own.
        chunks = self._servicer.stream(request, rid, timeout_s)
        failure: BaseException | None = None
        try:
            while True:
                token = otel_context.attach(ctx)
                try:
                    chunk = await anext(chunks)
                except StopAsyncIteration:
                    break
                finally:
                    otel_context.detach(token)
                yield chunk
        except BaseException as exc:
            failure = exc
            raise
        finally:
            token = otel_context.attach(ctx)
            try:
                await chunks.aclose()
            finally:
                otel_context.detach(token)
                if isinstance(failure, errors.KvmeshError):
                    span.set_status(trace.Status(trace.StatusCode.ERROR, type(failure).__name__))
                span.end()

    async def list_models(self, timeout_s: float) -> router_pb2.ListModelsResponse:
        return self._servicer.models()

    async def count_tokens(self, request: router_pb2.GenerateRequest, timeout_s: float) -> int:
        return await self._servicer.count_tokens(request)

    async def render_prompt(
        self, request: router_pb2.GenerateRequest, prior: Prior | None, new_from: int
    ) -> tuple[list[int], bool]:
        return await self._servicer.render_prompt(request, prior, new_from)

    async def close(self) -> None:
        pass
