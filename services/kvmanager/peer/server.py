"""The serving side of the bulk data plane for peer fetch: one TCP connection per fetch, raw
framed bytes, no gRPC.

The gRPC control plane decides *what* a peer may fetch and asks this node's ``DataPlaneServer``
for a one-time ``Ticket`` (``core.TicketBook``) naming a layout key and a list of block hashes.
The fetching kvmanager redeems it with ``client.fetch_blocks``; the server streams each block as
a 32-byte frame header (hash, length, checksum) followed by the payload, in the ticket's order.
The wire format lives in ``wire.py``; the protocol and measurements in
docs/kvmanager-dataplane.md.

With ``DataPlaneConfig.ssl_context`` the data plane runs over TLS (mutual TLS when the
context requires client certificates: only holders of a certificate from the mesh's CA connect
at all, and a ticket still names what they may read). With ``tls_auth_only`` as well, TLS
authenticates both ends and carries the request (the ticket), then both close it and the stream
goes on in plaintext on the same connection, on the plaintext path below (``sockets.end_tls``). The TLS handshake and the request are
read on a thread of a small pool (a blocking ``SSLSocket``; the loop cannot drive one without
asyncio's streams, which would put every byte through the loop), and the stream's thread
writes with ``sendall`` (TLS copies and encrypts every byte anyway; ``sockets.send_buffers``).
In the ``auth`` mode a client may ask to keep its authenticated connection
(``wire.Request.keep_alive``): the server says so in the stream header and, after the last
frame, waits up to ``keepalive_idle_s`` for the next request on it (in plaintext, on the
connection the handshake authenticated), so a pair of kvmanagers shakes hands once, not once
per fetch (``pool.ConnectionPool`` on the fetching side).

Bulk bytes never cross the event loop. Each stream has its own thread doing blocking
``sendmsg`` (which releases the GIL): it hands the kernel the store's own buffers (the headers
and payloads of a batch of blocks gathered in one call, no concatenation, nothing copied in
Python). The loop only redeems tickets and pins blocks, at most ``prefetch_bytes`` ahead of
the send, hands them over ``batch_bytes`` at a time (``core.SendWindow``), and releases each
batch's pins once the kernel has its bytes or the stream failed: a few loop wake-ups per MiB,
not one per block.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import queue
import secrets
import socket
import ssl
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol

from kvmesh.errors import InvalidArgument, Unavailable
from kvmesh.kv.events import BlockHash

from . import wire
from .core import SendWindow, Ticket, TicketBook
from .sockets import (
    Buffer,
    byte_view,
    conn_shutdown,
    end_tls,
    recv_exact_blocking,
    send_buffers,
    set_send_timeout,
    sock_recv_exact,
)
from .wire import Checksum, ChecksumAlgo, ChecksumSet, FrameHeader, FrameKind, Status

log = logging.getLogger(__name__)

# ---------------------------------------------------------------------------------------------
# Values


def _no_release() -> None:
    pass


@dataclass(frozen=True, slots=True)
class PinnedBlock:
    """A block the source holds still until ``release()``: the server sends ``data`` as is
    (no copy) and calls ``release`` once, on the loop, when the kernel has the bytes or the
    stream failed. A store that knows the block's checksum (it verified one when the block
    arrived) passes it, so the server does not recompute it."""

    data: Buffer
    checksum: Checksum | None = None
    release: Callable[[], None] = _no_release


class BlockSource(Protocol):
    """What the server reads blocks from (the kvmanager's store). Called on the loop."""

    def pin(
        self, layout_key: str, block_hash: BlockHash
    ) -> PinnedBlock | Awaitable[PinnedBlock | None] | None:
        """The block, pinned, or None when it is not held (sent as a missing block): at once
        when it can (a RAM block), else an awaitable of it (a disk read). The server sends
        the blocks it has batched so far before it awaits one."""
        ...


# ---------------------------------------------------------------------------------------------
# Server


@dataclass(frozen=True, slots=True)
class DataPlaneConfig:
    host: str = "127.0.0.1"  # address to bind; "0.0.0.0" for every interface
    port: int = 0  # 0: the OS picks a free port
    max_streams: int = 16  # concurrent fetches served; more are refused with BUSY
    max_tickets: int = 4096  # outstanding unredeemed tickets
    request_timeout_s: float = 5.0  # a connection must send its request within this
    stall_timeout_s: float = 10.0  # a send making no progress this long ends the stream
    prefetch_bytes: int = 8 << 20  # payload pinned ahead of the send (at least one block)
    batch_bytes: int = 1 << 20  # payload handed to the send thread, and sent, per batch
    checksum: ChecksumAlgo | None = None  # computed when the store has none; None: BLAKE3_64
    # when installed, else CRC32 (a client that lacks it gets CRC32)
    socket_buffer_bytes: int = 0  # SO_SNDBUF of each stream; 0 keeps the kernel's autotuning
    # TLS (kvmesh.tls.Tls.server_ssl_context: mutual when it requires client certificates);
    # None: plaintext.
    ssl_context: ssl.SSLContext | None = None
    # With ssl_context: TLS for the handshake and the request only, the blocks in plaintext.
    tls_auth_only: bool = False
    # tls_auth_only: a connection whose client asks for it waits this long for its next request
    # after a whole stream (the handshake is not redone); 0: one fetch per connection.
    keepalive_idle_s: float = 60.0
    max_idle_connections: int = 64  # kept connections waiting at once; past it, not kept

    def __post_init__(self) -> None:
        if self.keepalive_idle_s < 0:
            raise InvalidArgument(f"keepalive_idle_s must be >= 0, got {self.keepalive_idle_s}")
        if self.max_idle_connections < 0:
            raise InvalidArgument(
                f"max_idle_connections must be >= 0, got {self.max_idle_connections}"
            )


@dataclass(slots=True)
class DataPlaneStats:
    streams: int = 0  # fetches served (accepted requests)
    refused: int = 0
    blocks_sent: int = 0
    blocks_missing: int = 0
    bytes_sent: int = 0
    aborted: int = 0  # streams that ended early (client gone, stall, source error, shutdown)
    tls_failed: int = 0  # connections whose TLS handshake (or request under it) failed
    tls_handshakes: int = 0  # connections authenticated by a TLS handshake
    kept_requests: int = 0  # requests read on a kept connection (no handshake)


class DataPlaneServer:
    """Serves blocks of ``source`` to holders of tickets it issued."""

    def __init__(self, source: BlockSource, config: DataPlaneConfig | None = None) -> None:
        self._source = source
        self.config = config or DataPlaneConfig()
        self._checksum = self.config.checksum or wire.preferred_algo()
        if not wire.algo_bit(self._checksum) & wire.available_algos():
            raise InvalidArgument(f"checksum {self._checksum.name} is not available here")
        self.stats = DataPlaneStats()
        self._tickets = TicketBook(self.config.max_tickets)
        self._listener: socket.socket | None = None
        self._accept_task: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._active = 0
        self._idle = 0  # kept connections waiting for their next request
        self._closing = False
        self.host = self.config.host
        self.port = self.config.port
        # TLS handshakes and requests, one blocking thread each (bounded by request_timeout_s).
        self._tls_pool = (
            ThreadPoolExecutor(max(2, self.config.max_streams), thread_name_prefix="kvdp-tls")
            if self.config.ssl_context is not None
            else None
        )

    @property
    def tls(self) -> bool:
        """Clients redeem tickets here over TLS."""
        return self.config.ssl_context is not None

    @property
    def tls_auth_only(self) -> bool:
        """Over TLS, only the handshake and the ticket: the blocks follow in plaintext."""
        return self.tls and self.config.tls_auth_only

    async def start(self) -> None:
        lsock = socket.create_server((self.config.host, self.config.port), backlog=128)
        lsock.setblocking(False)
        self._listener = lsock
        self.host, self.port = lsock.getsockname()[:2]
        self._accept_task = asyncio.create_task(self._accept_loop(lsock), name="kvdp-accept")
        log.info("data plane listening on %s:%s", self.host, self.port)

    async def close(self, grace_s: float = 0.0) -> None:
        """Stops accepting and forgets all tickets; gives the streams in flight up to
        ``grace_s`` to finish, then ends the rest (their clients see a broken stream)."""
        self._closing = True
        self._tickets.clear()
        if self._accept_task is not None:
            self._accept_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._accept_task
        if self._listener is not None:
            self._listener.close()
        if grace_s > 0 and self._tasks:
            await asyncio.wait(list(self._tasks), timeout=grace_s)
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._tls_pool is not None:  # a handshake still running ends on its own timeout
            self._tls_pool.shutdown(wait=False, cancel_futures=True)

    # -- tickets (called by the gRPC control plane, on the loop)

    def issue_ticket(self, layout_key: str, hashes: Sequence[int], ttl_s: float = 30.0) -> Ticket:
        if self._closing:
            raise Unavailable("the data plane is shutting down; recompute or try another peer")
        return self._tickets.issue(
            secrets.token_bytes(wire.TOKEN_BYTES),
            layout_key,
            hashes,
            ttl_s,
            now=time.monotonic(),
            wall_now=time.time(),
        )

    def revoke_ticket(self, token: bytes) -> bool:
        return self._tickets.revoke(token)

    # -- connections

    async def _accept_loop(self, lsock: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                conn, _addr = await loop.sock_accept(lsock)
            except OSError as exc:  # e.g. EMFILE: back off rather than spin
                log.warning("data plane accept failed: %s", exc)
                await asyncio.sleep(0.1)
                continue
            task = asyncio.create_task(self._handle(conn), name="kvdp-stream")
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _handle(self, conn: socket.socket) -> None:
        owned_by_thread = False
        try:
            conn.setblocking(False)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self.config.socket_buffer_bytes:
                conn.setsockopt(
                    socket.SOL_SOCKET, socket.SO_SNDBUF, self.config.socket_buffer_bytes
                )
            loop = asyncio.get_running_loop()
            if self._tls_pool is not None:
                owned_by_thread = True  # the handshake's thread closes it if it fails
                accepted = await self._tls_accept(conn)
                if accepted is None:
                    return  # refused by TLS (no or a foreign certificate), or silent
                conn, raw = accepted
                owned_by_thread = False
                self.stats.tls_handshakes += 1
                if not isinstance(conn, ssl.SSLSocket):  # auth only: TLS closed, plaintext on
                    conn.setblocking(False)
            else:
                try:
                    async with asyncio.timeout(self.config.request_timeout_s):
                        raw = await sock_recv_exact(loop, conn, wire.REQUEST_SIZE)
                except (TimeoutError, OSError, EOFError):
                    return  # a stranger or a dead client; nothing to answer
            while True:
                owned_by_thread = True  # unless kept: the stream's thread closes it
                if not await self._serve(loop, conn, raw):
                    return
                owned_by_thread = False  # kept: the loop's again, waiting for the next request
                conn.setblocking(False)
                next_raw = await self._next_request(loop, conn)
                if next_raw is None:
                    return
                raw = next_raw
                self.stats.kept_requests += 1
        except OSError as exc:
            log.debug("data plane connection failed: %s", exc)
        finally:
            if not owned_by_thread:
                conn.close()

    async def _serve(
        self, loop: asyncio.AbstractEventLoop, conn: socket.socket, raw: bytes
    ) -> bool:
        """Answers one request on ``conn`` (the loop's until the stream starts; then the
        stream's thread closes it). True when the stream ended whole and the connection is
        kept for the next request (the loop's again)."""
        try:
            req = wire.unpack_request(raw)
        except wire.WireError as exc:
            log.info("data plane: bad request: %s", exc)
            return await self._refuse(loop, conn, Status.BAD_REQUEST)
        if self._closing:
            return await self._refuse(loop, conn, Status.SHUTTING_DOWN)
        if self._active >= self.config.max_streams:
            return await self._refuse(loop, conn, Status.BUSY)  # the ticket stays valid
        algo = wire.choose_algo(req.accepted, self._checksum)
        if algo is None:
            return await self._refuse(loop, conn, Status.BAD_REQUEST)
        status, ticket = self._tickets.redeem(req.token, time.monotonic())
        if ticket is None:
            return await self._refuse(loop, conn, status)
        keep = (
            req.keep_alive
            and self.tls_auth_only
            and not isinstance(conn, ssl.SSLSocket)
            and self.config.keepalive_idle_s > 0
            and self._idle < self.config.max_idle_connections
        )
        self.stats.streams += 1
        self._active += 1
        try:
            header = wire.StreamHeader(Status.OK, len(ticket.hashes), kept=keep)
            try:
                await self._send(loop, conn, wire.pack_stream_header(header))
            except BaseException:
                conn.close()
                raise
            return await self._stream(loop, conn, ticket, req.accepted, algo, keep)
        finally:
            self._active -= 1

    async def _next_request(
        self, loop: asyncio.AbstractEventLoop, conn: socket.socket
    ) -> bytes | None:
        """The next request on a kept connection, within ``keepalive_idle_s``; None when the
        client closes it, the time runs out or the server closes."""
        if self._closing:
            return None
        self._idle += 1
        try:
            async with asyncio.timeout(self.config.keepalive_idle_s):
                return await sock_recv_exact(loop, conn, wire.REQUEST_SIZE)
        except (TimeoutError, OSError, EOFError):
            return None  # idle too long, or the client is gone
        finally:
            self._idle -= 1

    async def _refuse(
        self, loop: asyncio.AbstractEventLoop, conn: socket.socket, status: Status
    ) -> bool:
        """Answers ``status`` with no frames and closes ``conn``; False (not kept)."""
        self.stats.refused += 1
        try:
            with contextlib.suppress(OSError):
                async with asyncio.timeout(self.config.request_timeout_s):
                    header = wire.pack_stream_header(wire.StreamHeader(status))
                    await self._send(loop, conn, header)
        finally:
            conn.close()
        return False

    async def _send(
        self, loop: asyncio.AbstractEventLoop, conn: socket.socket, data: bytes
    ) -> None:
        """A small message from the loop (a stream header): on a TLS socket by a pool thread
        (bounded by the socket's timeout, ``request_timeout_s``)."""
        if self._tls_pool is not None and isinstance(conn, ssl.SSLSocket):
            await loop.run_in_executor(self._tls_pool, conn.sendall, data)
        else:
            await loop.sock_sendall(conn, data)

    async def _tls_accept(self, conn: socket.socket) -> tuple[socket.socket, bytes] | None:
        """The TLS handshake and the request, on a pool thread that owns ``conn`` until it
        returns (auth only: and TLS closed again, a plain socket back); None (the socket
        closed) when any of it fails or takes past ``request_timeout_s``."""
        assert self._tls_pool is not None and self.config.ssl_context is not None
        ctx, timeout_s = self.config.ssl_context, self.config.request_timeout_s
        fut = self._tls_pool.submit(_tls_handshake, ctx, conn, timeout_s, self.config.tls_auth_only)
        try:
            got = await asyncio.wrap_future(fut)
        except asyncio.CancelledError:  # the server closes: the thread's socket with it
            if fut.cancel():  # not started: the socket is still the loop's
                conn.close()
            else:
                conn_shutdown(conn)
                fut.add_done_callback(_close_accepted)
            raise
        if isinstance(got, BaseException):
            self.stats.tls_failed += 1
            log.info("data plane: TLS with a client failed: %s", got)
            return None
        return got

    async def _stream(
        self,
        loop: asyncio.AbstractEventLoop,
        conn: socket.socket,
        ticket: Ticket,
        accepted: ChecksumSet,
        algo: ChecksumAlgo,
        keep: bool = False,
    ) -> bool:
        """Pins blocks in order on the loop and feeds them to the stream's send thread in
        batches of ``batch_bytes``, with at most ``prefetch_bytes`` pinned at once. The thread
        closes ``conn`` at the end, unless ``keep`` and the stream ended whole: then True, and
        ``conn`` is the loop's again."""
        window = SendWindow.of(self.config.prefetch_bytes, self.config.batch_bytes)
        room = asyncio.Event()

        def sent(batch: list[_Outgoing], ok: bool) -> None:
            for item in batch:
                window.sent(item.size)
                if item.pinned is None:
                    continue
                try:
                    item.pinned.release()
                except Exception:
                    log.exception("data plane: block source release() failed")
                if ok:
                    self.stats.blocks_sent += 1
                    self.stats.bytes_sent += item.size
            room.set()

        sender = _SendThread(conn, loop, accepted, algo, self.config.stall_timeout_s, sent)
        sender.keep = keep
        sender.start()
        batch: list[_Outgoing] = []

        def hand_over() -> None:
            nonlocal batch
            if batch:
                sender.put(batch)
                batch = []
            window.handed()

        completed = False
        try:
            for index, block_hash in enumerate(ticket.hashes):
                while window.full() and sender.error is None:
                    hand_over()
                    room.clear()
                    if window.full():
                        await room.wait()
                if sender.error is not None:
                    break
                try:
                    got = self._source.pin(ticket.layout_key, block_hash)
                    if inspect.isawaitable(got):
                        hand_over()  # what is pinned already goes out while this one waits
                        got = await got
                    pinned = got
                except Exception:
                    log.exception("data plane: block source failed on %016x", block_hash)
                    batch.append(_Outgoing(FrameKind.ABORT, index, block_hash))
                    break
                if pinned is None:
                    self.stats.blocks_missing += 1
                    batch.append(_Outgoing(FrameKind.MISSING, index, block_hash))
                    continue
                item = _Outgoing(FrameKind.BLOCK, index, block_hash, pinned)
                batch.append(item)
                if window.pinned(item.size):
                    hand_over()
                    await asyncio.sleep(0)  # let the loop's other work in between batches
            else:
                completed = True
        except BaseException:
            conn_shutdown(conn)  # cancelled (server closing): wake a blocked send
            raise
        finally:
            hand_over()
            sender.finish(completed)
            try:
                await sender.done
            except BaseException:  # cancelled: nobody takes the socket back
                sender.abandon()
                raise
            if not completed or sender.error is not None:
                self.stats.aborted += 1
                if sender.error is not None:
                    log.info("data plane stream ended early: %s", sender.error)
        return sender.kept


@dataclass(slots=True)
class _Outgoing:
    kind: FrameKind
    index: int
    block_hash: int
    pinned: PinnedBlock | None = None
    size: int = 0  # payload bytes

    def __post_init__(self) -> None:
        if self.pinned is not None:
            self.size = memoryview(self.pinned.data).nbytes


# sendmsg takes at most IOV_MAX (1024 on Linux) buffers: two per block.
_MAX_BLOCKS_PER_SENDMSG = 256


class _SendThread:
    """Writes one stream's frames with blocking ``sendmsg`` (a batch's headers and payloads
    gathered, no copy) and tells the loop once per batch when its bytes are in the kernel.
    Owns the socket from ``start()`` and closes it when done; after a failure it only hands
    back what is queued."""

    def __init__(
        self,
        sock: socket.socket,
        loop: asyncio.AbstractEventLoop,
        accepted: ChecksumSet,
        algo: ChecksumAlgo,
        stall_timeout_s: float,
        sent: Callable[[list[_Outgoing], bool], None],
    ) -> None:
        self._sock = sock
        self._loop = loop
        self._accepted = accepted
        self._algo = algo
        self._stall = stall_timeout_s
        self._sent = sent
        self._queue: queue.SimpleQueue[list[_Outgoing] | None] = queue.SimpleQueue()
        self.error: BaseException | None = None
        self.keep = False  # set before start(): leave the socket open after a whole stream
        self.kept = False  # the stream ended whole and the socket is the loop's again
        self._whole = False
        self._abandoned = False  # the loop gave up waiting (cancelled): never keep the socket
        self._keep_lock = threading.Lock()  # the keep decision vs abandon()
        self.done: asyncio.Future[None] = loop.create_future()
        self._thread = threading.Thread(target=self._run, name="kvdp-send", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def put(self, batch: list[_Outgoing]) -> None:
        self._queue.put(batch)

    def abandon(self) -> None:
        """The loop stops waiting for this stream (its task cancelled): the socket is closed by
        whichever side holds it, the thread if it has not kept it yet, else here."""
        with self._keep_lock:
            self._abandoned = True
            kept = self.kept
        if kept:
            self._sock.close()

    def finish(self, whole: bool = True) -> None:
        """No more batches; ``whole``: the stream's every frame was queued."""
        self._whole = whole
        self._queue.put(None)

    def _run(self) -> None:
        sock = self._sock
        try:
            set_send_timeout(sock, self._stall)  # blocking; each wait bounded
            while (batch := self._queue.get()) is not None:
                if self.error is None:
                    try:
                        for i in range(0, len(batch), _MAX_BLOCKS_PER_SENDMSG):
                            self._send(sock, batch[i : i + _MAX_BLOCKS_PER_SENDMSG])
                    except BaseException as exc:
                        self.error = exc
                self._call(self._sent, batch, self.error is None)
            with self._keep_lock:
                keep = self.error is None and self.keep and self._whole and not self._abandoned
                self.kept = keep  # the next request comes on it
            if keep:
                return
            if self.error is None:
                with contextlib.suppress(OSError):
                    socket.socket.shutdown(sock, socket.SHUT_WR)  # a clean end (TLS: under it)
        finally:
            if not self.kept:
                sock.close()
            self._call(_set_result, self.done)

    def _send(self, sock: socket.socket, batch: list[_Outgoing]) -> None:
        bufs: list[bytes | memoryview] = []
        for item in batch:
            if item.pinned is None:
                bufs.append(
                    wire.pack_frame_header(FrameHeader(item.kind, item.index, item.block_hash))
                )
                continue
            data = byte_view(item.pinned.data)
            known = item.pinned.checksum
            if known is not None and wire.algo_bit(known.algo) & self._accepted:
                algo, value = known.algo, known.value  # the store's own: no pass over the bytes
            else:
                algo, value = self._algo, wire.checksum(self._algo, data)
            header = FrameHeader(
                FrameKind.BLOCK, item.index, item.block_hash, data.nbytes, algo, value
            )
            bufs += (wire.pack_frame_header(header), data)
        send_buffers(sock, bufs)

    def _call(self, fn: Callable[..., None], *args: object) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is waiting
            self._loop.call_soon_threadsafe(fn, *args)


def _tls_handshake(
    ctx: ssl.SSLContext, conn: socket.socket, timeout_s: float, auth_only: bool = False
) -> tuple[socket.socket, bytes] | BaseException:
    """On a pool thread: the server's TLS handshake, then the request under it (``auth_only``:
    then TLS closed both ways, the plain socket back), within ``timeout_s``; the error (the
    socket closed) when any of it fails."""
    deadline = time.monotonic() + timeout_s
    try:
        conn.setblocking(True)
        conn.settimeout(timeout_s)
        tls = ctx.wrap_socket(conn, server_side=True)  # closes itself if the handshake fails
    except (OSError, ValueError) as exc:  # ssl.SSLError is an OSError
        conn.close()
        return exc
    try:
        raw = recv_exact_blocking(tls, wire.REQUEST_SIZE, deadline)
        if not auth_only:
            return tls, raw
        tls.settimeout(max(deadline - time.monotonic(), 1e-3))
        return end_tls(tls), raw
    except (OSError, EOFError, ValueError) as exc:
        tls.close()
        return exc


def _close_accepted(fut: Future[tuple[socket.socket, bytes] | BaseException]) -> None:
    with contextlib.suppress(BaseException):
        got = fut.result()
        if isinstance(got, tuple):
            got[0].close()


def _set_result(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)
