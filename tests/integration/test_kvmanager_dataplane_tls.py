"""The kvmanager data plane over mutual TLS on loopback, with certificates the test made: a real
``DataPlaneServer`` against ``fetch_blocks``. Blocks of every size arrive byte-exact (into
buffers and as ``bytes``); a pause, the window, a cancel and a server closing behave as in
plaintext; a client without a certificate, with another CA's, trusting another CA, or in
plaintext is refused quickly as a ``PeerFetchError`` and the server goes on; and two kvmanager
daemons fetch from each other (``FetchFromPeer``) over TLS on both planes. The ``auth`` mode
(``--data-plane-security auth``: mutual TLS for the handshake and the ticket, then the blocks in
plaintext) passes the same checks: strangers refused before a ticket is redeemed, a wrong ticket
refused, the blocks byte-exact."""

from __future__ import annotations

import asyncio
import dataclasses
import ssl
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import grpc
import pytest

from kvmesh.kv.events import BlockHash
from kvmesh.tls import Tls, TlsConfig, open_channel
from kvmesh.tlsgen import Pki
from kvmesh.v1 import kvmanager_pb2, kvmanager_pb2_grpc
from services.kvmanager.config import KvManagerConfig, PeerConfig
from services.kvmanager.core.config import DataPlaneSecurity, StoreConfig
from services.kvmanager.main import start_kvmanager
from services.kvmanager.peer.client import (
    PeerFetchError,
    StreamBroken,
    TicketRefused,
    fetch_blocks,
)
from services.kvmanager.peer.server import DataPlaneConfig, DataPlaneServer, PinnedBlock
from services.kvmanager.peer.wire import Status
from tests.support import eventually

from .test_kvmanager_dataplane import SIZES, MemorySource, Sink, fetch, payload

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]


def tls_of(pki: Pki, *, cert: bool = True, ca: Pki | None = None) -> Tls:
    tls = TlsConfig(
        cert_file=pki.node.cert_file if cert else None,
        key_file=pki.node.key_file if cert else None,
        ca_file=(ca or pki).ca_file,
    ).load(serving=cert)
    assert tls is not None
    return tls


def client_ctx(tls: Tls | None, auth_only: bool = False) -> dict[str, object]:
    if tls is None:
        return {}
    return {"ssl_context": tls.client_ssl_context(), "tls_auth_only": auth_only}


AUTH_ONLY = pytest.mark.parametrize("auth_only", [False, True], ids=["tls", "auth"])


@pytest.fixture
async def start(pki: Pki) -> AsyncIterator[Callable[..., Awaitable[DataPlaneServer]]]:
    servers: list[DataPlaneServer] = []

    async def _start(source: MemorySource, tls: bool = True, **config: object) -> DataPlaneServer:
        ctx = tls_of(pki).server_ssl_context() if tls else None
        server = DataPlaneServer(source, DataPlaneConfig(ssl_context=ctx, **config))  # type: ignore[arg-type]
        await server.start()
        servers.append(server)
        return server

    yield _start
    for server in servers:
        await server.close()


@AUTH_ONLY
async def test_blocks_of_every_size_arrive_byte_exact_over_mutual_tls(  # type: ignore[no-untyped-def]
    start, pki: Pki, auth_only: bool
) -> None:
    blocks = {1000 + i: payload(1000 + i, size) for i, size in enumerate(SIZES)}
    blocks |= {2000 + i: payload(2000 + i, 32 << 10) for i in range(40)}  # small: coalesced
    source = MemorySource(blocks)
    server = await start(source, tls_auth_only=auth_only)
    assert server.tls_auth_only is auth_only
    tls = client_ctx(tls_of(pki), auth_only)
    ticket = server.issue_ticket("layout-a", [*blocks, 7, 8], ttl_s=10)
    sink = Sink()
    result = await fetch(server, ticket, sink, **tls)
    assert [b.block_hash for b in sink.got] == list(blocks)
    sink.check(blocks)
    assert result.missing == (7, 8) and result.bytes == sum(map(len, blocks.values()))
    # Received as bytes (allocate=None), the other receive path.
    got: list[bytes] = []
    ticket = server.issue_ticket("layout-a", list(blocks), ttl_s=10)
    await fetch_blocks(
        server.host,
        server.port,
        ticket,
        on_block=lambda b: got.append(b.payload()),
        deadline_s=10,
        allocate=None,
        **tls,  # type: ignore[arg-type]
    )
    assert got == list(blocks.values())
    await source.settled()
    assert server.stats.tls_failed == 0


async def test_a_pause_the_window_and_a_cancel_over_tls(start, pki: Pki) -> None:  # type: ignore[no-untyped-def]
    tls = client_ctx(tls_of(pki))
    blocks = {h: payload(h, 10_000) for h in range(1, 7)}
    go = asyncio.Event()

    class PauseAt3(MemorySource):
        async def pin(self, layout_key: str, block_hash: BlockHash) -> PinnedBlock | None:
            if block_hash == 4:
                await go.wait()
            return await super().pin(layout_key, block_hash)

    server = await start(PauseAt3(blocks))
    sink = Sink()
    ticket = server.issue_ticket("layout-a", list(blocks), ttl_s=10)
    task = asyncio.create_task(fetch(server, ticket, sink, window_bytes=64 << 20, **tls))
    await sink.wait_for(3)  # delivered while the peer pauses
    assert not task.done()
    go.set()
    assert (await task).delivered == 6
    sink.check(blocks)

    big = {h: payload(h, 1 << 20) for h in range(1, 65)}
    source = MemorySource(big)
    server = await start(source, stall_timeout_s=1.0)
    slow = Sink(delay_s=0.01)
    ticket = server.issue_ticket("layout-a", list(big))
    task = asyncio.create_task(fetch(server, ticket, slow, window_bytes=4 << 20, **tls))
    await slow.wait_for(3)
    assert slow.max_unconsumed <= 5
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await source.settled()
    await eventually(lambda: server.stats.aborted == 1)


async def test_server_close_breaks_a_tls_stream_in_flight(start, pki: Pki) -> None:  # type: ignore[no-untyped-def]
    blocks = {h: payload(h, 1 << 20) for h in range(1, 65)}
    source = MemorySource(blocks)
    server = await start(source)
    sink = Sink(delay_s=0.01)
    ticket = server.issue_ticket("layout-a", list(blocks))
    task = asyncio.create_task(fetch(server, ticket, sink, **client_ctx(tls_of(pki))))
    await sink.wait_for(2)
    await server.close()
    with pytest.raises(StreamBroken) as info:
        await task
    assert 2 <= info.value.delivered < 64
    sink.check(blocks)
    assert source.pins == source.releases


@AUTH_ONLY
@pytest.mark.parametrize(
    ("who", "message"),
    [
        # TLS 1.3: the client's handshake ends before the server checks its certificate, so
        # it reads the server's alert, or (when the server closed first) an EOF or a reset.
        ("no-certificate", "TLS with .* failed|stream from .* broke"),
        ("other-ca-certificate", "TLS with .* failed|stream from .* broke"),
        ("trusts-other-ca", "TLS with .* failed: .*certificate verify failed"),
        ("plaintext", "stream from .* broke|peer closed"),  # reset or closed by the server
    ],
)
async def test_strangers_are_refused_and_the_server_goes_on(  # type: ignore[no-untyped-def]
    start, pki: Pki, other_pki: Pki, who: str, message: str, auth_only: bool
) -> None:
    blocks = {1: payload(1, 100_000)}
    server = await start(MemorySource(blocks), request_timeout_s=2.0, tls_auth_only=auth_only)
    tls = {
        "no-certificate": tls_of(pki, cert=False),
        "other-ca-certificate": TlsConfig(
            cert_file=other_pki.node.cert_file,
            key_file=other_pki.node.key_file,
            ca_file=pki.ca_file,
        ).load(),
        "trusts-other-ca": tls_of(other_pki),
        "plaintext": None,
    }[who]
    ticket = server.issue_ticket("layout-a", [1], ttl_s=10)
    sink = Sink()
    began = time.monotonic()
    with pytest.raises(PeerFetchError, match=message) as info:
        await fetch(server, ticket, sink, **client_ctx(tls, auth_only))
    assert time.monotonic() - began < 1.5, "refused, not timed out"
    assert info.value.delivered == 0 and sink.got == []
    await eventually(lambda: server.stats.tls_failed == 1)
    assert server.stats.streams == 0  # the ticket was never redeemed: still good for the mesh
    sink = Sink()
    await fetch(server, ticket, sink, **client_ctx(tls_of(pki), auth_only))
    sink.check(blocks)


@AUTH_ONLY
async def test_a_wrong_or_spent_ticket_is_refused_over_tls(  # type: ignore[no-untyped-def]
    start, pki: Pki, auth_only: bool
) -> None:
    """A peer of the mesh (a valid certificate) with a ticket this server did not issue, or
    one already redeemed, gets the refusal in the stream header and not a byte of a block."""
    blocks = {1: payload(1, 100_000), 2: payload(2, 100_000)}
    server = await start(MemorySource(blocks), tls_auth_only=auth_only)
    tls = client_ctx(tls_of(pki), auth_only)
    good = server.issue_ticket("layout-a", [1, 2], ttl_s=10)
    forged = dataclasses.replace(good, token=bytes(a ^ 0xFF for a in good.token))
    sink = Sink()
    with pytest.raises(TicketRefused) as info:
        await fetch(server, forged, sink, **tls)
    assert info.value.status is Status.UNKNOWN_TICKET and sink.got == []
    await fetch(server, good, sink, **tls)
    sink.check(blocks)
    with pytest.raises(TicketRefused):  # single use
        await fetch(server, good, Sink(), **tls)
    assert server.stats.streams == 1 and server.stats.refused == 2
    assert server.stats.tls_failed == 0


async def test_a_tls_client_to_a_plaintext_data_plane_fails_cleanly(start, pki: Pki) -> None:  # type: ignore[no-untyped-def]
    server = await start(MemorySource({1: b"x"}), tls=False)
    began = time.monotonic()
    with pytest.raises(StreamBroken, match=r"TLS with .* failed"):
        await fetch(server, server.issue_ticket("layout-a", [1]), Sink(), **client_ctx(tls_of(pki)))
    assert time.monotonic() - began < 1.5


@pytest.mark.parametrize("security", list(DataPlaneSecurity))
async def test_two_kvmanagers_fetch_from_each_other_over_tls(
    pki: Pki, security: DataPlaneSecurity
) -> None:
    """FetchFromPeer end to end: OpenFetch over mutual-TLS gRPC, the blocks over the TLS data
    plane (the holder with --data-plane-security auth: TLS for the ticket, then plaintext;
    plain: no TLS on it; the fetcher follows what the holder's OpenFetch answer says), into the
    fetcher's CPU tier, byte-exact."""
    tls_cfg = TlsConfig(
        cert_file=pki.node.cert_file, key_file=pki.node.key_file, ca_file=pki.ca_file
    )

    def config(name: str) -> KvManagerConfig:
        return KvManagerConfig(
            kvmanager_id=name,
            node=name,
            etcd_endpoints=(),
            store=StoreConfig(cpu_bytes=64 << 20),
            peer=PeerConfig(data_plane_port=0, data_plane_security=security),
            metrics_port=-1,
            drain_grace_s=0.5,
            tls=tls_cfg,
        )

    layout = kvmanager_pb2.KvLayout(
        model="tls", block_size=16, num_layers=4, num_kv_heads=4, head_size=128, dtype="float32"
    )  # 256 KiB blocks
    size = 2 * 4 * 16 * 4 * 128 * 4
    data = {h: payload(h, size) for h in range(1, 33)}
    a, b = await start_kvmanager(config("kvm-a")), await start_kvmanager(config("kvm-b"))
    tls = tls_cfg.load()
    try:
        assert a.data_plane is not None
        assert a.data_plane.tls is (security is not DataPlaneSecurity.PLAIN)
        assert a.data_plane.tls_auth_only is (security is DataPlaneSecurity.AUTH)
        async with open_channel(a.address, tls) as ca, open_channel(b.address, tls) as cb:
            sa, sb = kvmanager_pb2_grpc.KvManagerStub(ca), kvmanager_pb2_grpc.KvManagerStub(cb)
            got = await put_fetch_read(sa, sb, layout, data, a.address)
        assert got == list(data.values())
        assert a.data_plane.stats.blocks_sent == len(data) and a.data_plane.stats.tls_failed == 0
        # A plaintext caller cannot even ask.
        async with grpc.aio.insecure_channel(b.address) as plain:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await kvmanager_pb2_grpc.KvManagerStub(plain).GetInfo(
                    kvmanager_pb2.KvManagerInfoRequest(), timeout=5
                )
        assert err.value.code() is grpc.StatusCode.UNAVAILABLE
    finally:
        await b.stop()
        await a.stop()


def test_contexts(pki: Pki) -> None:
    assert tls_of(pki).server_ssl_context().verify_mode is ssl.CERT_REQUIRED


async def put_fetch_read(
    sa: kvmanager_pb2_grpc.KvManagerStub,
    sb: kvmanager_pb2_grpc.KvManagerStub,
    layout: kvmanager_pb2.KvLayout,
    data: dict[int, bytes],
    peer_address: str,
) -> list[bytes]:
    """Stores ``data`` on kvmanager A, has B fetch all of it from A (its data plane), and
    returns what B then serves, in order."""
    put = kvmanager_pb2.PutBlocksRequest(
        layout=layout,
        blocks=[kvmanager_pb2.KvBlock(block_hash=h, data=d) for h, d in data.items()],
    )
    assert (await sa.PutBlocks(iter([put]), timeout=10)).stored == len(data)
    resp = await sb.FetchFromPeer(
        kvmanager_pb2.FetchFromPeerRequest(
            layout=layout, block_hashes=list(data), peer_address=peer_address
        ),
        timeout=20,
    )
    assert resp.fetched == len(data)
    return [
        m.block.data
        async for m in sb.GetBlocks(
            kvmanager_pb2.GetBlocksRequest(layout=layout, block_hashes=list(data)), timeout=10
        )
    ]
