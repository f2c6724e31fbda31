"""Peer fetch between two real kvmanager daemons on loopback (and a real etcd for finding a peer
by id): B fetches from A what it lacks (FetchFromPeer: OpenFetch on A, then A's data plane) and
then serves it byte-identical from its own CPU tier, with tier events; held blocks are skipped;
bad requests and unknown peers get the right status; a peer that stalls, runs out of the
deadline or is killed mid-stream leaves B holding only whole verified blocks; tickets are
single-use."""

from __future__ import annotations

import asyncio
import inspect
import signal
import sys
import textwrap
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import grpc
import pytest

from kvmesh.discovery.keys import KvManagerRecord, kvmanager_key
from kvmesh.kv.events import BlockHash, BlockStored, Tier
from kvmesh.kv_wire import kv_batch_from_pb, layout_from_pb
from kvmesh.v1 import kvmanager_pb2, kvmanager_pb2_grpc, worker_pb2
from services.kvmanager.config import KvManagerConfig, PeerConfig
from services.kvmanager.core.config import StoreConfig
from services.kvmanager.main import RunningKvManager, parse_args, start_kvmanager
from services.kvmanager.peer.client import TicketRefused, fetch_blocks
from services.kvmanager.peer.core import Ticket
from services.kvmanager.peer.server import BlockSource, PinnedBlock
from services.kvmanager.peer.wire import Status
from services.kvmanager.servicer import FETCHED_KEY
from tests.support import eventually

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]

ROOT = Path(__file__).resolve().parents[2]
LAYOUT = kvmanager_pb2.KvLayout(
    model="tiny", block_size=32, num_layers=2, num_kv_heads=2, head_size=32, dtype="float32"
)
BLOCK_BYTES = layout_from_pb(LAYOUT).block_bytes  # 32 KiB
MiB = 1 << 20


def payload(h: int, size: int = BLOCK_BYTES) -> bytes:
    """Distinct bytes per block (a block stored under the wrong hash is caught)."""
    return (h.to_bytes(8, "little") + b"kvmesh!!") * (size // 16)


Stub = kvmanager_pb2_grpc.KvManagerStub
Start = Callable[..., Awaitable[tuple[RunningKvManager, Stub]]]


@pytest.fixture
async def daemons() -> AsyncIterator[Start]:
    """Starts in-process kvmanagers (no etcd unless given); all are stopped after the test."""
    started: list[tuple[RunningKvManager, grpc.aio.Channel]] = []

    async def start(
        name: str,
        *,
        cpu_bytes: int = 64 * BLOCK_BYTES,
        peer: PeerConfig | None = None,
        wrap_source: Callable[[BlockSource], BlockSource] | None = None,
        **config: object,
    ) -> tuple[RunningKvManager, Stub]:
        config.setdefault("etcd_endpoints", ())
        cfg = KvManagerConfig(
            kvmanager_id=name,
            node=name,
            store=StoreConfig(cpu_bytes=cpu_bytes),
            peer=peer or PeerConfig(),
            metrics_port=-1,
            drain_grace_s=0.5,
            **config,  # type: ignore[arg-type]
        )
        running = await start_kvmanager(cfg, wrap_source=wrap_source)
        channel = grpc.aio.insecure_channel(running.address)
        started.append((running, channel))
        return running, Stub(channel)

    yield start
    for running, channel in reversed(started):
        await channel.close()
        await running.stop()


async def put(stub: Stub, hashes: list[int], parent: int | None = None) -> None:
    blocks = []
    for h in hashes:
        b = kvmanager_pb2.KvBlock(block_hash=h, data=payload(h))
        if parent is not None:
            b.parent_hash = parent
        blocks.append(b)
        parent = h

    async def gen() -> AsyncIterator[kvmanager_pb2.PutBlocksRequest]:
        yield kvmanager_pb2.PutBlocksRequest(layout=LAYOUT, blocks=blocks)

    assert (await stub.PutBlocks(gen(), timeout=10)).stored == len(hashes)


def fetch_request(hashes: list[int], **peer: str) -> kvmanager_pb2.FetchFromPeerRequest:
    return kvmanager_pb2.FetchFromPeerRequest(layout=LAYOUT, block_hashes=hashes, **peer)


async def lookup(stub: Stub, hashes: list[int], layout=LAYOUT) -> list[int]:
    resp = await stub.Lookup(
        kvmanager_pb2.LookupRequest(layout=layout, block_hashes=hashes), timeout=5
    )
    return list(resp.tiers)


async def get_bytes(stub: Stub, hashes: list[int], layout=LAYOUT) -> dict[int, tuple[bytes, int]]:
    call = stub.GetBlocks(
        kvmanager_pb2.GetBlocksRequest(layout=layout, block_hashes=hashes), timeout=10
    )
    out = {}
    async for m in call:
        assert not m.HasField("missing"), f"block {m.missing} missing"
        out[m.block.block_hash] = (m.block.data, m.tier)
    return out


async def rpc_error(call: Awaitable[object]) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await call
    return err.value


def trailer(metadata: object) -> int:
    """Blocks fetched, from FetchFromPeer's trailing metadata."""
    return int({k: v for k, v in metadata or ()}[FETCHED_KEY])  # type: ignore[attr-defined]


def fetched_trailer(err: grpc.aio.AioRpcError) -> int:
    return trailer(err.trailing_metadata())


# -- the happy path


async def test_fetched_blocks_are_served_byte_identical_with_cpu_tier_events(daemons) -> None:
    a, stub_a = await daemons("node-a")
    b, stub_b = await daemons("node-b")
    hashes = list(range(1, 9))
    await put(stub_a, hashes, parent=999)
    watch = stub_b.WatchKvEvents(
        kvmanager_pb2.KvManagerWatchKvEventsRequest(layout=LAYOUT), timeout=30
    )
    events = aiter(watch)
    assert kv_batch_from_pb(await anext(events)).snapshot  # empty: B holds nothing yet

    call = stub_b.FetchFromPeer(fetch_request(hashes, peer_address=a.address), timeout=10)
    resp = await call
    assert (resp.fetched, resp.already_held, resp.peer_missing) == (8, 0, 0)
    assert resp.bytes == 8 * BLOCK_BYTES and resp.prefix_blocks == 8 and resp.seconds > 0
    assert trailer(await call.trailing_metadata()) == 8

    got = await get_bytes(stub_b, hashes)
    assert {h: data for h, (data, _) in got.items()} == {h: payload(h) for h in hashes}
    assert {tier for _, tier in got.values()} == {worker_pb2.KV_TIER_CPU}
    stored: list[tuple[int, int | None]] = []
    while len(stored) < 8:
        batch = kv_batch_from_pb(await asyncio.wait_for(anext(events), 5))
        for e in batch.events:
            assert isinstance(e, BlockStored) and e.tier is Tier.CPU
            parent = e.parent_hash
            for h in e.block_hashes:
                stored.append((h, parent))
                parent = BlockHash(h)
    watch.cancel()
    # The chain's parents as A held them: the first block's parent came from A's OpenFetch.
    assert stored == list(zip(hashes, [999, *hashes[:-1]], strict=True))
    assert a.data_plane is not None
    # A counts a batch as sent when its loop hears back from the send thread: maybe just after
    # B has stored it all.
    await eventually(lambda: a.data_plane is not None and a.data_plane.stats.blocks_sent == 8)
    info = await stub_b.GetInfo(kvmanager_pb2.KvManagerInfoRequest(), timeout=5)
    assert info.data_plane_address == b.data_plane_address != ""
    assert b.peers.stats.blocks_fetched == 8 and a.peers.stats.tickets_issued == 1


async def test_held_blocks_are_skipped_and_only_what_the_peer_holds_is_fetched(daemons) -> None:
    a, stub_a = await daemons("node-a")
    _, stub_b = await daemons("node-b")
    await put(stub_a, [1, 2, 3, 4, 5, 6])
    await put(stub_b, [1, 2])
    await put(stub_b, [5], parent=4)
    resp = await stub_b.FetchFromPeer(
        fetch_request([1, 2, 3, 4, 5, 6], peer_address=a.address), timeout=10
    )
    assert (resp.fetched, resp.already_held, resp.prefix_blocks) == (3, 3, 6)
    assert a.data_plane is not None
    dp = a.data_plane
    await eventually(lambda: dp.stats.blocks_sent == 3)  # only 3, 4, 6 moved
    # A holds 1..6 only: 7 and 8 are not granted; nothing is fetched twice.
    resp = await stub_b.FetchFromPeer(
        fetch_request(list(range(1, 9)), peer_address=a.address), timeout=10
    )
    assert (resp.fetched, resp.already_held, resp.peer_missing, resp.prefix_blocks) == (0, 6, 2, 6)
    assert a.data_plane.stats.blocks_sent == 3
    assert await lookup(stub_b, list(range(1, 9))) == [worker_pb2.KV_TIER_CPU] * 6


async def test_peer_found_by_kvmanager_id_through_etcd(daemons, etcd, etcd_client) -> None:
    cluster = f"peer{time.monotonic_ns() % 10**9}"
    endpoints = tuple(etcd.endpoints)
    a, stub_a = await daemons("node-a", cluster=cluster, etcd_endpoints=endpoints)
    _, stub_b = await daemons("node-b", cluster=cluster, etcd_endpoints=endpoints)
    raw = await etcd_client.get(kvmanager_key(cluster, "node-a").encode())
    record = KvManagerRecord.from_json(raw.value)
    assert record.data_plane_address == a.data_plane_address != ""
    await put(stub_a, [11, 12, 13])
    resp = await stub_b.FetchFromPeer(
        fetch_request([11, 12, 13], peer_kvmanager_id="node-a"), timeout=10
    )
    assert resp.fetched == 3
    err = await rpc_error(
        stub_b.FetchFromPeer(fetch_request([11], peer_kvmanager_id="node-z"), timeout=10)
    )
    assert err.code() is grpc.StatusCode.NOT_FOUND and "node-z" in (err.details() or "")


# -- refusals


async def test_unknown_unreachable_or_self_peer(daemons) -> None:
    b, stub_b = await daemons("node-b")
    err = await rpc_error(
        stub_b.FetchFromPeer(fetch_request([1], peer_kvmanager_id="node-a"), timeout=5)
    )
    assert err.code() is grpc.StatusCode.NOT_FOUND and "without etcd" in (err.details() or "")
    err = await rpc_error(stub_b.FetchFromPeer(fetch_request([1]), timeout=5))
    assert err.code() is grpc.StatusCode.INVALID_ARGUMENT and "peer" in (err.details() or "")
    err = await rpc_error(
        stub_b.FetchFromPeer(fetch_request([1], peer_address=b.address), timeout=5)
    )
    assert err.code() is grpc.StatusCode.INVALID_ARGUMENT and "this kvmanager" in (
        err.details() or ""
    )
    err = await rpc_error(
        stub_b.FetchFromPeer(fetch_request([1], peer_address="127.0.0.1:1"), timeout=5)
    )
    assert err.code() is grpc.StatusCode.UNAVAILABLE
    assert "no block fetched" in (err.details() or "") and fetched_trailer(err) == 0


@pytest.mark.parametrize(
    ("layout", "match"),
    [
        pytest.param(kvmanager_pb2.KvLayout(block_size=32, num_layers=2, num_kv_heads=2,
                                            head_size=32, dtype="float32"), "model", id="no-model"),
        pytest.param(kvmanager_pb2.KvLayout(model="tiny", block_size=32, num_layers=2,
                                            num_kv_heads=2, head_size=32, dtype="float31"),
                     "dtype", id="bad-dtype"),
    ],
)  # fmt: skip
async def test_bad_layout_is_invalid_argument(daemons, layout, match) -> None:
    a, stub_a = await daemons("node-a")
    _, stub_b = await daemons("node-b")
    req = kvmanager_pb2.FetchFromPeerRequest(
        layout=layout, block_hashes=[1], peer_address=a.address
    )
    err = await rpc_error(stub_b.FetchFromPeer(req, timeout=5))
    assert err.code() is grpc.StatusCode.INVALID_ARGUMENT and match in (err.details() or "")
    err = await rpc_error(
        stub_a.OpenFetch(kvmanager_pb2.OpenFetchRequest(layout=layout, block_hashes=[1]), timeout=5)
    )
    assert err.code() is grpc.StatusCode.INVALID_ARGUMENT
    err = await rpc_error(
        stub_a.OpenFetch(
            kvmanager_pb2.OpenFetchRequest(layout_key="not-a-key", block_hashes=[1]), timeout=5
        )
    )
    assert err.code() is grpc.StatusCode.INVALID_ARGUMENT and "layout key" in (err.details() or "")


async def test_data_plane_off(daemons) -> None:
    a, stub_a = await daemons("node-a", peer=PeerConfig(data_plane_port=-1))
    _, stub_b = await daemons("node-b")
    assert a.data_plane is None and a.data_plane_address == ""
    info = await stub_a.GetInfo(kvmanager_pb2.KvManagerInfoRequest(), timeout=5)
    assert info.data_plane_address == ""
    await put(stub_a, [1])
    err = await rpc_error(
        stub_b.FetchFromPeer(fetch_request([1], peer_address=a.address), timeout=5)
    )
    assert err.code() is grpc.StatusCode.UNAVAILABLE and "data plane" in (err.details() or "")


async def test_tickets_are_single_use(daemons) -> None:
    _, stub_a = await daemons("node-a")
    await put(stub_a, [1, 2, 3], parent=7)
    key = layout_from_pb(LAYOUT).key
    grant = await stub_a.OpenFetch(
        kvmanager_pb2.OpenFetchRequest(layout_key=key, block_hashes=[1, 2, 3, 4, 1]), timeout=5
    )
    assert list(grant.block_hashes) == [1, 2, 3] and grant.parent_hash == 7  # the leading run
    assert grant.layout_key == key and grant.ttl_s > 0 and len(grant.token) == 16
    none = await stub_a.OpenFetch(
        kvmanager_pb2.OpenFetchRequest(layout=LAYOUT, block_hashes=[4, 1]), timeout=5
    )
    assert list(none.block_hashes) == [] and none.token == b""
    host, port = grant.data_plane_address.rsplit(":", 1)
    ticket = Ticket(grant.token, key, tuple(BlockHash(h) for h in grant.block_hashes), 0)
    got: list[bytes] = []
    result = await fetch_blocks(
        host, int(port), ticket, on_block=lambda blk: got.append(bytes(blk.data)), deadline_s=5
    )
    assert result.delivered == 3 and got == [payload(h) for h in (1, 2, 3)]
    with pytest.raises(TicketRefused) as refused:
        await fetch_blocks(host, int(port), ticket, on_block=lambda blk: None, deadline_s=5)
    assert refused.value.status is Status.UNKNOWN_TICKET


# -- a peer that stalls, runs out of time, or dies mid-stream


class StallAfter:
    """Wraps A's block source: serves ``after`` blocks, then waits for ``go`` (a stalled peer)."""

    def __init__(self, after: int) -> None:
        self.after = after
        self.served = 0
        self.go = asyncio.Event()
        self.inner: BlockSource | None = None

    def wrap(self, inner: BlockSource) -> BlockSource:
        self.inner = inner
        return self

    async def pin(self, layout_key: str, block_hash: BlockHash) -> PinnedBlock | None:
        if self.served >= self.after:
            await self.go.wait()
        self.served += 1
        assert self.inner is not None
        got = self.inner.pin(layout_key, block_hash)
        return await got if inspect.isawaitable(got) else got


async def holds_exactly(stub: Stub, hashes: list[int], n: int) -> None:
    """B holds the first ``n`` blocks, byte-identical, and none of the others (nothing partial)."""
    assert await lookup(stub, hashes) == [worker_pb2.KV_TIER_CPU] * n
    got = await get_bytes(stub, hashes[:n])
    assert {h: data for h, (data, _) in got.items()} == {h: payload(h) for h in hashes[:n]}
    for h in hashes[n:]:
        assert await lookup(stub, [h]) == []
    info = await stub.GetInfo(kvmanager_pb2.KvManagerInfoRequest(), timeout=5)
    assert {t.tier: t.blocks for t in info.tiers}[worker_pb2.KV_TIER_CPU] == n


@pytest.mark.parametrize("case", ["stall", "deadline"])
async def test_peer_stalling_mid_stream_leaves_only_whole_verified_blocks(daemons, case) -> None:
    stall = StallAfter(5)
    a, stub_a = await daemons("node-a", wrap_source=stall.wrap)
    stall_s = 0.5 if case == "stall" else 30.0
    b, stub_b = await daemons("node-b", peer=PeerConfig(stall_timeout_s=stall_s))
    hashes = list(range(100, 120))
    await put(stub_a, hashes)
    started = time.monotonic()
    err = await rpc_error(
        stub_b.FetchFromPeer(fetch_request(hashes, peer_address=a.address), timeout=3)
    )
    elapsed = time.monotonic() - started
    details = err.details() or ""
    if case == "stall":
        assert err.code() is grpc.StatusCode.UNAVAILABLE and "FetchStalled" in details
        assert elapsed < 2.5
    else:  # B answers before the caller's deadline, saying what it got
        assert err.code() is grpc.StatusCode.DEADLINE_EXCEEDED
        assert "deadline" in details and 2.0 < elapsed < 3.1
    assert "after 5 of 20 blocks" in details, details
    assert fetched_trailer(err) == 5
    await holds_exactly(stub_b, hashes, 5)
    # What arrived before it ended is the link's measured speed (one slow call is a sample):
    # B's rate for fetches from A, as it will publish it for the routers (peer_s_per_token).
    layout_key = layout_from_pb(LAYOUT).key
    link = b.servicer.rates.peer_snapshot()[a.address][layout_key]
    assert link == pytest.approx(elapsed / (5 * 32), rel=0.25), (link, elapsed)
    assert b.servicer.rates.snapshot()[layout_key]["peer"] == link
    stall.go.set()
    assert a.data_plane is not None
    await eventually(lambda: a.store.usage(Tier.CPU).pinned == 0)  # A released what it pinned


KILLED_CHILD = textwrap.dedent(
    """
    import asyncio
    import inspect
    from services.kvmanager.config import KvManagerConfig
    from kvmesh.kv_wire import layout_from_pb
    from services.kvmanager.core.config import StoreConfig
    from services.kvmanager.main import start_kvmanager
    from tests.integration.test_kvmanager_peer import BIG_LAYOUT, payload

    class Slow:  # after the first blocks, slow enough to be killed mid-stream
        def __init__(self, inner):
            self.inner = inner
        async def pin(self, layout_key, block_hash):
            if block_hash >= 1006:
                await asyncio.sleep(0.05)
            got = self.inner.pin(layout_key, block_hash)
            return await got if inspect.isawaitable(got) else got

    async def main():
        layout = layout_from_pb(BIG_LAYOUT)
        config = KvManagerConfig(kvmanager_id="victim", node="victim", etcd_endpoints=(),
                                 metrics_port=-1, store=StoreConfig(cpu_bytes=256 << 20))
        running = await start_kvmanager(config, wrap_source=Slow)
        parent = None
        for h in range(1000, 1200):
            await running.store.put(layout, h, payload(h, layout.block_bytes), parent)
            parent = h
        print(running.ready_line(), flush=True)
        await asyncio.Event().wait()

    asyncio.run(main())
    """
)
BIG_LAYOUT = kvmanager_pb2.KvLayout(
    model="big", block_size=16, num_layers=4, num_kv_heads=4, head_size=128, dtype="float32"
)  # 256 KiB blocks


async def test_peer_killed_mid_stream_leaves_only_whole_verified_blocks(daemons) -> None:
    big = layout_from_pb(BIG_LAYOUT)
    hashes = list(range(1000, 1200))
    child = await asyncio.create_subprocess_exec(
        sys.executable, "-c", KILLED_CHILD, cwd=ROOT, stdout=asyncio.subprocess.PIPE
    )
    try:
        assert child.stdout is not None
        line = (await asyncio.wait_for(child.stdout.readline(), 30)).decode()
        address = dict(kv.split("=", 1) for kv in line.split()[1:])["address"]
        _, stub_b = await daemons("node-b", cpu_bytes=256 * MiB)
        req = kvmanager_pb2.FetchFromPeerRequest(
            layout=BIG_LAYOUT, block_hashes=hashes, peer_address=address
        )
        call = asyncio.ensure_future(stub_b.FetchFromPeer(req, timeout=60))
        while len(await lookup(stub_b, hashes, BIG_LAYOUT)) < 8:
            assert not call.done(), call
            await asyncio.sleep(0.01)
        child.send_signal(signal.SIGKILL)
        err = await rpc_error(call)
        assert err.code() is grpc.StatusCode.UNAVAILABLE and "StreamBroken" in (err.details() or "")
        n = fetched_trailer(err)
        assert 8 <= n < 200
        assert await lookup(stub_b, hashes, BIG_LAYOUT) == [worker_pb2.KV_TIER_CPU] * n
        assert await lookup(stub_b, hashes[n : n + 1], BIG_LAYOUT) == []  # nothing partial
        got = await get_bytes(stub_b, hashes[:n], BIG_LAYOUT)
        assert all(data == payload(h, big.block_bytes) for h, (data, _) in got.items())
        assert len(got) == n
    finally:
        if child.returncode is None:
            child.kill()
        await child.wait()


def test_flags() -> None:
    cfg = parse_args(["--data-plane-host", "0.0.0.0", "--data-plane-port", "-1",
                      "--peer-stall-timeout-s", "2", "--peer-fetch-timeout-s", "9"])  # fmt: skip
    assert cfg.peer.data_plane_host == "0.0.0.0" and cfg.peer.data_plane_port == -1
    assert cfg.peer.stall_timeout_s == 2 and cfg.peer.fetch_timeout_s == 9
    assert parse_args([]).peer.data_plane_port == 0
    with pytest.raises(SystemExit):
        parse_args(["--data-plane-port", "-2"])
