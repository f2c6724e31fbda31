"""Domain errors -> HTTP status and the OpenAI error shape. Pure.

The HTTP column of the one error table: ``kvmesh.grpc_errors`` maps the same domain errors to
gRPC codes (and back), so a status from the router becomes a domain error first and an HTTP
answer here."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvmesh import errors


class BadRequest(errors.InvalidArgument):
    """An OpenAI request field is malformed; ``param`` names it (OpenAI's ``error.param``)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class Unauthorized(errors.Unauthenticated):
    """The API key is missing or not one of the configured keys."""


class PayloadTooLarge(errors.KvmeshError):
    """The request body is larger than the server accepts."""


class UnknownRoute(errors.NotFound):
    """No endpoint at this path."""


class MethodNotAllowed(errors.InvalidArgument):
    """The path exists but not for this HTTP method."""


class ResponseNotFound(errors.NotFound):
    """No stored response by that id (never stored, expired, deleted, or another tenant's);
    ``param`` and ``openai_code`` as OpenAI answers them."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.openai_code = code


@dataclass(frozen=True, slots=True)
class HttpStatus:
    status: int
    type: str  # OpenAI error.type
    code: str | None  # OpenAI error.code


# Looked up along the exception's MRO, most specific class first.
HTTP_OF: dict[type[BaseException], HttpStatus] = {
    MethodNotAllowed: HttpStatus(405, "invalid_request_error", "method_not_allowed"),
    UnknownRoute: HttpStatus(404, "invalid_request_error", "unknown_url"),
    ResponseNotFound: HttpStatus(404, "invalid_request_error", None),
    BadRequest: HttpStatus(400, "invalid_request_error", None),
    errors.Unauthenticated: HttpStatus(401, "invalid_request_error", "invalid_api_key"),
    errors.PermissionDenied: HttpStatus(403, "invalid_request_error", "permission_denied"),
    PayloadTooLarge: HttpStatus(413, "invalid_request_error", "request_too_large"),
    errors.InvalidArgument: HttpStatus(400, "invalid_request_error", None),
    errors.NotFound: HttpStatus(404, "invalid_request_error", "model_not_found"),
    errors.ResourceExhausted: HttpStatus(429, "rate_limit_error", "rate_limit_exceeded"),
    errors.Unavailable: HttpStatus(503, "server_error", "service_unavailable"),
    errors.DeadlineExceeded: HttpStatus(504, "server_error", "timeout"),
}
INTERNAL = HttpStatus(500, "server_error", "internal_error")


def http_status_for(exc: BaseException) -> HttpStatus:
    for cls in type(exc).__mro__:
        if cls in HTTP_OF:
            return HTTP_OF[cls]
    return INTERNAL


def error_body(exc: BaseException, request_id: str = "") -> tuple[int, dict[str, Any]]:
    """(HTTP status, ``{"error": {...}}``). Unexpected errors say only "internal error" and the
    request id; their trace belongs in the log, not on the wire."""
    st = http_status_for(exc)
    if st is INTERNAL:
        message = f"internal error (request_id={request_id}); see the router log"
    else:
        message = str(exc)
    param = getattr(exc, "param", None)
    code = getattr(exc, "openai_code", None) or st.code
    return st.status, {"error": {"message": message, "type": st.type, "param": param, "code": code}}


def retry_after_headers(exc: BaseException) -> dict[str, str]:
    """``Retry-After`` (whole seconds) and ``retry-after-ms`` (which the OpenAI SDKs read
    first) of a refusal that says when to come back (flow control's 429, a 503); else none."""
    seconds = errors.retry_after_of(exc)
    if seconds is None:
        return {}
    exact = getattr(exc, "retry_after_s", seconds)
    return {"Retry-After": str(seconds), "retry-after-ms": str(max(round(exact * 1000), 1))}
