"""What a stored response is, how it is encoded, and the store interface.

A record keeps what the next turn needs to extend this one exactly (``continuation.py``): the
prompt's and the output's token ids (as ``array('I')`` bytes: 4 bytes a token, so a 195K-token
turn is 780 KB), the conversation as chat messages (the new turn renders it again to find what
its new messages add), the instructions and tools the prompt rendered (the next turn extends
only when they are the same); and the Response object as it was answered (``GET``). Each
record holds its whole conversation, not a link to its parent: one read serves a turn."""

from __future__ import annotations

import json
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any, Protocol

from kvmesh.errors import InvalidArgument
from kvmesh.settings import setting

_TOKEN_TYPECODE = "I"
DAY_S = 86400.0


class StoreKind(StrEnum):
    SQLITE = "sqlite"
    REDIS = "redis"


@dataclass(frozen=True, slots=True)
class ResponsesConfig:
    store: StoreKind = setting(
        StoreKind.SQLITE,
        "where the Responses API keeps stored responses (previous_response_id, GET "
        "/v1/responses/{id}): sqlite (a file on this host; --processes share it) or redis "
        "(routers on several hosts share it)",
    )
    sqlite_path: Path = setting(
        Path("~/.local/state/kvmesh/responses.sqlite3"),
        "the SQLite file of --responses-store sqlite (created, with its directory, on the "
        "first Responses request)",
    )
    redis_url: str = setting(
        "redis://127.0.0.1:6379/0",
        "the Redis server of --responses-store redis, redis://[:password@]host:port/db or "
        "rediss:// (TLS)",
    )
    ttl_s: float = setting(
        30 * DAY_S, "how long a stored response is kept, seconds (OpenAI keeps them 30 days)"
    )
    timeout_s: float = setting(5.0, "deadline of one store read or write, seconds")

    def __post_init__(self) -> None:
        if not self.ttl_s > 0:
            raise InvalidArgument(f"--responses-ttl-s is {self.ttl_s}; use > 0 seconds")
        if not self.timeout_s > 0:
            raise InvalidArgument(f"--responses-timeout-s is {self.timeout_s}; use > 0 seconds")
        if self.store is StoreKind.REDIS and not self.redis_url.startswith(
            ("redis://", "rediss://", "unix://")
        ):
            raise InvalidArgument(
                f"--responses-redis-url is {_masked(self.redis_url)!r}; use "
                "redis://host:port/db, rediss://... or unix://path"
            )


def _masked(url: str) -> str:
    """``url`` without its password (for messages and logs)."""
    scheme, sep, rest = url.partition("://")
    if sep and "@" in rest:
        return f"{scheme}://***@{rest.split('@', 1)[1]}"
    return url


@dataclass(frozen=True, slots=True)
class StoredResponse:
    id: str  # "resp_..."
    tenant: str  # only its tenant may read, continue or delete it ("" on an open router)
    session_id: str  # the conversation's: its first turn's id unless the client named one
    created_at: float  # Unix time, seconds
    model: str
    response: dict[str, Any]  # the Response object as answered
    history: tuple[dict[str, Any], ...]  # chat messages through this turn's answer
    instructions: str  # the system message the prompt began with ("" none)
    tools_key: str  # the tools the prompt rendered, as canonical JSON ("" none)
    prompt_ids: Sequence[int] = field(repr=False)
    output_ids: Sequence[int] = field(repr=False)

    def meta(self) -> bytes:
        """Everything but the token ids, as JSON."""
        return json.dumps(
            {
                "id": self.id,
                "tenant": self.tenant,
                "session_id": self.session_id,
                "created_at": self.created_at,
                "model": self.model,
                "response": self.response,
                "history": list(self.history),
                "instructions": self.instructions,
                "tools_key": self.tools_key,
                "prompt_tokens": len(self.prompt_ids),
            },
            ensure_ascii=False,
            separators=(",", ":"),
        ).encode()

    def ids(self) -> bytes:
        """The prompt's then the output's token ids, as ``array('I')`` bytes."""
        packed = array(_TOKEN_TYPECODE, self.prompt_ids)
        packed.extend(self.output_ids)
        return packed.tobytes()

    @classmethod
    def decode(cls, meta: bytes, ids: bytes) -> StoredResponse:
        m = json.loads(meta)
        tokens = array(_TOKEN_TYPECODE)
        tokens.frombytes(ids)
        n = int(m["prompt_tokens"])
        return cls(
            id=m["id"],
            tenant=m["tenant"],
            session_id=m["session_id"],
            created_at=float(m["created_at"]),
            model=m["model"],
            response=m["response"],
            history=tuple(m["history"]),
            instructions=m["instructions"],
            tools_key=m["tools_key"],
            prompt_ids=tokens[:n].tolist(),
            output_ids=tokens[n:].tolist(),
        )


class ResponseStore(Protocol):
    """Stored responses by id. Implementations run nothing blocking on the event loop, bound
    every call by their deadline and raise ``kvmesh.errors.Unavailable`` when the store cannot
    be reached. Expired records (past ``ttl_s``) are never returned."""

    async def put(self, record: StoredResponse) -> None: ...

    async def get(self, response_id: str) -> StoredResponse | None: ...

    async def delete(self, response_id: str) -> bool:
        """Whether there was one to delete."""
        ...

    async def close(self) -> None: ...

    def describe(self) -> str:
        """Where it keeps them (for logs and errors; no password)."""
        ...


def open_store(config: ResponsesConfig, cluster: str) -> ResponseStore:
    """The store ``config`` names; it connects or opens its file on first use."""
    if config.store is StoreKind.REDIS:
        from .redis_store import RedisStore

        return RedisStore(config.redis_url, cluster, config.ttl_s, config.timeout_s)
    from .sqlite_store import SqliteStore

    return SqliteStore(config.sqlite_path.expanduser(), config.ttl_s, config.timeout_s)
