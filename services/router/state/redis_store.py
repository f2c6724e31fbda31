"""Stored responses in Redis, shared by routers on several hosts (``redis`` asyncio client).

One hash per response, ``kvmesh:<cluster>:response:<id>`` with fields ``meta`` (JSON) and
``ids`` (the token ids, ``array('I')`` bytes), written with its expiry in one MULTI/EXEC; Redis
expires it. Every command has the store's deadline (the client's socket timeouts)."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from kvmesh import errors

from .records import StoredResponse, _masked

log = logging.getLogger(__name__)
T = TypeVar("T")


class RedisStore:
    def __init__(self, url: str, cluster: str, ttl_s: float, timeout_s: float) -> None:
        self._url = url
        self._prefix = f"kvmesh:{cluster}:response:"
        self._ttl_ms = max(1, int(ttl_s * 1000))
        self._timeout_s = timeout_s
        self._client: Any = None  # connects on first use

    def describe(self) -> str:
        return f"redis at {_masked(self._url)}"

    def _redis(self) -> Any:
        if self._client is None:
            self._client = aioredis.Redis.from_url(
                self._url,
                socket_timeout=self._timeout_s,
                socket_connect_timeout=self._timeout_s,
                decode_responses=False,
            )
            log.info("responses store: %s", self.describe())
        return self._client

    async def _run(self, call: Callable[[Any], Awaitable[T]]) -> T:
        try:
            return await call(self._redis())
        except (RedisError, OSError, TimeoutError) as exc:
            raise errors.Unavailable(
                f"the responses store ({self.describe()}) failed: {type(exc).__name__}: {exc}"
            ) from exc

    async def put(self, record: StoredResponse) -> None:
        key = self._prefix + record.id
        meta, ids = record.meta(), record.ids()

        async def write(r: Any) -> None:
            async with r.pipeline(transaction=True) as pipe:
                pipe.delete(key)
                pipe.hset(key, mapping={"meta": meta, "ids": ids})
                pipe.pexpire(key, self._ttl_ms)
                await pipe.execute()

        await self._run(write)

    async def get(self, response_id: str) -> StoredResponse | None:
        meta, ids = await self._run(lambda r: r.hmget(self._prefix + response_id, "meta", "ids"))
        if meta is None or ids is None:
            return None
        return StoredResponse.decode(meta, ids)

    async def delete(self, response_id: str) -> bool:
        return bool(await self._run(lambda r: r.delete(self._prefix + response_id)))

    async def close(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None
