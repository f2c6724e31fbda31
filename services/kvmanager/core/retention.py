"""Session retention: which blocks the node keeps for live agent sessions. Pure, synchronous
and deterministic (time is passed in): the servicer calls it, and it marks blocks retained or
released on the ``TierIndex`` through two callbacks.

A session (tenant, session id) pins the block hashes of its last turn (prompt and output, one
layout) with a TTL; each turn's pin replaces the previous one and renews the TTL; it ends on
``end`` or at expiry. Blocks are refcounted across sessions, so sub-agents that share the
session's prefix share its retention and its bytes are counted once.

Budgets. Retained bytes (unique blocks, at the layout's block size) stay within the node's
``budget_bytes`` and each tenant's ``tenant_budget_bytes`` (0: no tenant cap). A pin that does
not fit releases the least recently active other sessions (of the tenant first, for the tenant
cap) until it does; a session larger than a budget on its own keeps the leading blocks that
fit (the prefix is what the next turn reuses) and is reported ``truncated``.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvmesh.errors import InvalidArgument
from kvmesh.kv.events import BlockHash

from .plan import BlockId


@dataclass(frozen=True, slots=True)
class SessionKey:
    tenant: str
    session_id: str


@dataclass(frozen=True, slots=True)
class PinResult:
    """What a pin did. ``renewed``: the session was live; ``previous_blocks``: how many blocks
    its previous pin kept (for the caller to check how many are still held)."""

    retained_blocks: int
    truncated: bool
    renewed: bool
    previous: tuple[BlockId, ...]
    released: tuple[SessionKey, ...]  # other sessions released to make room


@dataclass(slots=True)
class _Session:
    blocks: tuple[BlockId, ...]
    block_bytes: int
    expires_at_s: float

    @property
    def bytes(self) -> int:
        return len(self.blocks) * self.block_bytes


@dataclass(slots=True)
class RetentionStats:
    pins: int = 0
    renewals: int = 0
    ends: int = 0
    expired: int = 0
    released_for_budget: int = 0  # sessions released to make room for another
    truncated: int = 0


@dataclass(slots=True)
class _Tenant:
    bytes: int = 0
    blocks: dict[BlockId, int] = field(default_factory=dict)  # refcount within the tenant


class Retention:
    def __init__(
        self,
        budget_bytes: int,
        tenant_budget_bytes: int = 0,
        max_ttl_s: float = 3600.0,
        retain: Callable[[BlockId], None] = lambda _b: None,
        release: Callable[[BlockId], None] = lambda _b: None,
    ) -> None:
        if budget_bytes < 0 or tenant_budget_bytes < 0:
            raise InvalidArgument("retention budgets must be >= 0")
        self.budget_bytes = budget_bytes
        self.tenant_budget_bytes = tenant_budget_bytes
        self.max_ttl_s = max_ttl_s
        self._retain = retain
        self._release = release
        # Least recently active first.
        self._sessions: OrderedDict[SessionKey, _Session] = OrderedDict()
        self._refs: dict[BlockId, tuple[int, int]] = {}  # block -> (sessions, block bytes)
        self._tenants: dict[str, _Tenant] = {}
        self.bytes = 0  # unique retained bytes
        self.stats = RetentionStats()

    # ---- queries -------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._sessions)

    def blocks_of(self, key: SessionKey) -> tuple[BlockId, ...]:
        s = self._sessions.get(key)
        return s.blocks if s is not None else ()

    def tenant_bytes(self, tenant: str) -> int:
        t = self._tenants.get(tenant)
        return t.bytes if t is not None else 0

    def next_expiry_s(self) -> float | None:
        return min((s.expires_at_s for s in self._sessions.values()), default=None)

    # ---- changes -------------------------------------------------------------------------

    def pin(
        self,
        key: SessionKey,
        layout_key: str,
        block_bytes: int,
        hashes: Sequence[BlockHash],
        ttl_s: float,
        now_s: float,
    ) -> PinResult:
        """The session keeps ``hashes`` (its turn's chain, in order) for ``ttl_s`` from now."""
        if not key.session_id:
            raise InvalidArgument("a session id is required", "session_id")
        if not ttl_s > 0:
            raise InvalidArgument(f"ttl_s must be > 0, got {ttl_s}", "ttl_s")
        if block_bytes < 1:
            raise InvalidArgument(f"block_bytes must be >= 1, got {block_bytes}")
        ttl_s = min(ttl_s, self.max_ttl_s)
        self.expire(now_s)
        old = self._sessions.pop(key, None)
        previous = old.blocks if old is not None else ()
        # Dedupe, keeping order: a chain never repeats, but be safe.
        wanted = tuple(dict.fromkeys(BlockId(layout_key, h) for h in hashes))
        released: list[SessionKey] = []
        # Make room: what the new pin adds beyond the blocks already retained.
        tenant_cap = self.tenant_budget_bytes or self.budget_bytes
        cap = min(self.budget_bytes, tenant_cap)
        keep = wanted[: cap // block_bytes] if block_bytes <= cap else ()
        truncated = len(keep) < len(wanted)
        # Retain the new blocks first so shared ones never drop to zero refs in between.
        self._add(key.tenant, keep, block_bytes)
        if old is not None:
            self._drop(key.tenant, old.blocks)
        self._sessions[key] = _Session(keep, block_bytes, now_s + ttl_s)
        while self.tenant_budget_bytes and self.tenant_bytes(key.tenant) > self.tenant_budget_bytes:
            victim = next((k for k in self._sessions if k.tenant == key.tenant and k != key), None)
            if victim is None:
                break
            self._end(victim)
            released.append(victim)
        while self.bytes > self.budget_bytes:
            victim = next((k for k in self._sessions if k != key), None)
            if victim is None:
                break
            self._end(victim)
            released.append(victim)
        self.stats.pins += 1
        self.stats.renewals += old is not None
        self.stats.released_for_budget += len(released)
        self.stats.truncated += truncated
        return PinResult(len(keep), truncated, old is not None, previous, tuple(released))

    def end(self, key: SessionKey) -> bool:
        """Releases the session now; False if it was not live."""
        if key not in self._sessions:
            return False
        self._end(key)
        self.stats.ends += 1
        return True

    def expire(self, now_s: float) -> list[SessionKey]:
        """Releases every session whose TTL has passed."""
        gone = [k for k, s in self._sessions.items() if s.expires_at_s <= now_s]
        for k in gone:
            self._end(k)
        self.stats.expired += len(gone)
        return gone

    def clear(self) -> None:
        for k in list(self._sessions):
            self._end(k)

    # ---- internals -----------------------------------------------------------------------

    def _end(self, key: SessionKey) -> None:
        s = self._sessions.pop(key)
        self._drop(key.tenant, s.blocks)

    def _add(self, tenant: str, blocks: Sequence[BlockId], block_bytes: int) -> None:
        if not blocks:
            return
        t = self._tenants.setdefault(tenant, _Tenant())
        for b in blocks:
            n = t.blocks.get(b, 0)
            if n == 0:
                t.bytes += block_bytes
            t.blocks[b] = n + 1
            refs, size = self._refs.get(b, (0, block_bytes))
            if refs == 0:
                self.bytes += size
                self._retain(b)
            self._refs[b] = (refs + 1, size)

    def _drop(self, tenant: str, blocks: Sequence[BlockId]) -> None:
        if not blocks:
            return
        t = self._tenants[tenant]
        for b in blocks:
            refs, size = self._refs[b]
            if refs == 1:
                del self._refs[b]
                self.bytes -= size
                self._release(b)
            else:
                self._refs[b] = (refs - 1, size)
            n = t.blocks[b]
            if n == 1:
                del t.blocks[b]
                t.bytes -= size
            else:
                t.blocks[b] = n - 1
        if not t.blocks:
            del self._tenants[tenant]

    def check_invariants(self) -> None:
        """Recounts everything (tests; O(n))."""
        refs: dict[BlockId, int] = {}
        for s in self._sessions.values():
            for b in s.blocks:
                refs[b] = refs.get(b, 0) + 1
        assert refs == {b: n for b, (n, _) in self._refs.items()}
        assert self.bytes == sum(size for _, size in self._refs.values())
        assert self.bytes <= self.budget_bytes, (self.bytes, self.budget_bytes)
        for name, t in self._tenants.items():
            assert t.blocks and all(n > 0 for n in t.blocks.values())
            if self.tenant_budget_bytes:
                assert t.bytes <= self.tenant_budget_bytes, (name, t.bytes)
