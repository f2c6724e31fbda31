"""The kvmanager data plane on loopback: a real ``DataPlaneServer`` (and, to break the protocol
on purpose, scripted peers speaking raw bytes) against ``fetch_blocks``.

Every failure case checks the promise to the caller: ``on_block`` saw only whole blocks whose
bytes are right, ``exc.delivered`` says how many, buffers it never saw went to ``discard``, and
the server released every block it pinned."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import textwrap
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from kvmesh.kv.events import BlockHash
from services.kvmanager.peer import wire as w
from services.kvmanager.peer.client import (
    ChecksumMismatch,
    FetchDeadlineExceeded,
    FetchedBlock,
    FetchResult,
    FetchStalled,
    PeerFetchError,
    StreamBroken,
    TicketRefused,
    fetch_blocks,
)
from services.kvmanager.peer.core import Ticket
from services.kvmanager.peer.server import DataPlaneConfig, DataPlaneServer, PinnedBlock
from services.kvmanager.peer.wire import (
    Checksum,
    ChecksumAlgo,
    ChecksumSet,
    FrameHeader,
    FrameKind,
)
from tests.support import eventually

pytestmark = [pytest.mark.integration, pytest.mark.timeout(30)]

HAVE_BLAKE3 = bool(w.available_algos() & ChecksumSet.BLAKE3_64)
ROOT = Path(__file__).resolve().parents[2]


def payload(h: int, size: int) -> bytes:
    """Distinct bytes per block, so a block delivered under the wrong hash is caught."""
    seed = h.to_bytes(8, "little") * 8
    return (seed * (size // len(seed) + 1))[:size]


class MemorySource:
    """A BlockSource over a dict that counts pins and releases and can misbehave on cue."""

    def __init__(
        self,
        blocks: dict[int, bytes],
        *,
        fail_on: int | None = None,
        bad_checksum_on: int | None = None,
        stored: ChecksumAlgo | None = None,
        pin_delay_s: float = 0.0,
    ) -> None:
        self.blocks = blocks
        self.fail_on = fail_on
        self.bad_checksum_on = bad_checksum_on
        self.stored = stored
        self.pin_delay_s = pin_delay_s
        self.pins = 0
        self.releases = 0

    async def pin(self, layout_key: str, block_hash: BlockHash) -> PinnedBlock | None:
        assert layout_key == "layout-a"
        if self.pin_delay_s:
            await asyncio.sleep(self.pin_delay_s)
        if block_hash == self.fail_on:
            raise RuntimeError("simulated disk read failure")
        data = self.blocks.get(block_hash)
        if data is None:
            return None
        known = None
        if block_hash == self.bad_checksum_on:
            known = Checksum(ChecksumAlgo.CRC32, w.checksum(ChecksumAlgo.CRC32, data) ^ 1)
        elif self.stored is not None:
            known = Checksum(self.stored, w.checksum(self.stored, data))
        self.pins += 1
        return PinnedBlock(memoryview(data), known, self._release)

    def _release(self) -> None:
        self.releases += 1

    async def settled(self) -> None:
        """Waits until the server released every pin (its stream may end after the client's)."""
        await eventually(lambda: self.pins == self.releases)


@dataclass
class Sink:
    """on_block / allocate / discard that record what the client did with every buffer."""

    delay_s: float = 0.0
    got: list[FetchedBlock] = field(default_factory=list)
    allocated: int = 0
    offered: int = 0  # calls of on_block: the buffer is on_block's from then on
    discarded: int = 0
    max_unconsumed: int = 0
    _target: int = 0
    _reached: asyncio.Event = field(default_factory=asyncio.Event)

    def allocate(self, size: int) -> bytearray:
        self.allocated += 1
        self.max_unconsumed = max(self.max_unconsumed, self.allocated - self.offered)
        return bytearray(size)

    def discard(self, view: memoryview) -> None:
        self.discarded += 1

    async def on_block(self, block: FetchedBlock) -> None:
        self.offered += 1
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        self.got.append(block)
        if len(self.got) >= self._target:
            self._reached.set()

    async def wait_for(self, n: int) -> None:
        """Returns once on_block has seen ``n`` blocks."""
        self._target = n
        if len(self.got) < n:
            self._reached.clear()
            await asyncio.wait_for(self._reached.wait(), 10)

    def check(self, blocks: dict[int, bytes]) -> None:
        """Every delivered block is whole, right, and in order; nothing else was kept."""
        indexes = [b.index for b in self.got]
        assert indexes == sorted(indexes)
        for b in self.got:
            assert bytes(b.data) == blocks[b.block_hash]
            assert b.checksum.value == w.checksum(b.checksum.algo, blocks[b.block_hash])
        assert self.discarded == self.allocated - self.offered


@pytest.fixture
async def start() -> AsyncIterator[Callable[..., Awaitable[DataPlaneServer]]]:
    servers: list[DataPlaneServer] = []

    async def _start(source: MemorySource, **config: object) -> DataPlaneServer:
        server = DataPlaneServer(source, DataPlaneConfig(**config))  # type: ignore[arg-type]
        await server.start()
        servers.append(server)
        return server

    yield _start
    for server in servers:
        await server.close()


async def fetch(
    server: DataPlaneServer | tuple[str, int], ticket: Ticket, sink: Sink, **kwargs: object
) -> FetchResult:
    host, port = (server.host, server.port) if isinstance(server, DataPlaneServer) else server
    kwargs.setdefault("deadline_s", 10.0)
    return await fetch_blocks(
        host,
        port,
        ticket,
        on_block=sink.on_block,
        allocate=sink.allocate,
        discard=sink.discard,
        **kwargs,  # type: ignore[arg-type]
    )


SIZES = [0, 1, 4095, 64 << 10, (1 << 20) + 7, 3 << 20]


async def test_fetches_blocks_of_every_size_in_order(start) -> None:  # type: ignore[no-untyped-def]
    blocks = {1000 + i: payload(1000 + i, size) for i, size in enumerate(SIZES)}
    source = MemorySource(blocks)
    server = await start(source)
    ticket = server.issue_ticket("layout-a", list(blocks), ttl_s=10)
    sink = Sink()
    result = await fetch(server, ticket, sink)
    assert [b.block_hash for b in sink.got] == list(blocks)
    sink.check(blocks)
    assert result.delivered == len(blocks) and result.missing == ()
    assert result.bytes == sum(SIZES)
    await source.settled()
    assert server.stats.blocks_sent == len(blocks) and server.stats.bytes_sent == sum(SIZES)


async def test_missing_blocks_are_reported_and_the_rest_delivered(start) -> None:  # type: ignore[no-untyped-def]
    blocks = {h: payload(h, 10_000) for h in (1, 3, 5)}
    server = await start(MemorySource(blocks))
    ticket = server.issue_ticket("layout-a", [1, 2, 3, 4, 5, 6], ttl_s=10)
    sink = Sink()
    result = await fetch(server, ticket, sink)
    assert result.missing == (2, 4, 6)
    assert [b.block_hash for b in sink.got] == [1, 3, 5]
    sink.check(blocks)


async def test_a_wrong_or_reused_token_is_refused(start) -> None:  # type: ignore[no-untyped-def]
    blocks = {1: payload(1, 100)}
    server = await start(MemorySource(blocks))
    ticket = server.issue_ticket("layout-a", [1], ttl_s=10)
    forged = Ticket(os.urandom(16), "layout-a", ticket.hashes, ticket.expires_at)
    with pytest.raises(TicketRefused) as info:
        await fetch(server, forged, Sink())
    assert info.value.status is w.Status.UNKNOWN_TICKET
    await fetch(server, ticket, Sink())  # the forgery did not spend the real ticket
    with pytest.raises(TicketRefused, match="UNKNOWN_TICKET"):
        await fetch(server, ticket, Sink())  # single use
    assert server.revoke_ticket(server.issue_ticket("layout-a", [1]).token)


async def test_an_expired_ticket_is_refused(start) -> None:  # type: ignore[no-untyped-def]
    server = await start(MemorySource({1: b"x"}))
    ticket = server.issue_ticket("layout-a", [1], ttl_s=0.05)
    await asyncio.sleep(0.1)
    with pytest.raises(TicketRefused) as info:
        await fetch(server, ticket, Sink())
    assert info.value.status is w.Status.EXPIRED_TICKET


async def test_a_stranger_gets_nothing_and_the_server_goes_on(start) -> None:  # type: ignore[no-untyped-def]
    blocks = {1: payload(1, 1000)}
    server = await start(MemorySource(blocks), request_timeout_s=0.3)
    reader, writer = await asyncio.open_connection(server.host, server.port)
    writer.write(b"GET / HTTP/1.1\r\nHost: xx")  # as long as a request, to be answered
    header = w.unpack_stream_header(await reader.readexactly(w.STREAM_HEADER_SIZE))
    assert header.status is w.Status.BAD_REQUEST
    assert await reader.read() == b""
    writer.close()
    _, silent = await asyncio.open_connection(server.host, server.port)  # says nothing
    ticket = server.issue_ticket("layout-a", [1])
    sink = Sink()
    await fetch(server, ticket, sink)
    sink.check(blocks)
    silent.close()


async def test_source_failure_mid_stream_aborts_after_whole_blocks(start) -> None:  # type: ignore[no-untyped-def]
    blocks = {h: payload(h, 200_000) for h in range(1, 9)}
    source = MemorySource(blocks, fail_on=5)
    server = await start(source)
    sink = Sink()
    with pytest.raises(StreamBroken, match="aborted the stream at block 4") as info:
        await fetch(server, server.issue_ticket("layout-a", list(blocks)), sink)
    assert info.value.delivered == len(sink.got) == 4
    sink.check(blocks)
    await source.settled()
    await eventually(lambda: server.stats.aborted == 1)


async def test_stored_checksum_that_does_not_match_is_caught(start) -> None:  # type: ignore[no-untyped-def]
    blocks = {h: payload(h, 300_000) for h in range(1, 6)}
    source = MemorySource(blocks, bad_checksum_on=3)
    server = await start(source)
    sink = Sink()
    with pytest.raises(ChecksumMismatch, match="block 2") as info:
        await fetch(
            server, server.issue_ticket("layout-a", list(blocks)), sink, accept=ChecksumSet.CRC32
        )
    assert info.value.delivered == 2
    sink.check(blocks)
    assert sink.discarded == 1  # the corrupt block's buffer, never seen by on_block
    await source.settled()


@pytest.mark.skipif(not HAVE_BLAKE3, reason="blake3 is not installed")
async def test_checksum_follows_what_the_client_accepts(start) -> None:  # type: ignore[no-untyped-def]
    blocks = {h: payload(h, 50_000) for h in range(1, 4)}
    server = await start(MemorySource(blocks, stored=ChecksumAlgo.BLAKE3_64))
    for accept, want in [
        (ChecksumSet.CRC32 | ChecksumSet.BLAKE3_64, ChecksumAlgo.BLAKE3_64),  # the store's own
        (ChecksumSet.CRC32, ChecksumAlgo.CRC32),  # computed on send for an older client
    ]:
        sink = Sink()
        await fetch(server, server.issue_ticket("layout-a", list(blocks)), sink, accept=accept)
        assert {b.checksum.algo for b in sink.got} == {want}
        sink.check(blocks)


async def test_backpressure_bounds_what_is_read_ahead(start) -> None:  # type: ignore[no-untyped-def]
    size = 256 << 10
    blocks = {h: payload(h, size) for h in range(1, 41)}
    source = MemorySource(blocks)
    server = await start(source, prefetch_bytes=2 * size, batch_bytes=size)
    sink = Sink(delay_s=0.005)
    await fetch(server, server.issue_ticket("layout-a", list(blocks)), sink, window_bytes=4 * size)
    sink.check(blocks)
    assert len(sink.got) == 40
    assert sink.max_unconsumed <= 5  # the window (4 blocks) plus the one being received
    await source.settled()


async def test_busy_server_refuses_and_keeps_the_ticket(start) -> None:  # type: ignore[no-untyped-def]
    blocks = {h: payload(h, 1 << 20) for h in range(1, 33)}
    server = await start(MemorySource(blocks), max_streams=1)
    slow = Sink(delay_s=0.02)
    first = asyncio.create_task(
        fetch(server, server.issue_ticket("layout-a", list(blocks)), slow, window_bytes=1 << 20)
    )
    await slow.wait_for(1)
    ticket = server.issue_ticket("layout-a", [1])
    with pytest.raises(TicketRefused, match="BUSY"):
        await fetch(server, ticket, Sink())
    await first
    sink = Sink()
    await fetch(server, ticket, sink)  # BUSY did not spend it
    sink.check(blocks)


async def test_cancelled_fetch_stops_and_the_server_releases_its_pins(start) -> None:  # type: ignore[no-untyped-def]
    blocks = {h: payload(h, 1 << 20) for h in range(1, 65)}
    source = MemorySource(blocks)
    server = await start(source, stall_timeout_s=1.0)
    sink = Sink(delay_s=0.01)
    task = asyncio.create_task(fetch(server, server.issue_ticket("layout-a", list(blocks)), sink))
    await sink.wait_for(3)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await source.settled()
    await eventually(lambda: server.stats.aborted == 1)
    await asyncio.sleep(0.05)  # the fetch's thread hands back what it still held
    sink.check(blocks)


async def test_server_close_breaks_streams_in_flight(start) -> None:  # type: ignore[no-untyped-def]
    blocks = {h: payload(h, 1 << 20) for h in range(1, 65)}
    source = MemorySource(blocks)
    server = await start(source)
    sink = Sink(delay_s=0.01)
    task = asyncio.create_task(fetch(server, server.issue_ticket("layout-a", list(blocks)), sink))
    await sink.wait_for(2)
    await server.close()
    with pytest.raises(StreamBroken) as info:
        await task
    assert 2 <= info.value.delivered < 64
    sink.check(blocks)
    assert source.pins == source.releases


# -- scripted peers: raw bytes, to break the stream exactly where a test wants


Script = Callable[[asyncio.StreamWriter], Awaitable[None]]


@pytest.fixture
async def scripted() -> AsyncIterator[Callable[[Script], Awaitable[tuple[str, int]]]]:
    servers: list[asyncio.Server] = []
    tasks: set[asyncio.Task[None]] = set()

    async def _serve(script: Script) -> tuple[str, int]:
        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            tasks.add(asyncio.current_task())  # type: ignore[arg-type]
            await reader.readexactly(w.REQUEST_SIZE)
            try:
                await script(writer)
            finally:
                writer.close()

        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        servers.append(server)
        return "127.0.0.1", server.sockets[0].getsockname()[1]

    yield _serve
    for task in tasks:
        task.cancel()
    for server in servers:
        server.close()


def frame(index: int, h: int, data: bytes, *, corrupt: bool = False) -> bytes:
    value = w.checksum(ChecksumAlgo.CRC32, data)
    hdr = FrameHeader(FrameKind.BLOCK, index, h, len(data), ChecksumAlgo.CRC32, value)
    body = bytes([data[0] ^ 0xFF]) + data[1:] if corrupt else data
    return w.pack_frame_header(hdr) + body


def ok(n: int) -> bytes:
    return w.pack_stream_header(w.StreamHeader(w.Status.OK, n))


SCRIPT_BLOCKS = {h: payload(h, 100_000) for h in (11, 12, 13)}
SCRIPT_TICKET = Ticket(b"t" * 16, "layout-a", (BlockHash(11), BlockHash(12), BlockHash(13)), 0)


async def test_peer_closing_half_way_through_a_block(scripted) -> None:  # type: ignore[no-untyped-def]
    async def script(writer: asyncio.StreamWriter) -> None:
        writer.write(
            ok(3) + frame(0, 11, SCRIPT_BLOCKS[11]) + frame(1, 12, SCRIPT_BLOCKS[12])[:50_000]
        )
        await writer.drain()

    sink = Sink()
    with pytest.raises(StreamBroken, match="short of a frame") as info:
        await fetch(await scripted(script), SCRIPT_TICKET, sink)
    assert info.value.delivered == 1
    await asyncio.sleep(0.05)  # the half-filled buffer reaches discard via the loop
    sink.check(SCRIPT_BLOCKS)
    assert sink.discarded == 1


async def test_corrupted_payload_is_detected(scripted) -> None:  # type: ignore[no-untyped-def]
    async def script(writer: asyncio.StreamWriter) -> None:
        writer.write(
            ok(3) + frame(0, 11, SCRIPT_BLOCKS[11]) + frame(1, 12, SCRIPT_BLOCKS[12], corrupt=True)
        )
        await writer.drain()

    sink = Sink()
    with pytest.raises(ChecksumMismatch) as info:
        await fetch(await scripted(script), SCRIPT_TICKET, sink)
    assert info.value.delivered == 1
    await asyncio.sleep(0.05)
    sink.check(SCRIPT_BLOCKS)


async def test_frames_out_of_order_break_the_stream(scripted) -> None:  # type: ignore[no-untyped-def]
    async def script(writer: asyncio.StreamWriter) -> None:
        writer.write(ok(3) + frame(0, 12, SCRIPT_BLOCKS[12]))
        await writer.drain()

    with pytest.raises(StreamBroken, match="protocol violation"):
        await fetch(await scripted(script), SCRIPT_TICKET, Sink())


@pytest.mark.parametrize(
    "after_bytes", [0, w.STREAM_HEADER_SIZE + 10, w.STREAM_HEADER_SIZE + 40_000]
)
async def test_stalled_peer_is_given_up_within_the_stall_timeout(
    scripted, after_bytes: int
) -> None:  # type: ignore[no-untyped-def]
    stream = ok(3) + frame(0, 11, SCRIPT_BLOCKS[11])

    async def script(writer: asyncio.StreamWriter) -> None:
        writer.write(stream[:after_bytes])
        await writer.drain()
        await asyncio.sleep(10)

    sink = Sink()
    started = time.monotonic()
    with pytest.raises(FetchStalled):
        await fetch(await scripted(script), SCRIPT_TICKET, sink, stall_timeout_s=0.3)
    assert time.monotonic() - started < 1.5
    assert sink.got == []


async def test_a_trickling_peer_hits_the_deadline(scripted) -> None:  # type: ignore[no-untyped-def]
    async def script(writer: asyncio.StreamWriter) -> None:
        writer.write(ok(3))
        for byte in frame(0, 11, SCRIPT_BLOCKS[11]):  # never stalls, never finishes
            writer.write(bytes([byte]))
            await writer.drain()
            await asyncio.sleep(0.05)

    started = time.monotonic()
    with pytest.raises(FetchDeadlineExceeded):
        await fetch(
            await scripted(script), SCRIPT_TICKET, Sink(), deadline_s=0.5, stall_timeout_s=0.3
        )
    assert 0.45 < time.monotonic() - started < 1.5


async def test_bytes_mode_receives_in_place_even_from_a_peer_pausing_mid_block(
    scripted,
) -> None:  # type: ignore[no-untyped-def]
    """``allocate=None``: each block is the ``bytes`` the kernel received into, also when the
    peer pauses mid-block (reassembled); a peer closing mid-block leaves nothing partial."""
    stream = ok(3) + frame(0, 11, SCRIPT_BLOCKS[11]) + frame(1, 12, SCRIPT_BLOCKS[12])
    cut = len(stream) - 30_000

    async def script(writer: asyncio.StreamWriter) -> None:
        writer.write(stream[:cut])
        await writer.drain()
        await asyncio.sleep(0.3)  # past one stall timeout (a partial read), within two
        writer.write(stream[cut:] + frame(2, 13, SCRIPT_BLOCKS[13])[:60_000])
        await writer.drain()

    got: list[bytes] = []

    def on_block(block: FetchedBlock) -> None:
        data = block.payload()
        assert type(data) is bytes and data is block.data.obj  # no copy handed out
        got.append(data)

    with pytest.raises(StreamBroken, match="short of a frame") as info:
        await fetch_blocks(
            *await scripted(script), SCRIPT_TICKET, on_block=on_block, deadline_s=5,
            allocate=None, stall_timeout_s=0.25,
        )  # fmt: skip
    assert info.value.delivered == 2
    assert got == [SCRIPT_BLOCKS[11], SCRIPT_BLOCKS[12]]


async def test_blocks_received_before_a_pause_are_delivered_during_it(start) -> None:  # type: ignore[no-untyped-def]
    """The fetch's thread batches wake-ups of the loop; a peer pausing between frames must not
    hold back the blocks already verified."""
    blocks = {h: payload(h, 10_000) for h in range(1, 7)}
    go = asyncio.Event()

    class PauseAt3(MemorySource):
        async def pin(self, layout_key: str, block_hash: BlockHash) -> PinnedBlock | None:
            if block_hash == 4:
                await go.wait()
            return await super().pin(layout_key, block_hash)

    server = await start(PauseAt3(blocks))
    ticket = server.issue_ticket("layout-a", list(blocks), ttl_s=10)
    sink = Sink()
    task = asyncio.create_task(fetch(server, ticket, sink, window_bytes=64 << 20))
    await sink.wait_for(3)  # while the peer pauses
    assert not task.done()
    go.set()
    result = await task
    assert result.delivered == 6
    sink.check(blocks)


async def test_nobody_listening_is_a_peer_fetch_error() -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, not listening: connections are refused
        with pytest.raises(PeerFetchError):
            await fetch(("127.0.0.1", port), SCRIPT_TICKET, Sink())


# -- a real server process, killed mid-stream

CHILD = textwrap.dedent(
    """
    import asyncio, sys
    from services.kvmanager.peer.server import DataPlaneServer, PinnedBlock

    SIZE = 1 << 20

    class Source:
        async def pin(self, layout_key, block_hash):
            if block_hash > 4:
                await asyncio.sleep(0.05)  # slow after the first blocks: time to kill us
            return PinnedBlock(bytes([block_hash % 251]) * SIZE)

    async def main():
        server = DataPlaneServer(Source())
        await server.start()
        ticket = server.issue_ticket("layout-a", list(range(1, 201)), ttl_s=30)
        print(server.port, ticket.token.hex(), flush=True)
        await asyncio.sleep(60)

    asyncio.run(main())
    """
)


async def test_server_process_killed_mid_stream() -> None:
    child = await asyncio.create_subprocess_exec(
        sys.executable, "-c", CHILD, cwd=ROOT, stdout=asyncio.subprocess.PIPE
    )
    try:
        assert child.stdout is not None
        line = await asyncio.wait_for(child.stdout.readline(), 20)
        port, token = line.decode().split()
        hashes = tuple(BlockHash(h) for h in range(1, 201))
        ticket = Ticket(bytes.fromhex(token), "layout-a", hashes, 0)
        blocks = {h: bytes([h % 251]) * (1 << 20) for h in hashes}
        sink = Sink()
        task = asyncio.create_task(fetch(("127.0.0.1", int(port)), ticket, sink))
        await sink.wait_for(6)
        child.send_signal(signal.SIGKILL)
        with pytest.raises(StreamBroken) as info:
            await task
        assert 6 <= info.value.delivered < 200
        await asyncio.sleep(0.05)
        sink.check(blocks)
    finally:
        if child.returncode is None:
            child.kill()
        await child.wait()
