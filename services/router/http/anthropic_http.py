"""The aiohttp edge of the Anthropic Messages API: ``POST /v1/messages`` (SSE or one message)
and ``POST /v1/messages/count_tokens``, on the OpenAI front door's server and router backend.
Translation lives in ``anthropic`` and ``anthropic_stream``."""

from __future__ import annotations

import contextlib
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import replace
from typing import Any

import msgspec
from aiohttp import web

from kvmesh import errors

from . import anthropic, parsing, rendering
from .anthropic_stream import EventStream, MessageCollector, sse_event
from .auth import identity_of
from .backend import RouterBackend, count_tokens, first_message, served_model
from .errors import (
    BadRequest,
    MethodNotAllowed,
    PayloadTooLarge,
    UnknownRoute,
    retry_after_headers,
)
from .sse import open_event_stream

log = logging.getLogger(__name__)

MESSAGES_PATH = "/v1/messages"
COUNT_TOKENS_PATH = "/v1/messages/count_tokens"

_encode = msgspec.json.Encoder().encode


def is_anthropic_path(path: str) -> bool:
    """Whether errors on ``path`` take Anthropic's shape (aiohttp's own: 404, 405, 413, 500)."""
    return path == MESSAGES_PATH or path.startswith(MESSAGES_PATH + "/")


def error_response(exc: BaseException, request_id: str = "") -> web.Response:
    status, body = anthropic.error_body(exc, request_id)
    if status >= 500:
        log.warning("request %s failed: %s: %s", request_id, type(exc).__name__, exc)
    headers = retry_after_headers(exc)
    if request_id:
        headers["request-id"] = headers["x-request-id"] = request_id
    return web.Response(
        status=status, body=_encode(body), content_type="application/json", headers=headers
    )


class AnthropicEndpoints:
    """The Messages API handlers. ``backend`` gives the router backend (once the server has
    started); ``read_json`` reads a body within the server's size limit (raising domain
    errors)."""

    def __init__(
        self,
        backend: Callable[[], RouterBackend],
        read_json: Callable[[web.Request], Awaitable[object]],
        *,
        timeout_s: float,
        models_timeout_s: float,
    ) -> None:
        self._backend = backend
        self._read_json = read_json
        self._timeout_s = timeout_s
        self._models_timeout_s = models_timeout_s

    def add_routes(self, app: web.Application) -> None:
        app.router.add_post(MESSAGES_PATH, self.messages)
        app.router.add_post(COUNT_TOKENS_PATH, self.count_tokens)

    async def _model(self, chat: parsing.ParsedRequest) -> tuple[parsing.ParsedRequest, int]:
        return await served_model(self._backend(), chat, self._models_timeout_s)

    async def count_tokens(self, request: web.Request) -> web.Response:
        rid = anthropic.new_message_id()
        try:
            ext = anthropic.extensions_from_headers(request.headers, identity_of(request))
            chat = anthropic.parse_count_tokens(await self._read_json(request), ext, rid)
            chat, _ = await self._model(chat)
            n = await count_tokens(self._backend(), chat.generate, self._timeout_s)
        except errors.KvmeshError as exc:
            return error_response(exc, rid)
        return web.Response(
            body=_encode({"input_tokens": n}),
            content_type="application/json",
            headers={"request-id": rid},
        )

    async def messages(self, request: web.Request) -> web.StreamResponse:
        rid = anthropic.new_message_id()
        try:
            ext = anthropic.extensions_from_headers(request.headers, identity_of(request))
            parsed = anthropic.parse_messages(await self._read_json(request), ext, rid)
            chat, block_size = await self._model(parsed.chat)
            parsed = replace(parsed, chat=chat)
        except errors.KvmeshError as exc:
            return error_response(exc, rid)
        stream = self._backend().generate(parsed.chat.generate, self._timeout_s)
        async with contextlib.aclosing(stream):
            try:  # errors before the first message get their own HTTP status, streaming or not
                first = await first_message(stream)
            except errors.KvmeshError as exc:
                return error_response(parsing.router_error(exc, parsed.chat), rid)
            if parsed.stream:
                events = EventStream(parsed, block_size)
                return await self._stream(request, events, first, stream)
            return await self._collect(MessageCollector(parsed, block_size), first, stream)

    async def _collect(
        self, out: MessageCollector, msg: Any, stream: AsyncIterator[Any]
    ) -> web.Response:
        rid = out.request.id
        try:
            while True:
                out.feed(msg)
                if out.finished:
                    break
                msg = await anext(stream)
            body = out.message()
        except errors.KvmeshError as exc:
            return error_response(exc, rid)
        except StopAsyncIteration:
            return error_response(errors.Unavailable("the router ended the stream early"), rid)
        headers = rendering.response_headers(rid, out.usage)
        headers["request-id"] = rid
        return web.Response(body=_encode(body), content_type="application/json", headers=headers)

    async def _stream(
        self, request: web.Request, out: EventStream, msg: Any, stream: AsyncIterator[Any]
    ) -> web.StreamResponse:
        """Anthropic's server-sent events (``event: <type>`` then ``data: {...}``). An error
        after the headers is an ``error`` event, which the SDKs raise. A client that goes away
        makes a write fail, which closes ``stream`` and cancels the router call."""
        rid = out.request.id
        resp = await open_event_stream(request, rid, {"request-id": rid})
        try:
            for event, data in out.start():
                await resp.write(sse_event(event, _encode(data)))
            while True:
                for event, data in out.feed(msg):
                    await resp.write(sse_event(event, _encode(data)))
                if out.finished:
                    break
                msg = await anext(stream)
        except (errors.KvmeshError, StopAsyncIteration) as exc:
            if isinstance(exc, StopAsyncIteration):
                exc = errors.Unavailable("the router ended the stream early")
            await resp.write(sse_event("error", _encode(anthropic.error_body(exc, rid)[1])))
        except ConnectionResetError:
            log.info("client of %s went away mid-stream; cancelling", rid)
            raise
        await resp.write_eof()
        return resp


def _http_error(exc: web.HTTPException, request: web.Request, max_body_bytes: int) -> Exception:
    """aiohttp's own error as the domain error the error table knows."""
    if isinstance(exc, web.HTTPRequestEntityTooLarge):
        return PayloadTooLarge(f"the request body exceeds {max_body_bytes} bytes")
    if isinstance(exc, web.HTTPNotFound):
        return UnknownRoute(f"no endpoint {request.method} {request.path}")
    if isinstance(exc, web.HTTPMethodNotAllowed):
        return MethodNotAllowed(f"{request.method} is not allowed on {request.path}")
    return BadRequest(exc.reason)


async def guard(
    request: web.Request,
    handler: Callable[[web.Request], Awaitable[web.StreamResponse]],
    max_body_bytes: int,
) -> web.StreamResponse:
    """The server's errors middleware on a Messages path: aiohttp's errors (wrong method, body
    too large) in Anthropic's shape, anything unexpected a 500 ``api_error`` naming a request
    id (the trace in the log)."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return error_response(_http_error(exc, request, max_body_bytes))
    except Exception as exc:
        rid = uuid.uuid4().hex
        log.exception("internal error request_id=%s on %s", rid, request.path)
        return error_response(exc, rid)
