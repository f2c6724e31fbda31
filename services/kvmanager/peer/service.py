"""Both sides of peer fetch for one kvmanager, over its ``TieredStore``.

Holder side: ``StoreBlockSource`` lets the data plane server send blocks straight out of the
store (a RAM block is pinned and its own bytes handed to the kernel, no copy; a disk block is
read through the store), and ``PeerService.open_fetch`` grants a one-time ticket for the
leading run of the asked blocks held here.

Fetching side: ``PeerService.fetch`` skips the blocks held here (``core.FetchPlan``), finds the
peer (``directory.PeerDirectory``), asks it for a ticket over gRPC (OpenFetch, with a deadline),
pulls the blocks over its data plane (``client.fetch_blocks``; in the ``auth`` mode on a
connection kept from an earlier fetch when one is idle: ``pool.ConnectionPool``) and puts each
whole verified block into the CPU tier with its parent hash, as it arrives
(``core.FetchProgress`` counts).

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
from typing import TYPE_CHECKING

import grpc

from kvmesh.errors import InvalidArgument
from kvmesh.kv.events import BlockHash, Tier
from kvmesh.kv.layout import KvLayout, check_block_hash
from kvmesh.kv_wire import layout_to_pb
from kvmesh.telemetry import tracer
from kvmesh.tls import Tls
from kvmesh.v1 import kvmanager_pb2, kvmanager_pb2_grpc

from ..core.config import PeerConfig
from ..core.errors import DataPlaneOff, PeerFetchFailed, PeerFetchTimedOut
from .client import FetchDeadlineExceeded, FetchedBlock, PeerFetchError, StreamBroken, fetch_blocks
from .core import (
    FetchGrant,
    FetchPlan,
    FetchProgress,
    PeerRef,
    Ticket,
    grant_matches,
    split_address,
    ticket_ttl_s,
)
from .directory import PeerDirectory
from .pool import ConnectionPool, PoolConfig
from .server import DataPlaneServer, DataPlaneStats, PinnedBlock

if TYPE_CHECKING:  # the store imports the wire format of this package: no import cycle
    from ..store import TieredStore

log = logging.getLogger(__name__)
_tracer = tracer(__name__)


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


@dataclass(slots=True)
class PeerStats:
    """Counters since start (for metrics)."""

    tickets_issued: int = 0
    fetches: int = 0
    fetch_failures: int = 0
    blocks_fetched: int = 0
    bytes_fetched: int = 0


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
        tls: Tls | None = None,
    ) -> None:
        """``tls``: fetch from peers' data planes over TLS with this kvmanager's certificate
        (the peers' gRPC channels take it from ``directory``); None: plaintext."""
        self._id = kvmanager_id
        self._tls = tls
        self._ssl = tls.client_ssl_context() if tls is not None else None  # one, reused
        self._address = address
        self._store = store
        self._data_plane = data_plane
        self.data_plane_address = ""  # host:port peers reach the data plane at, once started
        self._directory = directory
        self._config = config
        self.stats = PeerStats()
        # Authenticated data plane connections kept between fetches (peers in the auth mode).
        self.pool = ConnectionPool(
            PoolConfig(config.pool_idle_per_peer, config.pool_idle_timeout_s)
        )

    def close(self) -> None:
        """Closes the kept data plane connections."""
        self.pool.close()

    @property
    def data_plane_stats(self) -> DataPlaneStats | None:
        return self._data_plane.stats if self._data_plane is not None else None

    # -- holder side

    def open_fetch(self, layout_key: str, hashes: Sequence[int], ttl_s: float) -> FetchGrant:
        """A ticket for the leading run of ``hashes`` held here (no ticket when none is)."""
        if self._data_plane is None:
            raise DataPlaneOff(f"kvmanager {self._id} serves no data plane (--data-plane-port -1)")
        checked = [check_block_hash(h) for h in hashes]
        ttl = ticket_ttl_s(ttl_s, self._config.ticket_ttl_s)
        layout = self._store.layout_of(layout_key, checked[0]) if checked else None
        run = checked[: len(self._store.lookup(layout, checked))] if layout is not None else []
        if layout is None or not run:
            return FetchGrant(self.data_plane_address, b"", (), None, layout_key, 0.0)
        ticket = self._data_plane.issue_ticket(layout_key, run, ttl)
        self.stats.tickets_issued += 1
        parent = self._store.parent_of(layout, run[0])
        return FetchGrant(
            self.data_plane_address,
            ticket.token,
            tuple(run),
            parent,
            layout_key,
            ttl,
            self._data_plane.tls,
            self._data_plane.tls_auth_only,
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
        plan = FetchPlan.of(hashes, functools.partial(self._store.contains, layout))
        progress.planned(plan)
        if not plan.wanted:
            return
        what = peer.describe() if peer.kvmanager_id else f"peer {address}"
        grant = await self._open(layout, plan.asked(), what, address, deadline)
        granted = len(grant.block_hashes)
        progress.granted(plan, granted)
        if not granted:
            return
        parents = plan.parents(granted, grant.parent_hash)
        parts = split_address(grant.data_plane_address)
        if parts is None:
            raise PeerFetchFailed(
                f"{what} has no usable data plane address ({grant.data_plane_address!r})"
            )
        host, port = parts
        if grant.data_plane_tls and self._ssl is None:
            raise PeerFetchFailed(
                f"{what}'s data plane speaks TLS and this kvmanager has no certificate: give it "
                "--tls-cert-file, --tls-key-file and --tls-ca-file as the mesh's"
            )
        ticket = Ticket(grant.token, layout.key, grant.block_hashes, 0.0)
        block_bytes = layout.block_bytes

        def stored(ok: bool, nbytes: int) -> None:
            progress.stored(ok, nbytes)
            if ok:
                self.stats.blocks_fetched += 1
                self.stats.bytes_fetched += nbytes

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
                ssl_context=self._ssl if grant.data_plane_tls else None,
                server_hostname=self._tls.server_hostname(host) if self._tls is not None else None,
                tls_auth_only=grant.data_plane_tls and grant.data_plane_auth_only,
                pool=self.pool,
            )
        except FetchDeadlineExceeded as exc:
            raise progress.timed_out(what, granted, str(exc)) from None
        except PeerFetchError as exc:
            raise progress.failed(what, granted, f"{type(exc).__name__}: {exc}") from None
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
        if not grant_matches(hashes, granted, resp.token):
            raise PeerFetchFailed(f"{what} granted a ticket that does not match the request")
        parent = BlockHash(resp.parent_hash) if resp.HasField("parent_hash") else None
        return FetchGrant(
            resp.data_plane_address,
            resp.token,
            granted,
            parent,
            resp.layout_key,
            resp.ttl_s,
            resp.data_plane_tls,
            resp.data_plane_auth_only,
        )
