"""The aiohttp edge of the OpenAI Responses API: ``POST /v1/responses`` (SSE events or one
Response), ``GET`` and ``DELETE /v1/responses/{id}``, on the OpenAI front door's server, its
router backend and a response store (``services/router/state``). Translation lives in
``responses`` and ``responses_stream``.

A turn's prompt is made here, not by the router's chat path: the backend renders the chat
request to token ids, extending the previous turn's stored ids exactly when it can
(``backend.PromptRenderer``), and the router gets the ids (and a forced tool choice's
constraint, which the chat path would add). So the output's ids and the prompt's are both
known, and stored."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import replace
from typing import Any

import msgspec
from aiohttp import web

from kvmesh import errors
from kvmesh.v1 import router_pb2

from ..continuation import Prior
from ..prepare import constrained_sampling, forced_choice
from ..state import ResponseStore
from . import extensions, parsing, rendering, responses
from .anthropic_stream import sse_event
from .auth import identity_of
from .backend import PromptRenderer, RouterBackend, first_message, served_model_info
from .errors import error_body, retry_after_headers
from .responses import ResponsesRequest
from .responses_stream import ResponseCollector, ResponseEvents
from .sse import open_event_stream

log = logging.getLogger(__name__)

RESPONSES_PATH = "/v1/responses"

_encode = msgspec.json.Encoder().encode


def error_response(exc: BaseException, request_id: str = "") -> web.Response:
    status, body = error_body(exc, request_id)
    if status >= 500:
        log.warning("request %s failed: %s: %s", request_id, type(exc).__name__, exc)
    headers = retry_after_headers(exc)
    if request_id:
        headers["x-request-id"] = request_id
    return web.Response(
        status=status, body=_encode(body), content_type="application/json", headers=headers
    )


def token_request(chat: parsing.ParsedRequest, ids: list[int]) -> router_pb2.GenerateRequest:
    """``chat``'s request with the rendered prompt ``ids`` as its input, and a forced tool
    choice's constraint (the calls' JSON schema) in its sampling, as the router adds it to a
    chat request."""
    out = router_pb2.GenerateRequest()
    out.CopyFrom(chat.generate)
    out.sampling.CopyFrom(constrained_sampling(chat.generate, forced_choice(chat.generate)))
    out.token_ids.ids[:] = ids  # the input oneof: the chat messages go
    return out


class ResponsesEndpoints:
    """The Responses API handlers. ``backend`` gives the router backend (once the server has
    started), ``store`` the response store; ``read_json`` reads a body within the server's size
    limit (raising domain errors)."""

    def __init__(
        self,
        backend: Callable[[], RouterBackend],
        store: ResponseStore,
        read_json: Callable[[web.Request], Awaitable[object]],
        *,
        timeout_s: float,
        models_timeout_s: float,
        default_max_tokens: int,
    ) -> None:
        self._backend = backend
        self._store = store
        self._read_json = read_json
        self._timeout_s = timeout_s
        self._models_timeout_s = models_timeout_s
        self._default_max_tokens = default_max_tokens

    def add_routes(self, app: web.Application) -> None:
        app.router.add_post(RESPONSES_PATH, self.create)
        app.router.add_get(RESPONSES_PATH + "/{response_id}", self.retrieve)
        app.router.add_delete(RESPONSES_PATH + "/{response_id}", self.delete)

    # ---- GET, DELETE -------------------------------------------------------------------------
    async def _visible(self, request: web.Request) -> responses.StoredResponse:
        ext = extensions.extensions_from_headers(request.headers, identity_of(request))
        response_id = request.match_info["response_id"]
        found = responses.visible(await self._store.get(response_id), ext.tenant)
        if found is None:
            raise responses.not_found(response_id)
        return found

    async def retrieve(self, request: web.Request) -> web.Response:
        try:
            found = await self._visible(request)
        except errors.KvmeshError as exc:
            return error_response(exc)
        return web.Response(body=_encode(found.response), content_type="application/json")

    async def delete(self, request: web.Request) -> web.Response:
        try:
            found = await self._visible(request)
            if not await self._store.delete(found.id):
                raise responses.not_found(found.id)
        except errors.KvmeshError as exc:
            return error_response(exc)
        return web.Response(
            body=_encode(responses.deleted_json(found.id)), content_type="application/json"
        )

    # ---- POST --------------------------------------------------------------------------------
    async def _model(
        self, chat: parsing.ParsedRequest
    ) -> tuple[parsing.ParsedRequest, router_pb2.ModelInfo | None]:
        return await served_model_info(self._backend(), chat, self._models_timeout_s)

    async def _turn(
        self, request: web.Request, rid: str
    ) -> tuple[ResponsesRequest, list[int], bool, int]:
        """The turn, its prompt ids, whether they extend the previous turn's, the block size."""
        ext = extensions.extensions_from_headers(request.headers, identity_of(request))
        turn = responses.parse_input(await self._read_json(request))
        previous = None
        if turn.previous_response_id is not None:
            found = await self._store.get(turn.previous_response_id)
            previous = responses.visible(found, ext.tenant)
            if previous is None:
                raise responses.previous_not_found(turn.previous_response_id)
        parsed = responses.build(turn, previous, ext, rid, self._default_max_tokens)
        chat, model = await self._model(parsed.chat)
        block_size = model.block_size if model is not None else 0
        parsed = replace(parsed, chat=chat)
        backend = self._backend()
        if not isinstance(backend, PromptRenderer):
            raise errors.Unavailable(
                "the Responses API needs the router's own HTTP front door (kvmesh router "
                "--http-port), which renders prompts; this one reaches its router over gRPC"
            )
        prior = None
        if parsed.extends and previous is not None:
            prior = Prior(previous.prompt_ids, previous.output_ids)
        try:
            ids, extended = await backend.render_prompt(
                parsed.chat.generate, prior, parsed.new_from
            )
        except errors.KvmeshError as exc:
            raise responses.bad_request(exc, parsed) from None
        if model is not None and turn.body.get("max_output_tokens") is None:
            # As OpenAI's: no max_output_tokens, the answer may run to the context's end (an
            # agent's code edit is often longer than the router's chat default).
            room = responses.output_room(model.max_model_len, len(ids))
            if room:
                parsed.chat.generate.sampling.max_tokens = room
        return parsed, ids, extended, block_size

    async def create(self, request: web.Request) -> web.StreamResponse:
        rid = responses.new_response_id()
        try:
            parsed, ids, extended, block_size = await self._turn(request, rid)
        except errors.KvmeshError as exc:
            return error_response(exc, rid)
        created_at = int(time.time())
        stream = self._backend().generate(token_request(parsed.chat, ids), self._timeout_s)
        async with contextlib.aclosing(stream):
            try:  # errors before the first message get their own HTTP status, streaming or not
                first = await first_message(stream)
            except errors.KvmeshError as exc:
                return error_response(responses.bad_request(exc, parsed), rid)
            if parsed.stream:
                events = ResponseEvents(parsed, created_at, block_size, extended)
                return await self._stream(request, events, ids, first, stream)
            out = ResponseCollector(parsed, created_at, block_size, extended)
            return await self._collect(out, ids, first, stream)

    async def _save(self, out: ResponseCollector | ResponseEvents, prompt_ids: list[int]) -> None:
        if not out.request.input.store:
            return
        assert out.final is not None
        record = responses.record(out.request, out.final, time.time(), prompt_ids, out.output_ids)
        await self._store.put(record)

    async def _collect(
        self, out: ResponseCollector, ids: list[int], msg: Any, stream: AsyncIterator[Any]
    ) -> web.Response:
        rid = out.request.id
        try:
            while True:
                out.feed(msg)
                if out.finished:
                    break
                msg = await anext(stream)
            body = out.response()
            await self._save(out, ids)
        except errors.KvmeshError as exc:
            return error_response(exc, rid)
        except StopAsyncIteration:
            return error_response(errors.Unavailable("the router ended the stream early"), rid)
        return web.Response(
            body=_encode(body),
            content_type="application/json",
            headers=rendering.response_headers(rid, out.usage),
        )

    async def _stream(
        self,
        request: web.Request,
        out: ResponseEvents,
        ids: list[int],
        msg: Any,
        stream: AsyncIterator[Any],
    ) -> web.StreamResponse:
        """Server-sent events (``event: <type>`` then ``data: {...}``). The response is stored
        before its ``response.completed`` goes out, so a client chaining at once finds it. An
        error after the headers is an ``error`` event."""
        rid = out.request.id
        resp = await open_event_stream(request, rid)
        try:
            for event, data in out.start():
                await resp.write(sse_event(event, _encode(data)))
            while True:
                events = out.feed(msg)
                if out.finished:
                    await self._save(out, ids)
                for event, data in events:
                    await resp.write(sse_event(event, _encode(data)))
                if out.finished:
                    break
                msg = await anext(stream)
        except (errors.KvmeshError, StopAsyncIteration) as exc:
            if isinstance(exc, StopAsyncIteration):
                exc = errors.Unavailable("the router ended the stream early")
            event, data = out.error(error_body(exc, rid)[1])
            await resp.write(sse_event(event, _encode(data)))
        except ConnectionResetError:
            log.info("client of %s went away mid-stream; cancelling", rid)
            raise
        await resp.write_eof()
        return resp
