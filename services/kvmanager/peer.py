"""Peer fetch: a kvmanager fetches the KV blocks it lacks from another node's kvmanager.

Holder side: ``StoreBlockSource`` lets the data plane server send blocks straight out of the
``TieredStore`` (a RAM block is pinned and its own bytes handed to the kernel, no copy; a disk
block is read through the store), and ``PeerService.open_fetch`` grants a one-time ticket for
the leading run of the asked blocks held here.

Fetching side: ``PeerService.fetch`` skips the blocks held here, finds the peer (by address, or
by kvmanager id through etcd: ``PeerDirectory``), asks it for a ticket over gRPC (OpenFetch,
with a deadline), pulls the blocks over its data plane (``dataplane_client.fetch_blocks``:
checksummed, flow-controlled, stall and deadline bounded) and puts each whole verified block
into the CPU tier with its parent hash, as it arrives. A peer that dies or stalls mid-stream
leaves the blocks stored before it (whole and verified) and nothing partial; the fetch raises
``PeerFetchFailed`` / ``PeerFetchTimedOut`` saying how many blocks were fetched, and the caller
recomputes the rest. See docs/kvmanager.md.

Each fetch is a ``kv.fetch_from_peer`` span (the peer's id, blocks asked, fetched, already held,
missing on the peer, bytes): the OpenFetch call to the peer is its child.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

import grpc

from kvmesh.discovery.etcd import PrefixWatcher
from kvmesh.discovery.keys import KvManagerRecord, kvmanagers_prefix
from kvmesh.errors import InvalidArgument
from kvmesh.kv.events import BlockHash, Tier
from kvmesh.telemetry import tracer
from kvmesh.v1 import kvmanager_pb2, kvmanager_pb2_grpc

from .convert import layout_to_pb
from .core.config import PeerConfig
from .core.errors import (
    DataPlaneOff,
    PeerFetchFailed,
    PeerFetchTimedOut,
    PeerNotFound,
)
from .core.layout import KvLayout, check_block_hash
from .dataplane_client import (
    FetchDeadlineExceeded,
    FetchedBlock,
    PeerFetchError,
    StreamBroken,
    fetch_blocks,
)
from .dataplane_server import DataPlaneServer, DataPlaneStats, PinnedBlock, Ticket
from .dataplane_wire import TOKEN_BYTES
from .store import TieredStore

log = logging.getLogger(__name__)
_tracer = tracer(__name__)

_MAX_TTL_FACTOR = 10  # a caller may ask for at most 10x the configured ticket TTL


class StoreBlockSource:
    """The data plane's ``BlockSource`` over a ``TieredStore``. Called on the loop."""

    def __init__(self, store: TieredStore) -> None:
        self._store = store

    def pin(
        self, layout_key: str, block_hash: BlockHash
    ) -> PinnedBlock | Awaitable[PinnedBlock | None] | None:
        pinned = self._store.pin_one(layout_key, block_hash)
        if pinned is None:
            return None
        bid, tier = pinned
        if tier is Tier.CPU:  # RAM: send the stored bytes themselves, pinned until sent
            data, checksum = self._store.ram_block(bid)
            return PinnedBlock(data, checksum, functools.partial(self._store.unpin_one, bid, tier))
        layout = self._store.layout_of(layout_key, block_hash)
        if layout is None:  # cannot be: a pinned block's layout is known
            self._store.unpin_one(bid, tier)
            return None
        return self._read_disk(
            layout, block_hash, functools.partial(self._store.unpin_one, bid, tier)
        )

    async def _read_disk(
        self, layout: KvLayout, block_hash: BlockHash, unpin: Callable[[], None]
    ) -> PinnedBlock | None:
        """A disk block, pinned meanwhile, read through the store (checks the file, promotes it
        to RAM)."""
        try:
            read = await self._store.get(layout, block_hash)
        finally:
            unpin()
        return None if read is None else PinnedBlock(read)


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


@dataclass(slots=True)
class FetchProgress:
    """How far one fetch got; filled in as it goes, so it is right however the fetch ends."""

    fetched: int = 0  # blocks stored here
    already_held: int = 0
    bytes: int = 0
    peer_missing: int = 0
    seconds: float = 0.0
    prefix_blocks: int = 0  # the leading run of the request held here at the end


@dataclass(slots=True)
class PeerStats:
    """Counters since start (for metrics)."""

    tickets_issued: int = 0
    fetches: int = 0
    fetch_failures: int = 0
    blocks_fetched: int = 0
    bytes_fetched: int = 0


class PeerDirectory:
    """Finds peers: kvmanager id -> gRPC address from etcd (a ``PrefixWatcher`` on the
    kvmanagers prefix), and one cached gRPC channel per peer address."""

    def __init__(
        self,
        self_id: str,
        endpoints: Sequence[str],
        cluster: str,
        interceptors: Sequence[grpc.aio.ClientInterceptor] = (),
    ) -> None:
        self._self_id = self_id
        self._interceptors = list(interceptors)
        self._endpoints = list(endpoints)
        self._prefix = kvmanagers_prefix(cluster)
        self._records: dict[str, KvManagerRecord] = {}
        self._watcher: PrefixWatcher | None = None
        self._channels: dict[str, grpc.aio.Channel] = {}

    async def start(self) -> None:
        if not self._endpoints:
            return
        self._watcher = PrefixWatcher(
            self._endpoints, self._prefix, self._on_snapshot, self._on_put, self._on_delete
        )
        await self._watcher.start()

    async def close(self) -> None:
        if self._watcher is not None:
            await self._watcher.close()
        channels, self._channels = list(self._channels.values()), {}
        await asyncio.gather(*(ch.close() for ch in channels), return_exceptions=True)

    def resolve(self, peer: PeerRef) -> str:
        """The peer's gRPC address; PeerNotFound for an id etcd does not know."""
        if peer.address:
            return peer.address
        if not peer.kvmanager_id:
            raise InvalidArgument("name the peer: set peer_kvmanager_id or peer_address")
        if self._watcher is None:
            raise PeerNotFound(
                f"kvmanager {peer.kvmanager_id!r}: this kvmanager runs without etcd; name the"
                " peer by address"
            )
        rec = self._records.get(peer.kvmanager_id)
        if rec is None:
            raise PeerNotFound(
                f"kvmanager {peer.kvmanager_id!r} is not registered in etcd under {self._prefix}"
            )
        return rec.address

    def channel(self, address: str) -> grpc.aio.Channel:
        ch = self._channels.get(address)
        if ch is None:
            ch = grpc.aio.insecure_channel(address, interceptors=self._interceptors)
            self._channels[address] = ch
        return ch

    def _on_snapshot(self, snapshot: dict[str, str]) -> None:
        self._records = {}
        for key, value in snapshot.items():
            self._on_put(key, value)

    def _on_put(self, key: str, value: str) -> None:
        try:
            rec = KvManagerRecord.from_json(value)
        except (ValueError, TypeError) as exc:
            log.warning("ignoring a bad kvmanager record at %s: %s", key, exc)
            return
        self._records[key.removeprefix(self._prefix)] = rec

    def _on_delete(self, key: str) -> None:
        self._records.pop(key.removeprefix(self._prefix), None)


class PeerService:
    """Both sides of peer fetch for one kvmanager. ``data_plane`` is None when serving is off."""

    def __init__(
        self,
        kvmanager_id: str,
        address: str,
        store: TieredStore,
        data_plane: DataPlaneServer | None,
        directory: PeerDirectory,
        config: PeerConfig,
    ) -> None:
        self._id = kvmanager_id
        self._address = address
        self._store = store
        self._data_plane = data_plane
        self.data_plane_address = ""  # host:port peers reach the data plane at, once started
        self._directory = directory
        self._config = config
        self.stats = PeerStats()

    @property
    def data_plane_stats(self) -> DataPlaneStats | None:
        return self._data_plane.stats if self._data_plane is not None else None

    # -- holder side

    def open_fetch(self, layout_key: str, hashes: Sequence[int], ttl_s: float) -> FetchGrant:
        """A ticket for the leading run of ``hashes`` held here (no ticket when none is)."""
        if self._data_plane is None:
            raise DataPlaneOff(f"kvmanager {self._id} serves no data plane (--data-plane-port -1)")
        checked = [check_block_hash(h) for h in hashes]
        if ttl_s < 0:
            raise InvalidArgument(f"ttl_s must be >= 0, got {ttl_s}")
        ttl = min(ttl_s or self._config.ticket_ttl_s, _MAX_TTL_FACTOR * self._config.ticket_ttl_s)
        layout = self._store.layout_of(layout_key, checked[0]) if checked else None
        run = checked[: len(self._store.lookup(layout, checked))] if layout is not None else []
        if layout is None or not run:
            return FetchGrant(self.data_plane_address, b"", (), None, layout_key, 0.0)
        ticket = self._data_plane.issue_ticket(layout_key, run, ttl)
        self.stats.tickets_issued += 1
        parent = self._store.parent_of(layout, run[0])
        return FetchGrant(
            self.data_plane_address, ticket.token, tuple(run), parent, layout_key, ttl
        )

    # -- fetching side

    async def fetch(
        self,
        layout: KvLayout,
        hashes: Sequence[int],
        peer: PeerRef,
        deadline_s: float,
        progress: FetchProgress,
    ) -> FetchProgress:
        """Fetches what of ``hashes`` (a prefix chain) is not held here from ``peer`` within
        ``deadline_s``; ``progress`` says how far it got, however it ends."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + deadline_s
        started = time.monotonic()
        checked = [check_block_hash(h) for h in hashes]
        address = self._directory.resolve(peer)
        if peer.kvmanager_id == self._id or address == self._address:
            raise InvalidArgument(f"{peer.describe()} is this kvmanager: nothing to fetch")
        self.stats.fetches += 1
        with _tracer.start_as_current_span(
            "kv.fetch_from_peer",
            attributes={
                "kv.layout": layout.key,
                "kv.peer": peer.kvmanager_id or address,
                "kv.blocks_asked": len(checked),
            },
        ) as span:
            try:
                await self._fetch(layout, checked, peer, address, deadline, progress)
            except (PeerFetchFailed, PeerFetchTimedOut):
                self.stats.fetch_failures += 1
                raise
            finally:
                progress.seconds = time.monotonic() - started
                progress.prefix_blocks = len(self._store.lookup(layout, checked))
                if span.is_recording():
                    span.set_attributes(
                        {
                            "kv.blocks_fetched": progress.fetched,
                            "kv.blocks_already_held": progress.already_held,
                            "kv.blocks_peer_missing": progress.peer_missing,
                            "kv.bytes_fetched": progress.bytes,
                        }
                    )
        return progress

    async def _fetch(
        self,
        layout: KvLayout,
        hashes: list[BlockHash],
        peer: PeerRef,
        address: str,
        deadline: float,
        progress: FetchProgress,
    ) -> None:
        wanted = [i for i, h in enumerate(hashes) if not self._store.contains(layout, h)]
        progress.already_held = len(hashes) - len(wanted)
        if not wanted:
            return
        what = peer.describe() if peer.kvmanager_id else f"peer {address}"
        grant = await self._open(layout, [hashes[i] for i in wanted], what, address, deadline)
        progress.peer_missing = len(wanted) - len(grant.block_hashes)
        if not grant.block_hashes:
            return
        parents: dict[BlockHash, BlockHash | None] = {}
        for i in wanted[: len(grant.block_hashes)]:
            parents[hashes[i]] = hashes[i - 1] if i > 0 else grant.parent_hash
        host, port = _split_address(grant.data_plane_address, what)
        ticket = Ticket(grant.token, layout.key, grant.block_hashes, 0.0)
        block_bytes = layout.block_bytes

        def stored(ok: bool, nbytes: int) -> None:
            if ok:
                progress.fetched += 1
                progress.bytes += nbytes
                self.stats.blocks_fetched += 1
                self.stats.bytes_fetched += nbytes
            else:
                progress.already_held += 1

        async def stored_later(got: Awaitable[bool], nbytes: int) -> None:
            stored(await got, nbytes)

        def on_block(block: FetchedBlock) -> Awaitable[None] | None:
            nbytes = block.data.nbytes
            if nbytes != block_bytes:
                raise StreamBroken(
                    f"{what} sent a {nbytes}-byte block; layout {layout.describe()}"
                    f" needs {block_bytes}"
                )
            # The arena slot the kernel received into, kept as it is with the checksum just
            # verified: no copy and no second pass on the way; no coroutine unless the store
            # has to make room first.
            got = self._store.put_nowait(
                layout,
                block.block_hash,
                block.data,
                parents.get(block.block_hash),
                checksum=block.checksum,
            )
            if isinstance(got, bool):
                stored(got, nbytes)
                return None
            return stored_later(got, nbytes)

        loop = asyncio.get_running_loop()
        try:
            result = await fetch_blocks(
                host,
                port,
                ticket,
                on_block=on_block,
                deadline_s=deadline - loop.time(),
                stall_timeout_s=self._config.stall_timeout_s,
                allocate=self._store.allocate,
                window_bytes=self._config.window_bytes,
                max_block_bytes=block_bytes,
            )
        except FetchDeadlineExceeded as exc:
            raise PeerFetchTimedOut(
                f"fetch from {what} ran out of its deadline after {progress.fetched} of"
                f" {len(grant.block_hashes)} blocks ({progress.fetched} kept, verified): {exc}",
                fetched=progress.fetched,
            ) from None
        except PeerFetchError as exc:
            raise PeerFetchFailed(
                f"fetch from {what} failed after {progress.fetched} of"
                f" {len(grant.block_hashes)} blocks ({progress.fetched} kept, verified;"
                f" recompute the rest): {type(exc).__name__}: {exc}",
                fetched=progress.fetched,
            ) from None
        progress.peer_missing += len(result.missing)

    async def _open(
        self, layout: KvLayout, hashes: list[BlockHash], what: str, address: str, deadline: float
    ) -> FetchGrant:
        """Asks the peer for a ticket (OpenFetch) within the open timeout and the deadline."""
        loop = asyncio.get_running_loop()
        left = deadline - loop.time()
        if left <= 0:
            raise PeerFetchTimedOut(f"no time left to ask {what} for blocks")
        stub = kvmanager_pb2_grpc.KvManagerStub(self._directory.channel(address))
        request = kvmanager_pb2.OpenFetchRequest(
            layout=layout_to_pb(layout), block_hashes=hashes, ttl_s=self._config.ticket_ttl_s
        )
        timeout = min(left, self._config.open_timeout_s)
        try:
            resp = await stub.OpenFetch(request, timeout=timeout)
        except grpc.aio.AioRpcError as exc:
            code = exc.code()
            why = f"{what} at {address} answered OpenFetch with {code.name}: {exc.details()}"
            if code is grpc.StatusCode.DEADLINE_EXCEEDED and timeout >= left:
                raise PeerFetchTimedOut(f"{why}; no block fetched") from None
            raise PeerFetchFailed(f"{why}; no block fetched") from None
        granted = tuple(BlockHash(h) for h in resp.block_hashes)
        if granted != tuple(hashes[: len(granted)]) or (granted and len(resp.token) != TOKEN_BYTES):
            raise PeerFetchFailed(f"{what} granted a ticket that does not match the request")
        parent = BlockHash(resp.parent_hash) if resp.HasField("parent_hash") else None
        return FetchGrant(
            resp.data_plane_address, resp.token, granted, parent, resp.layout_key, resp.ttl_s
        )


def _split_address(address: str, what: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise PeerFetchFailed(f"{what} has no usable data plane address ({address!r})")
    return host.strip("[]"), int(port)
