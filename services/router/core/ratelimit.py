"""Per-tenant rate limits: requests and tokens per minute, as token buckets. Pure (injected
clock).

Each limited tenant has a bucket per limit holding up to a minute's allowance, refilled
continuously. A request needs one request token and, for the tokens limit, its prompt tokens
(checked when it arrives); its output tokens are charged when it ends, so a tenant may run
into debt and wait it off. A refusal says how long until the bucket holds what the request
needs: the Retry-After. The limits come from the tenant's entry in the key file
(``requests_per_minute``, ``tokens_per_minute``; 0: unlimited); a tenant whose limits change on
a reload keeps its bucket's level.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Limits:
    requests_per_minute: int = 0  # 0: unlimited
    tokens_per_minute: int = 0  # prompt + output tokens; 0: unlimited

    @property
    def limited(self) -> bool:
        return self.requests_per_minute > 0 or self.tokens_per_minute > 0


@dataclass(slots=True)
class _Bucket:
    level: float  # may go below 0 (debt)
    at_s: float

    def refill(self, now: float, per_minute: int) -> None:
        self.level = min(per_minute, self.level + (now - self.at_s) * per_minute / 60.0)
        self.at_s = now

    def wait_s(self, need: float, per_minute: int) -> float:
        return max(need - self.level, 0.0) * 60.0 / per_minute


class RateLimiter:
    """Buckets per tenant, created on a tenant's first limited request."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._requests: dict[str, _Bucket] = {}
        self._tokens: dict[str, _Bucket] = {}

    def check(self, tenant: str, limits: Limits, prompt_tokens: int = 0) -> float:
        """0: the request may go (its request and prompt tokens are taken); else the seconds
        until it could (nothing is taken)."""
        if not limits.limited:
            return 0.0
        now = self._clock()
        wait = 0.0
        rpm, tpm = limits.requests_per_minute, limits.tokens_per_minute
        req = tok = None
        if rpm > 0:
            req = self._bucket(self._requests, tenant, now, rpm)
            wait = req.wait_s(1.0, rpm)
        if tpm > 0:
            tok = self._bucket(self._tokens, tenant, now, tpm)
            # A prompt larger than a minute's allowance waits for a full bucket, not forever.
            wait = max(wait, tok.wait_s(min(float(prompt_tokens), float(tpm)), tpm))
        if wait > 0.0:
            return wait
        if req is not None:
            req.level -= 1.0
        if tok is not None:
            tok.level -= prompt_tokens
        return 0.0

    def refund(self, tenant: str, limits: Limits, prompt_tokens: int = 0) -> None:
        """Gives back what a passed ``check`` took: the request was refused after it."""
        if limits.requests_per_minute > 0 and (b := self._requests.get(tenant)) is not None:
            b.level = min(b.level + 1.0, float(limits.requests_per_minute))
        if limits.tokens_per_minute > 0 and (b := self._tokens.get(tenant)) is not None:
            b.level = min(b.level + prompt_tokens, float(limits.tokens_per_minute))

    def charge(self, tenant: str, limits: Limits, output_tokens: int) -> None:
        """The output tokens of a request that ended."""
        if limits.tokens_per_minute > 0 and output_tokens > 0:
            now = self._clock()
            b = self._bucket(self._tokens, tenant, now, limits.tokens_per_minute)
            b.level -= output_tokens

    def _bucket(
        self, buckets: dict[str, _Bucket], tenant: str, now: float, per_minute: int
    ) -> _Bucket:
        b = buckets.get(tenant)
        if b is None:
            b = buckets[tenant] = _Bucket(float(per_minute), now)
        else:
            b.refill(now, per_minute)
        return b
