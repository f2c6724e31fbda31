"""Kept data plane connections in the ``auth`` mode (``pool.ConnectionPool``), on loopback with
certificates the test made: fetches from one peer reuse one authenticated connection (the
handshakes are counted on both ends), a connection the peer closed while idle or that breaks
when reused is replaced by a fresh one, a peer killed (SIGKILL, a child process) with
connections in the pool fails the next fetch cleanly and fast (the caller recomputes), a
stranger's certificate is still refused, and two kvmanager daemons shake hands once for many
FetchFromPeer calls."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvmesh.tls import TlsConfig, open_channel
from kvmesh.tlsgen import Pki
from kvmesh.v1 import kvmanager_pb2, kvmanager_pb2_grpc
from services.kvmanager.config import KvManagerConfig, PeerConfig
from services.kvmanager.core.config import DataPlaneSecurity, StoreConfig
from services.kvmanager.main import start_kvmanager
from services.kvmanager.peer import pool as pool_mod
from services.kvmanager.peer.client import PeerFetchError, StreamBroken
from services.kvmanager.peer.core import Ticket
from services.kvmanager.peer.pool import ConnectionPool, PoolConfig
from services.kvmanager.peer.server import DataPlaneServer
from tests.support import eventually

from .test_kvmanager_dataplane import MemorySource, Sink, fetch, payload
from .test_kvmanager_dataplane_tls import client_ctx, put_fetch_read, tls_of
from .test_kvmanager_dataplane_tls import start as start  # a fixture

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def pools() -> Iterator[Callable[..., ConnectionPool]]:
    """Pools that are closed (their idle connections with them) after the test."""
    made: list[ConnectionPool] = []

    def _make(config: PoolConfig | None = None) -> ConnectionPool:
        made.append(ConnectionPool(config))
        return made[-1]

    yield _make
    for pool in made:
        pool.close()


def auth(pki: Pki, pool: ConnectionPool | None, *, ca: Pki | None = None) -> dict[str, object]:
    return {**client_ctx(tls_of(pki, ca=ca), auth_only=True), "pool": pool}


async def test_fetches_from_one_peer_share_one_authenticated_connection(
    start, pools, pki: Pki
) -> None:  # type: ignore[no-untyped-def]
    blocks = {h: payload(h, 64 << 10) for h in range(1, 9)}
    server: DataPlaneServer = await start(MemorySource(blocks), tls_auth_only=True)
    pool = pools()
    for _ in range(5):
        sink = Sink()
        await fetch(server, server.issue_ticket("layout-a", list(blocks)), sink, **auth(pki, pool))
        sink.check(blocks)
        assert len(sink.got) == len(blocks)
    assert server.stats.tls_handshakes == 1 and server.stats.kept_requests == 4
    assert pool.stats.handshakes == 1 and pool.stats.reused == 4 and pool.stats.kept == 5
    assert pool.idle() == 1 and server.stats.streams == 5
    # Four at once open (at most) four; afterwards the pool keeps max_idle_per_peer of them.
    sinks = [Sink() for _ in range(4)]
    await asyncio.gather(
        *(
            fetch(server, server.issue_ticket("layout-a", list(blocks)), s, **auth(pki, pool))
            for s in sinks
        )
    )
    for s in sinks:
        s.check(blocks)
    assert server.stats.tls_handshakes <= 4 and pool.idle() <= 4
    # Without a pool every fetch shakes hands: the baseline the pool removes.
    before = server.stats.tls_handshakes
    for _ in range(3):
        await fetch(server, server.issue_ticket("layout-a", [1]), Sink(), **auth(pki, None))
    assert server.stats.tls_handshakes == before + 3


async def test_a_spent_ticket_on_a_kept_connection_is_refused_and_not_kept(  # type: ignore[no-untyped-def]
    start, pools, pki: Pki
) -> None:
    blocks = {1: payload(1, 1000)}
    server = await start(MemorySource(blocks), tls_auth_only=True)
    pool = pools()
    ticket = server.issue_ticket("layout-a", [1])
    await fetch(server, ticket, Sink(), **auth(pki, pool))
    with pytest.raises(PeerFetchError, match="UNKNOWN_TICKET"):
        await fetch(server, ticket, Sink(), **auth(pki, pool))  # on the kept connection
    assert pool.stats.reused == 1 and pool.idle() == 0  # a refusal closes it
    sink = Sink()
    await fetch(server, server.issue_ticket("layout-a", [1]), sink, **auth(pki, pool))
    sink.check(blocks)
    assert server.stats.tls_handshakes == 2


async def test_a_connection_closed_while_idle_or_broken_on_reuse_is_replaced(  # type: ignore[no-untyped-def]
    start, pools, pki: Pki, monkeypatch: pytest.MonkeyPatch
) -> None:
    blocks = {h: payload(h, 10_000) for h in range(1, 4)}
    server = await start(MemorySource(blocks), tls_auth_only=True, keepalive_idle_s=0.2)
    pool = pools(PoolConfig(idle_timeout_s=30))
    await fetch(server, server.issue_ticket("layout-a", list(blocks)), Sink(), **auth(pki, pool))
    await asyncio.sleep(0.5)  # the server's keep-alive ran out: it closed its end
    sink = Sink()
    await fetch(server, server.issue_ticket("layout-a", list(blocks)), sink, **auth(pki, pool))
    sink.check(blocks)
    assert pool.stats.broken == 1 and pool.stats.reused == 0 and server.stats.tls_handshakes == 2

    # The same, but the check on taking it is fooled: it breaks on the request instead, and the
    # fetch goes on over a fresh connection (the ticket was never read, so it is still good).
    await asyncio.sleep(0.5)
    monkeypatch.setattr(pool_mod, "healthy", lambda sock: True)
    sink = Sink()
    await fetch(server, server.issue_ticket("layout-a", list(blocks)), sink, **auth(pki, pool))
    sink.check(blocks)
    assert pool.stats.reused == 1 and pool.stats.broken == 2
    assert server.stats.tls_handshakes == 3

    # Idle past the client's own timeout: closed, not used.
    short = pools(PoolConfig(idle_timeout_s=0.05))
    await fetch(server, server.issue_ticket("layout-a", [1]), Sink(), **auth(pki, short))
    await asyncio.sleep(0.1)
    await fetch(server, server.issue_ticket("layout-a", [1]), Sink(), **auth(pki, short))
    assert short.stats.expired == 1 and short.stats.handshakes == 2


async def test_a_stranger_is_still_refused_and_nothing_is_pooled(  # type: ignore[no-untyped-def]
    start, pools, pki: Pki, other_pki: Pki
) -> None:
    server = await start(MemorySource({1: payload(1, 1000)}), tls_auth_only=True)
    pool = pools()
    ticket = server.issue_ticket("layout-a", [1])
    began = time.monotonic()
    with pytest.raises(StreamBroken, match=r"TLS with .* failed"):
        await fetch(server, ticket, Sink(), **auth(other_pki, pool))  # a foreign CA's cert
    assert time.monotonic() - began < 2.0
    await eventually(lambda: server.stats.tls_failed == 1, what="the server saw the failure")
    assert pool.idle() == 0 and server.stats.streams == 0
    # A mesh member's pooled connection is not a way in for a stranger: keys carry the name
    # checked, and a stranger never gets a connection into the pool in the first place.
    await fetch(server, ticket, Sink(), **auth(pki, pool))  # the ticket was never spent
    assert pool.idle() == 1 and server.stats.tls_handshakes == 1


_CHILD = """
import asyncio, json, sys
from pathlib import Path
from kvmesh.tls import TlsConfig
from services.kvmanager.peer.server import DataPlaneConfig, DataPlaneServer
from tests.integration.test_kvmanager_dataplane import MemorySource, payload

async def main(cert, key, ca):
    tls = TlsConfig(cert_file=Path(cert), key_file=Path(key), ca_file=Path(ca)).load(serving=True)
    blocks = {h: payload(h, 256 << 10) for h in range(1, 9)}
    server = DataPlaneServer(
        MemorySource(blocks, pin_delay_s=0.02),
        DataPlaneConfig(ssl_context=tls.server_ssl_context(), tls_auth_only=True),
    )
    await server.start()
    tickets = [server.issue_ticket("layout-a", list(blocks), 60).token.hex() for _ in range(4)]
    print(json.dumps({"port": server.port, "tickets": tickets}), flush=True)
    await asyncio.sleep(120)

asyncio.run(main(*sys.argv[1:4]))
"""


async def test_a_peer_killed_with_connections_in_the_pool_fails_fetches_cleanly(
    pools, pki: Pki
) -> None:  # type: ignore[no-untyped-def]
    """SIGKILL the serving process: with its connection idle in the pool, the next fetch fails
    at once as a PeerFetchError (nothing delivered: the caller recomputes), and the dead
    connection is not kept; killed in the middle of a stream on a kept connection, the fetch
    delivers only whole verified blocks and fails the same way."""
    blocks = {h: payload(h, 256 << 10) for h in range(1, 9)}

    def spawn() -> tuple[subprocess.Popen[str], int, list[bytes]]:
        proc = subprocess.Popen(
            [sys.executable, "-c", _CHILD, str(pki.node.cert_file), str(pki.node.key_file),
             str(pki.ca_file)],
            stdout=subprocess.PIPE, text=True, cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )  # fmt: skip
        assert proc.stdout is not None
        hello = json.loads(proc.stdout.readline())
        return proc, hello["port"], [bytes.fromhex(t) for t in hello["tickets"]]

    def stop(proc: subprocess.Popen[str]) -> None:
        proc.kill()
        proc.wait(10)
        if proc.stdout is not None:
            proc.stdout.close()

    def ticket(token: bytes) -> Ticket:
        return Ticket(token, "layout-a", tuple(blocks), 0.0)

    pool = pools()
    proc, port, tokens = spawn()
    try:
        for token in tokens[:2]:
            sink = Sink()
            await fetch(("127.0.0.1", port), ticket(token), sink, **auth(pki, pool))
            sink.check(blocks)
        assert pool.stats.handshakes == 1 and pool.stats.reused == 1 and pool.idle() == 1
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        began = time.monotonic()
        sink = Sink()
        with pytest.raises(PeerFetchError) as info:
            await fetch(("127.0.0.1", port), ticket(tokens[2]), sink, **auth(pki, pool))
        assert info.value.delivered == 0 and sink.got == []
        assert time.monotonic() - began < 1.0
        assert pool.stats.broken == 1 and pool.idle() == 0
    finally:
        stop(proc)

    proc, port, tokens = spawn()
    try:
        await fetch(("127.0.0.1", port), ticket(tokens[0]), Sink(), **auth(pki, pool))
        sink = Sink()
        task = asyncio.create_task(
            fetch(("127.0.0.1", port), ticket(tokens[1]), sink, **auth(pki, pool))
        )
        await sink.wait_for(2)  # the blocks come 20 ms apart
        proc.send_signal(signal.SIGKILL)
        with pytest.raises(PeerFetchError) as info:
            await task
        assert 2 <= info.value.delivered < len(blocks)
        sink.check(blocks)  # whole, verified, in order: the rest is recomputed
        assert pool.stats.reused == 2 and pool.idle() == 0
    finally:
        stop(proc)


async def test_two_kvmanagers_in_auth_mode_shake_hands_once(pki: Pki) -> None:
    """FetchFromPeer end to end, several times: the fetcher keeps the holder's authenticated
    data plane connection, so one TLS handshake serves every fetch."""
    tls_cfg = TlsConfig(
        cert_file=pki.node.cert_file, key_file=pki.node.key_file, ca_file=pki.ca_file
    )

    def config(name: str) -> KvManagerConfig:
        return KvManagerConfig(
            kvmanager_id=name,
            node=name,
            etcd_endpoints=(),
            store=StoreConfig(cpu_bytes=64 << 20),
            peer=PeerConfig(data_plane_port=0, data_plane_security=DataPlaneSecurity.AUTH),
            metrics_port=-1,
            drain_grace_s=0.5,
            tls=tls_cfg,
        )

    size = 2 * 4 * 16 * 4 * 128 * 4  # 256 KiB blocks
    a, b = await start_kvmanager(config("kvm-a")), await start_kvmanager(config("kvm-b"))
    tls = tls_cfg.load()
    try:
        assert a.data_plane is not None
        async with open_channel(a.address, tls) as ca, open_channel(b.address, tls) as cb:
            sa, sb = kvmanager_pb2_grpc.KvManagerStub(ca), kvmanager_pb2_grpc.KvManagerStub(cb)
            for round_ in range(4):
                layout = kvmanager_pb2.KvLayout(
                    model=f"pool-{round_}", block_size=16, num_layers=4, num_kv_heads=4,
                    head_size=128, dtype="float32",
                )  # fmt: skip
                data = {h: payload(h, size) for h in range(100 * round_ + 1, 100 * round_ + 9)}
                got = await put_fetch_read(sa, sb, layout, data, a.address)
                assert got == list(data.values())
        assert a.data_plane.stats.tls_handshakes == 1
        assert a.data_plane.stats.kept_requests == 3 and a.data_plane.stats.streams == 4
        assert b.peers.pool.stats.reused == 3
    finally:
        await b.stop()
        await a.stop()
    assert b.peers.pool.idle() == 0  # closed with the daemon
