"""Peer fetch's pure core: the one-time tickets a holder grants, the flow-control windows of
both ends of a stream, and how far one fetch got. No sockets, threads, asyncio, gRPC or clock
reads: the adapters (``server.py``, ``client.py``, ``service.py``) pass the time in, and the
unit tests (tests/unit/test_kvmanager_peer_core.py) drive it directly.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvmesh.errors import InvalidArgument, ResourceExhausted
from kvmesh.kv.events import BlockHash

from ..core.errors import PeerFetchFailed, PeerFetchTimedOut
from .wire import TOKEN_BYTES, U64_MAX, Status

MAX_TTL_FACTOR = 10  # a caller may ask for at most 10x the configured ticket TTL

# ---------------------------------------------------------------------------------------------
# Tickets (the holder's side)


@dataclass(frozen=True, slots=True)
class Ticket:
    """One fetch, granted by the server that holds the blocks. The control plane carries it to
    the fetching node; the data plane request carries only ``token``, which is single-use."""

    token: bytes
    layout_key: str
    hashes: tuple[BlockHash, ...]
    expires_at: float  # unix seconds, for the holder's information; the server's clock decides


class TicketBook:
    """The tickets a data plane server issued and nobody redeemed yet: single use (a redeemed
    ticket is gone whatever the answer), at most ``max_tickets``, each expiring ``ttl_s`` after
    its issue. ``now``: the server's monotonic clock; ``wall_now``: unix seconds."""

    def __init__(self, max_tickets: int) -> None:
        self._max = max_tickets
        self._tickets: dict[bytes, tuple[Ticket, float]] = {}  # token -> ticket, expiry (now)

    def __len__(self) -> int:
        return len(self._tickets)

    def issue(
        self,
        token: bytes,
        layout_key: str,
        hashes: Sequence[int],
        ttl_s: float,
        *,
        now: float,
        wall_now: float,
    ) -> Ticket:
        if not hashes:
            raise InvalidArgument("a ticket needs at least one block hash")
        if len(hashes) >= 1 << 32:
            raise InvalidArgument(f"{len(hashes)} blocks in one ticket; the limit is 2**32 - 1")
        for h in hashes:
            if not 0 <= h <= U64_MAX:
                raise InvalidArgument(f"block hash {h} is not an unsigned 64-bit integer")
        if not ttl_s > 0:
            raise InvalidArgument(f"ticket ttl_s must be > 0, got {ttl_s}")
        if len(self._tickets) >= self._max:
            self.prune(now)
            if len(self._tickets) >= self._max:
                raise ResourceExhausted(
                    f"{len(self._tickets)} data plane tickets outstanding (max_tickets)"
                )
        ticket = Ticket(token, layout_key, tuple(BlockHash(h) for h in hashes), wall_now + ttl_s)
        self._tickets[token] = (ticket, now + ttl_s)
        return ticket

    def redeem(self, token: bytes, now: float) -> tuple[Status, Ticket | None]:
        """The ticket of ``token`` (OK), or why there is none; the ticket is used up either way."""
        ticket, expiry = self._tickets.pop(token, (None, 0.0))
        if ticket is None:
            return Status.UNKNOWN_TICKET, None
        if expiry <= now:
            return Status.EXPIRED_TICKET, None
        return Status.OK, ticket

    def revoke(self, token: bytes) -> bool:
        return self._tickets.pop(token, None) is not None

    def prune(self, now: float) -> None:
        for token in [t for t, (_, expiry) in self._tickets.items() if expiry <= now]:
            del self._tickets[token]

    def clear(self) -> None:
        self._tickets.clear()


def ticket_ttl_s(asked_s: float, configured_s: float) -> float:
    """The life of a granted ticket: what the caller asked (0: the configured TTL), at most
    ``MAX_TTL_FACTOR`` times the configured one."""
    if asked_s < 0:
        raise InvalidArgument(f"ttl_s must be >= 0, got {asked_s}")
    return min(asked_s or configured_s, MAX_TTL_FACTOR * configured_s)


# ---------------------------------------------------------------------------------------------
# Windows (flow control at both ends of a stream)


@dataclass(slots=True)
class SendWindow:
    """The serving side of a stream: payload pinned ahead of the send is at most
    ``limit_bytes`` (a block is pinned whenever nothing is), handed to the send thread
    ``batch_limit_bytes`` at a time. ``held_bytes`` counts from the pin until the send thread
    reports the bytes in the kernel (or the stream failed)."""

    limit_bytes: int
    batch_limit_bytes: int
    held_bytes: int = 0
    batch_bytes: int = 0  # in the batch being gathered

    @classmethod
    def of(cls, prefetch_bytes: int, batch_bytes: int) -> SendWindow:
        window = max(1, prefetch_bytes)
        return cls(window, max(1, min(batch_bytes, window)))

    def full(self) -> bool:
        """Pin nothing more until some bytes are sent."""
        return self.held_bytes >= self.limit_bytes

    def pinned(self, nbytes: int) -> bool:
        """A block joined the batch; True: the batch is full, hand it over (then ``handed``)."""
        self.held_bytes += nbytes
        self.batch_bytes += nbytes
        return self.batch_bytes >= self.batch_limit_bytes

    def handed(self) -> None:
        """The batch went to the send thread."""
        self.batch_bytes = 0

    def sent(self, nbytes: int) -> None:
        """The send thread is done with a block's bytes (in the kernel, or the stream failed)."""
        self.held_bytes -= nbytes


@dataclass(slots=True)
class RecvWindow:
    """The fetching side: verified blocks waiting for the consumer are at most ``limit_bytes``
    (a block is let through whenever none waits); past that the stream's reader stops reading
    the socket, and TCP pushes back on the server."""

    limit_bytes: int
    held_bytes: int = 0

    def fits(self, nbytes: int) -> bool:
        return not self.held_bytes or self.held_bytes + nbytes <= self.limit_bytes

    def reserve(self, nbytes: int) -> None:
        self.held_bytes += nbytes

    def taken(self, nbytes: int) -> None:
        """The consumer is done with a block."""
        self.held_bytes -= nbytes


# ---------------------------------------------------------------------------------------------
# Progress (the fetching side)


@dataclass(frozen=True, slots=True)
class PeerRef:
    """The peer to fetch from: by kvmanager id (looked up in etcd) or by gRPC address."""

    kvmanager_id: str = ""
    address: str = ""

    def describe(self) -> str:
        return f"kvmanager {self.kvmanager_id}" if self.kvmanager_id else f"peer {self.address}"


@dataclass(frozen=True, slots=True)
class FetchGrant:
    """What OpenFetch hands out: a ticket for the leading run held (none when empty)."""

    data_plane_address: str
    token: bytes
    block_hashes: tuple[BlockHash, ...]
    parent_hash: BlockHash | None
    layout_key: str
    ttl_s: float
    data_plane_tls: bool = False  # redeem the ticket over TLS
    data_plane_auth_only: bool = False  # over TLS, then the blocks in plaintext


def grant_matches(asked: Sequence[BlockHash], granted: Sequence[BlockHash], token: bytes) -> bool:
    """A grant is for a leading run of what was asked, with a real token when not empty."""
    return tuple(granted) == tuple(asked[: len(granted)]) and (
        not granted or len(token) == TOKEN_BYTES
    )


@dataclass(frozen=True, slots=True)
class FetchPlan:
    """What of a prefix chain to ask a peer for: the blocks not held here (``wanted``: their
    positions in ``hashes``), in order."""

    hashes: tuple[BlockHash, ...]
    wanted: tuple[int, ...]

    @classmethod
    def of(cls, hashes: Sequence[BlockHash], held: Callable[[BlockHash], bool]) -> FetchPlan:
        return cls(tuple(hashes), tuple(i for i, h in enumerate(hashes) if not held(h)))

    def asked(self) -> list[BlockHash]:
        return [self.hashes[i] for i in self.wanted]

    def parents(
        self, granted: int, grant_parent: BlockHash | None
    ) -> dict[BlockHash, BlockHash | None]:
        """Each of the first ``granted`` wanted blocks -> its parent in the chain (the first
        block's: the one the peer named, ``grant_parent``), as the store files it."""
        return {
            self.hashes[i]: self.hashes[i - 1] if i > 0 else grant_parent
            for i in self.wanted[:granted]
        }


@dataclass(slots=True)
class FetchProgress:
    """How far one fetch got; filled in as it goes, so it is right however the fetch ends."""

    fetched: int = 0  # blocks stored here
    already_held: int = 0
    bytes: int = 0
    peer_missing: int = 0
    seconds: float = 0.0
    prefix_blocks: int = 0  # the leading run of the request held here at the end

    def planned(self, plan: FetchPlan) -> None:
        self.already_held = len(plan.hashes) - len(plan.wanted)

    def granted(self, plan: FetchPlan, blocks: int) -> None:
        self.peer_missing = len(plan.wanted) - blocks

    def stored(self, ok: bool, nbytes: int) -> None:
        """A fetched block went to the store: kept, or the store had it meanwhile."""
        if ok:
            self.fetched += 1
            self.bytes += nbytes
        else:
            self.already_held += 1

    def timed_out(self, what: str, granted: int, why: str) -> PeerFetchTimedOut:
        """The error of a fetch that ran out of its deadline (the blocks stored stay)."""
        return PeerFetchTimedOut(
            f"fetch from {what} ran out of its deadline after {self.fetched} of"
            f" {granted} blocks ({self.fetched} kept, verified): {why}",
            fetched=self.fetched,
        )

    def failed(self, what: str, granted: int, why: str) -> PeerFetchFailed:
        """The error of a fetch that broke off (the blocks stored before it stay)."""
        return PeerFetchFailed(
            f"fetch from {what} failed after {self.fetched} of {granted} blocks"
            f" ({self.fetched} kept, verified; recompute the rest): {why}",
            fetched=self.fetched,
        )


def split_address(address: str) -> tuple[str, int] | None:
    """``host:port`` (``[v6]:port`` too) as its parts; None when it is not one."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        return None
    return host.strip("[]"), int(port)
