"""Values the router core works with (protobuf stays at the edge)."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvmesh.discovery.keys import WorkerId


@dataclass(frozen=True, slots=True)
class ChatMessage:
    role: str
    content: str
    name: str = ""
    tool_call_id: str = ""


@dataclass(frozen=True, slots=True)
class LoadSnapshot:
    """A worker's own report of its load (WatchLoad)."""

    running_requests: int = 0
    waiting_requests: int = 0
    in_flight_requests: int = 0
    kv_cache_usage: float = 0.0
    prefix_cache_queried_tokens: int = 0
    prefix_cache_hit_tokens: int = 0


@dataclass(frozen=True, slots=True)
class RouteRequest:
    """What a routing policy sees of a request."""

    request_id: str
    model: str
    prompt_token_ids: tuple[int, ...] = field(repr=False)
    session_id: str = ""
    tenant: str = ""
    priority: int = 0


@dataclass(frozen=True, slots=True)
class RouteDecision:
    worker_id: WorkerId
    policy: str
    reason: str
