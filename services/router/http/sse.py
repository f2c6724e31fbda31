"""The opening of a server-sent-events answer, shared by the OpenAI, Anthropic and Responses
front doors (each writes its own events into it)."""

from __future__ import annotations

from collections.abc import Mapping

from aiohttp import web


async def open_event_stream(
    request: web.Request, request_id: str, headers: Mapping[str, str] | None = None
) -> web.StreamResponse:
    """A 200 ``text/event-stream`` answer to ``request``, uncached, naming ``request_id`` in
    ``x-request-id`` (and ``headers`` besides), its headers already sent."""
    resp = web.StreamResponse(
        status=200,
        headers={
            "Content-Type": "text/event-stream",
            "Cache-Control": "no-cache",
            "x-request-id": request_id,
            **(headers or {}),
        },
    )
    await resp.prepare(request)
    return resp
