"""Per-tenant rate limits shared by every router of a cluster, in Redis (``--admission-redis-url``):
the same token buckets as ``core/ratelimit.py`` (a minute's allowance, refilled continuously;
output tokens charged at the end, into debt), kept in one Redis hash per tenant and limit,
``kvmesh:<cluster>:ratelimit:<tenant>:requests|tokens`` (fields ``level`` and ``at``), and
changed by one Lua script per call, so that two routers taking from one bucket at once never
both get the last token. The clock is the Redis server's (``TIME``): routers on several hosts
agree on it.

Redis trouble degrades to the router's own buckets (each router then enforces the limits over
the requests it sees, as without Redis) and is logged once per outage; it never fails a
request. Every command has the deadline ``timeout_s``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from .core.ratelimit import Limits, RateLimiter
from .state.records import _masked

log = logging.getLogger(__name__)

IDLE_EXPIRY_S = 3600  # a bucket untouched this long is dropped (it is full again long before)

# KEYS: requests bucket, tokens bucket. ARGV: rpm, tpm, tokens, op (check | refund | charge),
# expiry seconds. Returns the seconds to wait as a string (Lua numbers become integers).
SCRIPT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local rpm, tpm, n, op = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3]), ARGV[4]
local expiry = tonumber(ARGV[5])
local function level(key, per_min)
  local v = redis.call('HMGET', key, 'level', 'at')
  local l, at = tonumber(v[1]), tonumber(v[2])
  if l == nil or at == nil then return per_min end
  return math.min(per_min, l + math.max(now - at, 0) * per_min / 60)
end
local function save(key, l)
  redis.call('HSET', key, 'level', string.format('%.6f', l), 'at', string.format('%.6f', now))
  redis.call('EXPIRE', key, expiry)
end
if op == 'check' then
  local wait, rl, tl = 0, 0, 0
  if rpm > 0 then
    rl = level(KEYS[1], rpm)
    wait = math.max(1 - rl, 0) * 60 / rpm
  end
  if tpm > 0 then
    tl = level(KEYS[2], tpm)
    wait = math.max(wait, math.max(math.min(n, tpm) - tl, 0) * 60 / tpm)
  end
  if wait > 0 then return string.format('%.6f', wait) end
  if rpm > 0 then save(KEYS[1], rl - 1) end
  if tpm > 0 then save(KEYS[2], tl - n) end
elseif op == 'refund' then
  if rpm > 0 then save(KEYS[1], math.min(level(KEYS[1], rpm) + 1, rpm)) end
  if tpm > 0 then save(KEYS[2], math.min(level(KEYS[2], tpm) + n, tpm)) end
elseif op == 'charge' then
  if tpm > 0 and n > 0 then save(KEYS[2], level(KEYS[2], tpm) - n) end
end
return '0'
"""


class SharedRateLimiter:
    """``RateLimiter``'s calls, async, on buckets in Redis (module doc)."""

    def __init__(
        self,
        url: str,
        cluster: str,
        timeout_s: float,
        fallback: RateLimiter | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._url = url
        self._prefix = f"kvmesh:{cluster}:ratelimit:"
        self._timeout_s = timeout_s
        self._fallback = fallback or RateLimiter(clock)
        self._client: Any = None
        self._script: Any = None
        self._down = False  # in an outage (logged once)

    def describe(self) -> str:
        return f"redis at {_masked(self._url)}"

    async def check(self, tenant: str, limits: Limits, prompt_tokens: int = 0) -> float:
        if not limits.limited:
            return 0.0
        out = await self._call(tenant, limits, prompt_tokens, "check")
        if out is None:
            return self._fallback.check(tenant, limits, prompt_tokens)
        return out

    async def refund(self, tenant: str, limits: Limits, prompt_tokens: int = 0) -> None:
        if limits.limited and await self._call(tenant, limits, prompt_tokens, "refund") is None:
            self._fallback.refund(tenant, limits, prompt_tokens)

    async def charge(self, tenant: str, limits: Limits, output_tokens: int) -> None:
        if limits.tokens_per_minute <= 0 or output_tokens <= 0:
            return
        if await self._call(tenant, limits, output_tokens, "charge") is None:
            self._fallback.charge(tenant, limits, output_tokens)

    async def close(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    async def _call(self, tenant: str, limits: Limits, tokens: int, op: str) -> float | None:
        """The script's answer; None: Redis failed (the caller uses the local buckets)."""
        key = self._prefix + tenant
        try:
            script = self._redis_script()
            out = await script(
                keys=[key + ":requests", key + ":tokens"],
                args=[
                    limits.requests_per_minute,
                    limits.tokens_per_minute,
                    max(int(tokens), 0),
                    op,
                    IDLE_EXPIRY_S,
                ],
            )
        except (RedisError, OSError, TimeoutError) as exc:
            if not self._down:
                self._down = True
                log.warning(
                    "shared rate limits (%s) failed (%s: %s); each router enforces them over "
                    "its own requests until it answers again",
                    self.describe(),
                    type(exc).__name__,
                    exc,
                )
            return None
        if self._down:
            self._down = False
            log.info("shared rate limits (%s) answer again", self.describe())
        return float(out)

    def _redis_script(self) -> Any:
        if self._client is None:
            self._client = aioredis.Redis.from_url(
                self._url,
                socket_timeout=self._timeout_s,
                socket_connect_timeout=self._timeout_s,
                decode_responses=True,
            )
            self._script = self._client.register_script(SCRIPT)
            log.info("shared rate limits: %s", self.describe())
        return self._script
