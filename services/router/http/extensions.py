"""What the kvmesh request headers (session, tenant, priority) and the API key say about an
OpenAI or Anthropic request. Pure: the handlers pass the headers in (lower-case names)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from ..core.auth import Claims, Identity, tenant_of_key
from .errors import BadRequest

SESSION_HEADER = "x-kvmesh-session-id"
TENANT_HEADER = "x-kvmesh-tenant"
PRIORITY_HEADER = "x-kvmesh-priority"
SESSION_END_HEADER = "x-kvmesh-session-end"  # true: the session ends with this turn
_TRUE, _FALSE = ("1", "true", "yes"), ("", "0", "false", "no")


@dataclass(frozen=True, slots=True)
class Extensions:
    """What the kvmesh request headers (and the API key) say about a request."""

    session_id: str = ""
    tenant: str = ""
    priority: int = 0
    # The caller's tenant's cache salt on a router with API keys (then the body's cache_salt
    # is ignored); None: an open router, where the body's (vLLM's field) is used.
    cache_salt: str | None = None
    session_end: bool = False  # release the session's retention after this turn
    # How long to retain the session after this turn, seconds (Anthropic's cache_control ttl);
    # 0: the router's default.
    retention_ttl_s: float = 0.0


def api_key_of(headers: Mapping[str, str]) -> str:
    """``Authorization: Bearer <key>``, else ``x-api-key`` (Anthropic-style clients), else
    ``api-key`` (Azure-style clients)."""
    auth = headers.get("authorization", "")
    scheme, _, key = auth.partition(" ")
    if scheme.lower() == "bearer" and key.strip():
        return key.strip()
    return (headers.get("x-api-key", "") or headers.get("api-key", "")).strip()


def priority_of(headers: Mapping[str, str]) -> int:
    """The ``x-kvmesh-priority`` header (0 when absent); ``BadRequest`` when not an int32."""
    raw_priority = headers.get(PRIORITY_HEADER, "").strip()
    try:
        priority = int(raw_priority) if raw_priority else 0
    except ValueError:
        raise BadRequest(
            f"header {PRIORITY_HEADER} must be an integer (got {raw_priority!r})", PRIORITY_HEADER
        ) from None
    if not -(2**31) <= priority < 2**31:
        raise BadRequest(f"header {PRIORITY_HEADER} is out of the int32 range", PRIORITY_HEADER)
    return priority


def session_end_of(headers: Mapping[str, str]) -> bool:
    """The ``x-kvmesh-session-end`` header: true/1/yes or false/0/no (absent: false)."""
    raw = headers.get(SESSION_END_HEADER, "").strip().lower()
    if raw in _TRUE:
        return True
    if raw in _FALSE:
        return False
    raise BadRequest(
        f"header {SESSION_END_HEADER} must be true or false (got {raw!r})", SESSION_END_HEADER
    )


def claims_of(headers: Mapping[str, str]) -> Claims:
    """What the headers ask beside the key (checked by ``core.auth.authorize``)."""
    return Claims(
        tenant=headers.get(TENANT_HEADER, "").strip(),
        priority=priority_of(headers),
        tenant_source=f"header {TENANT_HEADER}",
        priority_source=f"header {PRIORITY_HEADER}",
    )


def extensions_from_headers(
    headers: Mapping[str, str], identity: Identity | None = None
) -> Extensions:
    """``headers`` with lower-case names (aiohttp's CIMultiDict is case-insensitive anyway).
    ``identity``: the caller as its API key names it (``http.auth``, keys configured): its
    tenant and priority. Without (an open router) the tenant header wins, else the hashed key,
    and the priority header is taken as sent."""
    session_id = headers.get(SESSION_HEADER, "").strip()
    end = session_end_of(headers)
    if identity is not None:
        return Extensions(
            session_id, identity.tenant, identity.priority, identity.cache_salt, session_end=end
        )
    key = api_key_of(headers)
    tenant = headers.get(TENANT_HEADER, "").strip() or (tenant_of_key(key) if key else "")
    return Extensions(
        session_id=session_id, tenant=tenant, priority=priority_of(headers), session_end=end
    )
