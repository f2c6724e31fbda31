"""API keys on the HTTP front door: an aiohttp middleware. The key comes as
``Authorization: Bearer <key>`` (OpenAI clients' ``api_key=``), ``x-api-key`` (Anthropic-style
clients) or ``api-key`` (Azure-style); ``core.auth.authorize`` decides with the
``x-kvmesh-tenant`` / ``x-kvmesh-priority`` headers as the claims, and the handlers read the
``Identity`` it stored on the request (``identity_of``).

Open without a key: ``/health``, ``/version`` and ``/metrics`` (probes and scrapers), CORS
preflights (answered before this middleware), and paths no route serves (404/405 as before).
Everything else, ``/v1/models`` included (as OpenAI's), needs a key."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

from aiohttp import web
from aiohttp.typedefs import Middleware

from kvmesh import errors

from ..core.auth import Identity, KeyTable, authorize
from .extensions import api_key_of, claims_of

log = logging.getLogger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
KeySource = Callable[[], KeyTable]
# The refusal in the error shape of the API the request's path belongs to.
ErrorResponse = Callable[[BaseException, web.Request], web.StreamResponse]

PUBLIC_PATHS = frozenset({"/health", "/version", "/metrics"})
_IDENTITY = web.RequestKey("kvmesh.identity", Identity)


def identity_of(request: web.Request) -> Identity | None:
    """The caller the middleware authenticated; None on an open router."""
    identity = request.get(_IDENTITY)
    return identity if isinstance(identity, Identity) else None


def authenticate(request: web.Request, keys: KeySource) -> Identity:
    """The caller of ``request``; ``Unauthenticated`` / ``PermissionDenied`` / ``BadRequest``."""
    headers = request.headers
    return authorize(keys(), api_key_of(headers), claims_of(headers))


def api_key_middleware(keys: KeySource, error_response: ErrorResponse) -> Middleware:
    """The middleware: authenticated requests go on with their ``Identity``; the others get
    401 (with ``WWW-Authenticate: Bearer``) or 403 in the error shape of the path's API
    (OpenAI's, or Anthropic's under /v1/messages)."""

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path in PUBLIC_PATHS or request.match_info.http_exception is not None:
            return await handler(request)
        try:
            request[_IDENTITY] = authenticate(request, keys)
        except errors.KvmeshError as exc:
            log.info("HTTP %s %s refused: %s", request.method, request.path, exc)
            resp = error_response(exc, request)
            if isinstance(exc, errors.Unauthenticated):
                resp.headers["WWW-Authenticate"] = 'Bearer realm="kvmesh"'
            return resp
        return await handler(request)

    return middleware
