"""The aiohttp edge of the OpenAI front door: routes, body limits, SSE framing, disconnects.
Translation lives in ``parsing`` and ``rendering``, the router call in ``backend``."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Iterable, Mapping
from typing import Any, Protocol

import msgspec
from aiohttp import web
from aiohttp.typedefs import Middleware
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder

from kvmesh import __version__, errors
from kvmesh.tls import Tls

from ..core.auth import KeyTable, static_table
from ..state import ResponseStore
from . import anthropic_http, choices, extensions, parsing, rendering, responses_http
from .auth import api_key_middleware, identity_of
from .backend import GrpcRouterBackend, RouterBackend, first_message
from .cors import CorsPolicy
from .errors import (
    BadRequest,
    MethodNotAllowed,
    PayloadTooLarge,
    UnknownRoute,
    error_body,
    retry_after_headers,
)
from .fanout import FanOut
from .sse import open_event_stream

log = logging.getLogger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
Parser = Callable[[object, extensions.Extensions, str, int], parsing.ParsedRequest]
# One choice's translator and its router stream, or several choices' (choices, fanout).
Translator = rendering.ResponseTranslator | choices.Choices

CLIENT_CLOSED = 499  # the status code nginx logs for a client that left before the response


class HttpMetrics(Protocol):
    """Where the server counts requests (``services.router.metrics.RouterMetrics``)."""

    def http_ended(self, endpoint: str, code: int) -> None: ...


def endpoint_of(request: web.Request) -> str:
    """The matched route's template (``/v1/models/{model}``: bounded label values), or
    ``other`` for a path no route serves."""
    route = request.match_info.route
    resource = route.resource if route is not None else None
    return resource.canonical if resource is not None else "other"


# msgspec's JSON: compact UTF-8 as vLLM's own server writes it, ~12x json.dumps on a stream
# chunk (0.5 vs 6.3 us here: once per token) and 2x json.loads on a 195K-token request body,
# which is parsed on the event loop. Non-finite floats are written as null (logprobs are
# clamped to -9999.0 before, as OpenAI and vLLM do).
_encode = msgspec.json.Encoder().encode
_decode = msgspec.json.Decoder().decode


def _json_response(
    status: int, body: dict[str, Any], headers: Mapping[str, str] | None = None
) -> web.Response:
    return web.Response(
        status=status,
        body=_encode(body),
        content_type="application/json",
        headers=headers,
    )


def _refusal(exc: BaseException, request: web.Request) -> web.Response:
    """An API key refused, in the error shape of the API the path belongs to."""
    if anthropic_http.is_anthropic_path(request.path):
        return anthropic_http.error_response(exc)
    return error_response(exc)


def error_response(exc: BaseException, request_id: str = "") -> web.Response:
    status, body = error_body(exc, request_id)
    if status >= 500:
        log.warning("request %s failed: %s: %s", request_id, type(exc).__name__, exc)
    headers = retry_after_headers(exc)
    if request_id:
        headers["x-request-id"] = request_id
    return _json_response(status, body, headers or None)


def sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + _encode(payload) + b"\n\n"


class OpenAIServer:
    """OpenAI-compatible HTTP (``/v1/chat/completions``, ``/v1/completions``, ``/v1/models``;
    Anthropic's ``/v1/messages``; with a ``responses_store``, ``/v1/responses``) in front of
    the router's gRPC API at ``router_address``, served on ``host:port`` (0: a free
    port, see ``port`` after ``start``). Runs on the caller's asyncio loop.

    ``keys``: the API key table in force (``core.auth``; docs/tenants.md), checked per request
    by ``auth.api_key_middleware``; ``api_keys``: a fixed one, as key -> tenant or just keys
    (tenant derived from the key); neither: open, any key or none. ``default_max_tokens``
    applies when a request sets neither max_tokens nor max_completion_tokens. ``backend`` replaces the gRPC channel
    (an in-process router, a fake in tests). ``metrics``, if given, counts every request by
    endpoint and HTTP status.

    Beside the API, as vLLM's server: ``cors`` (``cors.CorsPolicy``; default: no origin
    allowed, no CORS headers), ``GET /metrics`` serving ``metrics_registry`` (the router's own
    registry, the one its metrics port serves; absent: 404), ``GET /health`` (200 while the
    router can serve: ``unready()`` says nothing and a worker serves; else 503 saying why) and
    ``GET /version`` (kvmesh's version and the vLLM versions ``vllm_versions()`` names)."""

    def __init__(
        self,
        router_address: str = "",
        host: str = "127.0.0.1",
        port: int = 8000,
        *,
        api_keys: Mapping[str, str] | Iterable[str] | None = None,
        keys: Callable[[], KeyTable] | None = None,
        max_body_bytes: int = 8 << 20,
        request_timeout_s: float = 600.0,
        models_timeout_s: float = 10.0,
        default_max_tokens: int = 512,
        backend: RouterBackend | None = None,
        metrics: HttpMetrics | None = None,
        reuse_port: bool = False,
        cors: CorsPolicy | None = None,
        metrics_registry: CollectorRegistry | None = None,
        unready: Callable[[], str] | None = None,
        vllm_versions: Callable[[], Iterable[str]] | None = None,
        ssl_context: ssl.SSLContext | None = None,
        router_tls: Tls | None = None,
        responses_store: ResponseStore | None = None,
    ) -> None:
        """``ssl_context``: serve HTTPS with it (``kvmesh.tls.Tls.server_ssl_context``, the
        router's certificate); None: plain HTTP. ``router_tls``: the TLS of the channel to
        ``router_address`` (``kvmesh/tls.py``). ``responses_store``: serve the Responses API
        (``/v1/responses``) with its state there (``services/router/state``; the caller closes
        it); None: not served."""
        if backend is None and not router_address:
            raise ValueError("OpenAIServer needs router_address or backend")
        self.router_address = router_address
        self.host = host
        self._port = port
        if api_keys is not None:
            if keys is not None:
                raise ValueError("OpenAIServer takes api_keys or keys, not both")
            table = static_table(api_keys)
            keys = lambda: table  # noqa: E731
        self._keys = keys
        self._max_body_bytes = max_body_bytes
        self._timeout_s = request_timeout_s
        self._models_timeout_s = models_timeout_s
        self._default_max_tokens = default_max_tokens
        self._backend = backend
        self._own_backend = backend is None
        self._metrics = metrics
        self._reuse_port = reuse_port  # several router processes share the port
        self._cors = cors or CorsPolicy()
        self._registry = metrics_registry
        self._unready = unready  # why the router cannot take requests now ("": it can)
        self._vllm_versions = vllm_versions
        self._ssl = ssl_context
        self._router_tls = router_tls
        self._responses_store = responses_store
        self._runner: web.AppRunner | None = None
        self._created = int(time.time())

    # ---- lifecycle ----------------------------------------------------------------------------
    def app(self) -> web.Application:
        middlewares: list[Middleware] = [self._cors_middleware, self._errors_middleware]
        if self._keys is not None:  # inside the errors one: its own answers are error JSON
            middlewares.append(api_key_middleware(self._keys, _refusal))
        if self._metrics is not None:  # outermost: it sees the status the errors one set
            middlewares.insert(0, self._metrics_middleware)
        app = web.Application(client_max_size=self._max_body_bytes, middlewares=middlewares)
        if self._cors.enabled:  # before the headers go: streamed responses get them too
            app.on_response_prepare.append(self._cors_headers)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/v1/models/{model}", self._model)
        anthropic_http.AnthropicEndpoints(
            lambda: self.backend,
            self._read_json,
            timeout_s=self._timeout_s,
            models_timeout_s=self._models_timeout_s,
        ).add_routes(app)  # POST /v1/messages, /v1/messages/count_tokens
        if self._responses_store is not None:  # POST /v1/responses, GET and DELETE its {id}
            responses_http.ResponsesEndpoints(
                lambda: self.backend,
                self._responses_store,
                self._read_json,
                timeout_s=self._timeout_s,
                models_timeout_s=self._models_timeout_s,
                default_max_tokens=self._default_max_tokens,
            ).add_routes(app)
        app.router.add_get("/health", self._health)
        app.router.add_get("/version", self._version)
        if self._registry is not None:
            app.router.add_get("/metrics", self._metrics_text)
        return app

    async def start(self) -> None:
        if self._backend is None:
            self._backend = GrpcRouterBackend(self.router_address, self._router_tls)
        # handler_cancellation: a client that disconnects cancels its handler, which cancels
        # the router call (and so the engine request) even before the first byte is written.
        self._runner = web.AppRunner(self.app(), handler_cancellation=True, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(
            self._runner,
            self.host,
            self._port,
            reuse_port=self._reuse_port or None,
            ssl_context=self._ssl,
        )
        await site.start()
        self._port = self._runner.addresses[0][1]  # the bound port, when 0 asked the OS
        log.info("OpenAI-compatible HTTP on %s", self.base_url)

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        if self._backend is not None and self._own_backend:
            await self._backend.close()
            self._backend = None

    @property
    def port(self) -> int:
        return self._port

    @property
    def base_url(self) -> str:
        """What an OpenAI client takes as ``base_url``."""
        scheme = "https" if self._ssl is not None else "http"
        return f"{scheme}://{self.host}:{self._port}/v1"

    @property
    def backend(self) -> RouterBackend:
        if self._backend is None:
            raise RuntimeError("OpenAIServer is not started")
        return self._backend

    # ---- metrics and errors -------------------------------------------------------------------
    @web.middleware
    async def _metrics_middleware(
        self, request: web.Request, handler: Handler
    ) -> web.StreamResponse:
        assert self._metrics is not None
        code = 500
        try:
            resp = await handler(request)
            code = resp.status
            return resp
        except asyncio.CancelledError:
            code = CLIENT_CLOSED  # handler_cancellation: the client disconnected
            raise
        except web.HTTPException as exc:  # below 400 only: the errors middleware maps the rest
            code = exc.status
            raise
        finally:
            self._metrics.http_ended(endpoint_of(request), code)

    @web.middleware
    async def _cors_middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """Answers CORS preflights itself (no route serves OPTIONS)."""
        if not CorsPolicy.is_preflight(request.method, request.headers):
            return await handler(request)
        origin = request.headers["Origin"]
        status, headers = self._cors.preflight(
            origin,
            request.headers["Access-Control-Request-Method"],
            request.headers.get("Access-Control-Request-Headers", ""),
        )
        if status != 200:
            resp = error_response(
                BadRequest(f"CORS preflight refused: origin {origin!r} is not allowed here")
            )
            resp.headers.update(headers)
            return resp
        return web.Response(status=status, headers=headers)

    async def _cors_headers(self, request: web.Request, resp: web.StreamResponse) -> None:
        for name, value in self._cors.simple(request.headers.get("Origin")).items():
            resp.headers.setdefault(name, value)

    @web.middleware
    async def _errors_middleware(
        self, request: web.Request, handler: Handler
    ) -> web.StreamResponse:
        """aiohttp's own errors (unknown path, wrong method, body too large, ...) in the OpenAI
        shape (Anthropic's on its paths); anything unexpected as a 500 with a request id and the
        trace in the log."""
        if anthropic_http.is_anthropic_path(request.path):
            return await anthropic_http.guard(request, handler, self._max_body_bytes)
        try:
            return await handler(request)
        except web.HTTPRequestEntityTooLarge:
            return error_response(
                PayloadTooLarge(f"the request body exceeds {self._max_body_bytes} bytes")
            )
        except web.HTTPNotFound:
            return error_response(UnknownRoute(f"no endpoint {request.method} {request.path}"))
        except web.HTTPMethodNotAllowed:
            return error_response(
                MethodNotAllowed(f"{request.method} is not allowed on {request.path}")
            )
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            body = error_body(BadRequest(exc.reason))[1]
            return _json_response(exc.status, body)
        except Exception as exc:
            rid = uuid.uuid4().hex
            log.exception("internal error request_id=%s on %s", rid, request.path)
            return error_response(exc, rid)

    # ---- endpoints ----------------------------------------------------------------------------
    async def _health(self, request: web.Request) -> web.Response:
        """200 while this router can serve a request: started (etcd and the KV index synced),
        not draining and at least one serving worker (vLLM's /health: 200 while its engine can
        serve, 503 once it cannot). A readiness probe, not a liveness one: a router without
        workers is alive."""
        if self._unready is not None and (reason := self._unready()):
            return error_response(errors.Unavailable(reason))
        try:
            resp = await self.backend.list_models(self._models_timeout_s)
        except errors.KvmeshError as exc:
            return error_response(errors.Unavailable(f"the router cannot serve: {exc}"))
        workers = sum(m.workers for m in resp.models)
        if not workers:
            return error_response(
                errors.Unavailable("no worker is registered and serving; nothing can be served")
            )
        return _json_response(200, {"status": "ok", "models": len(resp.models), "workers": workers})

    async def _version(self, request: web.Request) -> web.Response:
        """vLLM's /version says ``{"version": ...}``: here kvmesh's, with the vLLM versions
        of the serving workers (none known: empty)."""
        versions = sorted(set(self._vllm_versions())) if self._vllm_versions else []
        return _json_response(200, {"version": __version__, "vllm_versions": versions})

    async def _metrics_text(self, request: web.Request) -> web.Response:
        """The router's registry, rendered off the event loop in the format the scraper's
        Accept asks (Prometheus text, or OpenMetrics), as the metrics port serves it."""
        assert self._registry is not None
        encoder, content_type = choose_encoder(request.headers.get("Accept", ""))
        body = await asyncio.to_thread(encoder, self._registry)
        return web.Response(body=body, headers={"Content-Type": content_type})

    async def _models(self, request: web.Request) -> web.Response:
        try:
            resp = await self.backend.list_models(self._models_timeout_s)
        except errors.KvmeshError as exc:
            return error_response(exc)
        return _json_response(200, rendering.models_json(resp, self._created))

    async def _model(self, request: web.Request) -> web.Response:
        name = request.match_info["model"]
        try:
            resp = await self.backend.list_models(self._models_timeout_s)
            found = next((m for m in resp.models if m.name == name), None)
            if found is None:
                raise errors.NotFound(f"model {name!r} is not served")
        except errors.KvmeshError as exc:
            return error_response(exc)
        return _json_response(200, rendering.model_json(found, self._created))

    async def _only_model(self) -> str:
        """The model served when it is the only one; empty otherwise (the router then says
        that several are served, or none)."""
        models = (await self.backend.list_models(self._models_timeout_s)).models
        return models[0].name if len(models) == 1 else ""

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, parsing.parse_chat, "chatcmpl-")

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, parsing.parse_completion, "cmpl-")

    async def _read_json(self, request: web.Request) -> object:
        if request.content_length is not None and request.content_length > self._max_body_bytes:
            raise PayloadTooLarge(
                f"the request body has {request.content_length} bytes; the limit is "
                f"{self._max_body_bytes}"
            )
        try:
            raw = await request.read()
        except web.HTTPRequestEntityTooLarge:
            raise PayloadTooLarge(
                f"the request body exceeds {self._max_body_bytes} bytes"
            ) from None
        try:
            return _decode(raw)
        except msgspec.DecodeError as exc:
            raise BadRequest(f"the request body is not valid JSON: {exc}") from None

    async def _generate(
        self, request: web.Request, parse: Parser, prefix: str
    ) -> web.StreamResponse:
        rid = prefix + uuid.uuid4().hex
        try:
            ext = extensions.extensions_from_headers(request.headers, identity_of(request))
            body = await self._read_json(request)
            parsed = parse(body, ext, rid, self._default_max_tokens)
            if not parsed.model:  # answered with the served name, as vLLM does
                parsed = parsing.with_model(parsed, await self._only_model())
        except errors.KvmeshError as exc:
            return error_response(exc, rid)
        out: Translator
        stream: AsyncGenerator[Any, None] | FanOut
        if choices.count(parsed) > 1:  # n > 1 or several prompts: a router request per choice
            subs = choices.plan(parsed)
            out = choices.Choices(parsed, subs, int(time.time()))
            stream = FanOut(self.backend, subs, self._timeout_s)
        else:
            out = rendering.ResponseTranslator(parsed, int(time.time()))
            stream = self.backend.generate(parsed.generate, self._timeout_s)
        async with contextlib.aclosing(stream):
            try:  # errors before the first message get their own HTTP status, streaming or not
                first = await first_message(stream)
            except errors.KvmeshError as exc:
                return error_response(parsing.router_error(exc, parsed), rid)
            if parsed.stream:
                return await self._stream(request, out, first, stream)
            return await self._collect(out, first, stream)

    async def _collect(
        self,
        out: Translator,
        msg: Any,
        stream: AsyncIterator[Any],
    ) -> web.Response:
        rid = out.request.id
        try:
            while True:
                out.feed(msg)
                if out.finished:
                    break
                msg = await anext(stream)
        except errors.KvmeshError as exc:
            return error_response(exc, rid)
        except StopAsyncIteration:
            return error_response(errors.Unavailable("the router ended the stream early"), rid)
        return _json_response(200, out.response(), rendering.response_headers(rid, out.usage))

    async def _stream(
        self,
        request: web.Request,
        out: Translator,
        msg: Any,
        stream: AsyncIterator[Any],
    ) -> web.StreamResponse:
        """Server-sent events: one ``data: {chunk}`` per payload, ``data: [DONE]`` at the end.
        The worker is known only at the end, so it travels in the last chunk's ``kvmesh``
        object, not in headers. A client that goes away makes a write (or the handler) fail,
        which closes ``stream`` and cancels the router call."""
        rid = out.request.id
        resp = await open_event_stream(request, rid)
        try:
            while True:
                for payload in out.feed(msg):
                    await resp.write(sse(payload))
                if out.finished:
                    break
                msg = await anext(stream)
        except errors.KvmeshError as exc:
            # Headers are gone; the OpenAI clients raise on an SSE event holding "error".
            await resp.write(sse(error_body(exc, rid)[1]))
        except StopAsyncIteration:
            body = error_body(errors.Unavailable("the router ended the stream early"))[1]
            await resp.write(sse(body))
        except ConnectionResetError:
            log.info("client of %s went away mid-stream; cancelling", rid)
            raise
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp
