"""The fetching side of the bulk data plane: ``fetch_blocks`` redeems a ticket a peer's
``server.DataPlaneServer`` issued and receives its blocks (protocol: docs/kvmanager-dataplane.md).

Bulk bytes never cross the event loop. Each fetch has its own thread doing blocking
``recv_into`` (which releases the GIL) straight into the buffer that becomes the block, and
verifying its checksum on that same thread. The loop only hands verified blocks to
``on_block``. Flow control is TCP's plus a bounded window (``core.RecvWindow``): the thread
stops reading the socket while ``window_bytes`` of verified blocks wait for ``on_block``.

Over TLS (``ssl_context``: the mesh's CA, and this kvmanager's certificate for mutual TLS)
the same thread does the handshake and reads with plain ``recv_into`` (TLS decrypts every byte
into the buffer anyway; an ``SSLSocket`` takes no ``MSG_*`` flags); a failed handshake or a
certificate the CA did not sign is a ``StreamBroken`` saying so. With ``tls_auth_only`` (the
grant says so: ``--data-plane-security auth``) TLS carries only the handshake and the request:
both ends then close it and the blocks come in plaintext on the plaintext path
(``sockets.end_tls``), each checked by its checksum as always. With a ``pool`` as well, the
connection outlives the fetch: the next fetch from that peer sends its request on it instead of
connecting and shaking hands again (``pool.ConnectionPool``; one that broke while idle is
replaced by a fresh one, once, before any block).

Failure semantics: ``on_block`` sees only whole blocks whose checksum matched, in order. Any
failure (peer gone, stall, deadline, bad checksum, protocol violation) raises a
``PeerFetchError`` carrying how many blocks were delivered before it; nothing else escapes, and
the caller recomputes the rest.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import inspect
import socket
import ssl
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from kvmesh.errors import Unavailable
from kvmesh.kv.events import BlockHash

from . import wire
from .core import RecvWindow, Ticket
from .pool import ConnectionPool
from .sockets import Buffer, byte_view, conn_shutdown, end_tls, readable_now, set_sock_timeout
from .wire import Checksum, ChecksumAlgo, ChecksumSet, FrameKind, Status

# ---------------------------------------------------------------------------------------------
# Values and errors


@dataclass(frozen=True, slots=True)
class FetchedBlock:
    """A whole block whose checksum matched. ``data`` views the buffer ``allocate`` returned
    (or the ``bytes`` received, with ``allocate=None``)."""

    index: int  # position in the ticket's hashes
    block_hash: BlockHash
    data: memoryview
    checksum: Checksum

    def payload(self) -> bytes:
        """The block as ``bytes``: the received object itself when it is one, else a copy."""
        obj = self.data.obj
        if type(obj) is bytes and len(obj) == self.data.nbytes:
            return obj
        return self.data.tobytes()


@dataclass(frozen=True, slots=True)
class FetchResult:
    delivered: int  # blocks handed to on_block
    missing: tuple[BlockHash, ...]  # blocks the peer no longer held
    bytes: int  # payload bytes delivered
    seconds: float


class PeerFetchError(Unavailable):
    """A peer fetch failed. ``delivered`` blocks (a prefix of the ticket's non-missing blocks)
    reached on_block whole and verified; recompute the rest."""

    def __init__(self, message: str, *, delivered: int = 0) -> None:
        super().__init__(message)
        self.delivered = delivered


class TicketRefused(PeerFetchError):
    """The server refused the request (unknown, used or expired ticket, busy, shutting down)."""

    def __init__(self, status: Status, message: str) -> None:
        super().__init__(message)
        self.status = status


class StreamBroken(PeerFetchError):
    """The peer closed, reset or aborted the stream, or sent bytes that break the protocol."""


class ChecksumMismatch(StreamBroken):
    """A block's payload did not match its checksum; it was dropped."""


class FetchStalled(PeerFetchError):
    """No byte arrived for ``stall_timeout_s``."""


class FetchDeadlineExceeded(PeerFetchError):
    """The fetch's overall deadline passed."""


# ---------------------------------------------------------------------------------------------
# Client

OnBlock = Callable[[FetchedBlock], Awaitable[None] | None]
Allocate = Callable[[int], Buffer]
Discard = Callable[[memoryview], None]


async def fetch_blocks(
    host: str,
    port: int,
    ticket: Ticket,
    *,
    on_block: OnBlock,
    deadline_s: float,
    stall_timeout_s: float = 5.0,
    allocate: Allocate | None = bytearray,
    discard: Discard | None = None,
    window_bytes: int = 16 << 20,
    max_block_bytes: int = 1 << 30,
    accept: ChecksumSet | None = None,
    ssl_context: ssl.SSLContext | None = None,
    server_hostname: str | None = None,
    tls_auth_only: bool = False,
    pool: ConnectionPool | None = None,
) -> FetchResult:
    """Fetches the ticket's blocks from the data plane at ``host:port``.

    ``on_block`` gets each whole, verified block in the ticket's order, on the loop; when it
    returns an awaitable, that is awaited (backpressure): the fetch's thread stops reading
    once ``window_bytes`` of verified blocks wait for on_block (at least one block is always
    let through). ``allocate(size)`` returns the writable, contiguous buffer a block is
    received into; it runs on the fetch's thread, so it must be thread-safe (``bytearray``,
    the default, is). A buffer that never reaches on_block goes to ``discard`` on the loop.
    ``allocate=None`` receives each block as a new immutable ``bytes`` instead, written in
    place by the kernel (``FetchedBlock.payload()`` hands it out without a copy).
    ``deadline_s`` bounds the whole fetch; ``stall_timeout_s`` each wait for the peer.
    ``accept`` lists the checksums this side verifies (default: all it can compute).
    ``ssl_context``: over TLS (``kvmesh.tls.Tls.client_ssl_context``), the server's certificate
    checked for ``server_hostname`` (default ``host``); None: plaintext. ``tls_auth_only``:
    TLS for the handshake and the request only, the blocks in plaintext (the server's mode).
    ``pool`` (with ``tls_auth_only``): take an authenticated connection to this peer from it
    when one is idle, and give the connection back after a whole stream when the server keeps
    it (``wire.StreamHeader.kept``); ignored otherwise.

    Returns a ``FetchResult``. Raises a ``PeerFetchError`` on any failure of the peer or the
    stream, after having delivered only whole verified blocks (``exc.delivered`` of them). An
    exception from ``on_block`` or ``allocate`` ends the fetch and propagates unchanged.
    """
    if deadline_s <= 0:
        raise FetchDeadlineExceeded(f"fetch from {host}:{port}: no time left before it started")
    loop = asyncio.get_running_loop()
    started = time.monotonic()
    rx = _Receiver(
        loop,
        host,
        port,
        ticket,
        deadline=started + deadline_s,
        stall_timeout_s=stall_timeout_s,
        allocate=allocate,
        discard=discard,
        window_bytes=window_bytes,
        max_block_bytes=max_block_bytes,
        accept=wire.available_algos() if accept is None else accept,
        ssl_context=ssl_context,
        server_hostname=server_hostname or host,
        tls_auth_only=tls_auth_only,
        pool=pool if ssl_context is not None and tls_auth_only else None,
    )
    delivered = nbytes = 0
    missing: list[BlockHash] = []
    rx.start()
    try:
        # A backstop: the thread's own deadline ends the stream first, after the blocks it
        # received (so those are delivered), unless on_block itself is what runs late.
        async with asyncio.timeout_at(loop.time() + deadline_s + _DEADLINE_BACKSTOP_S):
            while (item := await rx.next()) is not _END:
                if isinstance(item, BaseException):
                    raise item
                if isinstance(item, int):  # the hash of a block the peer no longer holds
                    missing.append(BlockHash(item))
                    continue
                size = item.data.nbytes
                result = on_block(item)
                if inspect.isawaitable(result):
                    await result
                rx.taken(size)
                delivered += 1
                nbytes += size
    except TimeoutError:
        raise FetchDeadlineExceeded(
            f"fetch from {host}:{port} passed its {deadline_s:.3f}s deadline after "
            f"{delivered} of {len(ticket.hashes)} blocks",
            delivered=delivered,
        ) from None
    except PeerFetchError as exc:
        exc.delivered = delivered
        raise
    finally:
        rx.close()
    return FetchResult(delivered, tuple(missing), nbytes, time.monotonic() - started)


_END = None
_DEADLINE_BACKSTOP_S = 0.05
_Item = FetchedBlock | int | BaseException | None


class _Receiver:
    """One fetch's thread: connects, sends the request, receives each frame straight into a
    buffer from ``allocate``, verifies it and queues it for the loop. The loop is woken once
    per ``window_bytes / 4`` of blocks, when the window is full, and at the end, not once per
    block: the caller needs the whole fetch, and each wake-up costs the loop and the GIL."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        host: str,
        port: int,
        ticket: Ticket,
        *,
        deadline: float,
        stall_timeout_s: float,
        allocate: Allocate | None,
        discard: Discard | None,
        window_bytes: int,
        max_block_bytes: int,
        accept: ChecksumSet,
        ssl_context: ssl.SSLContext | None = None,
        server_hostname: str = "",
        tls_auth_only: bool = False,
        pool: ConnectionPool | None = None,
    ) -> None:
        self._loop = loop
        self._pool = pool
        self._key = (host, port, server_hostname)
        self._ssl = ssl_context
        self._auth_only = tls_auth_only
        self._server_hostname = server_hostname
        self._tls = False  # the stream's socket is an SSLSocket (timeouts by settimeout)
        self._peer = f"{host}:{port}"
        self._addr = (host, port)
        self._ticket = ticket
        self._deadline = deadline
        self._stall = stall_timeout_s
        self._allocate = allocate
        self._discard = discard
        self._max_block = max_block_bytes
        self._accept = accept
        self._ready: collections.deque[_Item] = collections.deque()  # thread -> loop
        self._wake = asyncio.Event()
        self._signalled = False  # a wake-up is on its way to the loop
        self._unsignalled = 0  # bytes queued since the last wake-up
        self._signal_bytes = max(1, window_bytes // 4)
        self._window = threading.Condition()  # guards _held
        self._held = RecvWindow(window_bytes)  # bytes queued or with on_block
        self._stopped = False
        self._deadline_bound = False  # the last wait was cut by the deadline, not the stall
        self._rcvtimeo = 0.0  # SO_RCVTIMEO as last set
        self._sock: socket.socket | None = None
        self._sock_lock = threading.Lock()  # close() vs the thread
        self._thread = threading.Thread(target=self._run, name="kvdp-recv", daemon=True)

    # -- loop side

    def start(self) -> None:
        self._thread.start()

    async def next(self) -> _Item:
        while not self._ready:
            self._wake.clear()
            self._signalled = False
            if self._ready:
                break
            await self._wake.wait()
        return self._ready.popleft()

    def taken(self, nbytes: int) -> None:
        with self._window:
            self._held.taken(nbytes)
            self._window.notify()

    def close(self) -> None:
        """Stops the thread at once (its socket is shut down) and discards undelivered
        blocks, now and, for any the thread still queues, when it exits."""
        self._stopped = True
        with self._sock_lock:
            if self._sock is not None:
                conn_shutdown(self._sock)
        with self._window:
            self._window.notify_all()
        self._drop_ready()

    def _drop_ready(self) -> None:
        while self._ready:
            item = self._ready.popleft()
            if isinstance(item, FetchedBlock) and self._discard is not None:
                self._discard(item.data)

    # -- thread side

    def _call_soon(self, fn: Callable[..., object], *args: object) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is waiting
            self._loop.call_soon_threadsafe(fn, *args)

    def _push(self, item: _Item, nbytes: int = 0, flush: bool = False) -> None:
        self._ready.append(item)
        self._unsignalled += nbytes
        if flush or self._unsignalled >= self._signal_bytes:
            self._flush()

    def _flush(self) -> None:
        self._unsignalled = 0
        if self._ready and not self._signalled:
            self._signalled = True
            self._call_soon(self._wake.set)

    def _run(self) -> None:
        try:
            self._fetch()
            self._push(_END, flush=True)
        except BaseException as exc:
            self._push(self._classify(exc), flush=True)
        finally:
            with self._sock_lock:
                sock, self._sock = self._sock, None
            if sock is not None:
                sock.close()
            if self._stopped:
                self._call_soon(self._drop_ready)

    def _classify(self, exc: BaseException) -> BaseException:
        if isinstance(exc, PeerFetchError) or not isinstance(
            exc, OSError | EOFError | wire.WireError
        ):
            return exc  # ours already, or from allocate: unchanged
        if self._stopped:
            return StreamBroken(f"fetch from {self._peer} stopped")
        if isinstance(exc, ssl.SSLError):
            return StreamBroken(f"TLS with {self._peer} failed: {exc}")
        if isinstance(exc, TimeoutError):  # socket.timeout
            if self._deadline_bound:
                return FetchDeadlineExceeded(f"fetch from {self._peer} passed its deadline")
            return FetchStalled(f"no bytes from {self._peer} for {self._stall:.3f}s")
        if isinstance(exc, wire.WireError):
            return StreamBroken(f"protocol violation from {self._peer}: {exc}")
        return StreamBroken(f"stream from {self._peer} broke: {exc!r}")

    def _timeout(self) -> float:
        left = self._deadline - time.monotonic()
        if left <= 0:
            raise FetchDeadlineExceeded(f"fetch from {self._peer} passed its deadline")
        self._deadline_bound = left < self._stall
        return min(self._stall, left)

    def _arm(self, sock: socket.socket) -> None:
        """Bounds the next blocking read by the stall timeout and the deadline (plain:
        SO_RCVTIMEO, set only when it changes; TLS: the socket's timeout)."""
        timeout = self._timeout()
        if timeout != self._rcvtimeo:
            if self._tls:
                sock.settimeout(timeout)
            else:
                set_sock_timeout(sock, socket.SO_RCVTIMEO, timeout)
            self._rcvtimeo = timeout

    def _recv_exact(self, sock: socket.socket, view: memoryview) -> None:
        """Fills ``view``: one blocking ``recv_into(MSG_WAITALL)`` unless the peer is slow
        (TLS: one ``recv_into`` per TLS record)."""
        got, size = 0, view.nbytes
        flags = 0 if self._tls else socket.MSG_WAITALL
        while got < size:
            self._arm(sock)
            try:
                n = sock.recv_into(view[got:], size - got, flags)
            except BlockingIOError:  # SO_RCVTIMEO ran out before a single byte came
                raise TimeoutError("no bytes") from None
            if not n:
                raise EOFError(f"peer closed the stream {size - got} bytes short of a frame")
            got += n

    def _recv_header(self, sock: socket.socket, view: memoryview) -> None:
        """Fills a frame header; when it is not there yet (the peer paused between frames),
        first hands the loop the blocks queued so far, so a stalled peer does not hold back
        blocks already verified. No extra system call while the peer keeps up (TLS: one poll)."""
        if self._tls:
            if not readable_now(sock):
                self._flush()
            self._recv_exact(sock, view)
            return
        got = 0
        with contextlib.suppress(BlockingIOError):
            got = sock.recv_into(view, view.nbytes, socket.MSG_DONTWAIT)
            if not got:
                raise EOFError("peer closed the stream between frames")
        if got < view.nbytes:
            self._flush()
            self._recv_exact(sock, view[got:])

    def _reserve(self, nbytes: int) -> None:
        """Waits until the window has room for a block of ``nbytes`` (one block always fits)."""
        with self._window:
            while not self._held.fits(nbytes) and not self._stopped:
                self._flush()
                self._window.wait(self._timeout())
            if self._stopped:
                raise EOFError("fetch stopped")
            self._held.reserve(nbytes)

    def _own(self, sock: socket.socket) -> None:
        """Makes ``sock`` the one ``close`` shuts down (and ``_run`` closes at the end)."""
        with self._sock_lock:
            if self._stopped:
                sock.close()
                raise EOFError("fetch stopped")
            self._sock = sock

    def _request(self) -> bytes:
        keep = self._pool is not None
        return wire.pack_request(wire.Request(self._ticket.token, self._accept, keep_alive=keep))

    def _open(self) -> tuple[socket.socket, wire.StreamHeader]:
        """The connection, the request sent on it and the answer's stream header: on a kept
        connection from the pool when one is idle (one that breaks before the answer is closed
        and a fresh one opened instead: the server never read the request, or its answer is
        lost with it and the ticket refused on the fresh one), else on a fresh connection."""
        if self._pool is not None and (sock := self._pool.take(self._key)) is not None:
            self._own(sock)
            self._tls = False
            try:
                sock.sendall(self._request())
                return sock, self._stream_header(sock)
            except (EOFError, ConnectionError):
                self._pool.count("broken")
                with self._sock_lock:
                    self._sock = None
                sock.close()
                if self._stopped:
                    raise
        sock = self._connect()
        return sock, self._stream_header(sock)

    def _stream_header(self, sock: socket.socket) -> wire.StreamHeader:
        head = memoryview(bytearray(wire.STREAM_HEADER_SIZE))
        self._recv_exact(sock, head)
        return wire.unpack_stream_header(head)

    def _connect(self) -> socket.socket:
        """A fresh connection (TLS: after its handshake), the request sent on it."""
        sock = socket.create_connection(self._addr, timeout=self._timeout())
        self._own(sock)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if self._ssl is not None:  # the handshake, bounded by the connect's timeout
            sock = self._ssl.wrap_socket(sock, server_hostname=self._server_hostname)
            self._own(sock)
            self._tls = True
            if self._pool is not None:
                self._pool.count("handshakes")
        sock.sendall(self._request())
        if self._tls and self._auth_only:  # TLS closed both ways; the blocks in plaintext
            assert isinstance(sock, ssl.SSLSocket)
            sock.settimeout(self._timeout())
            sock = end_tls(sock)
            self._own(sock)
            self._tls = False
        if self._tls:
            self._rcvtimeo = sock.gettimeout() or 0.0
        else:
            sock.settimeout(None)  # blocking; SO_RCVTIMEO bounds each wait
            self._rcvtimeo = 0.0
        return sock

    def _give_back(self, sock: socket.socket) -> None:
        """After a whole stream the server keeps: the connection goes to the pool."""
        assert self._pool is not None
        with self._sock_lock:
            if self._stopped:
                return  # close() shut it down; _run closes it
            self._sock = None
        self._pool.give(self._key, sock)

    def _fetch(self) -> None:
        sock, stream = self._open()
        if stream.status is not Status.OK:
            raise TicketRefused(
                stream.status, f"{self._peer} refused the fetch: {stream.status.name}"
            )
        hashes = self._ticket.hashes
        if stream.block_count != len(hashes):
            raise wire.WireError(
                f"peer announced {stream.block_count} blocks, the ticket has {len(hashes)}"
            )

        frame = memoryview(bytearray(wire.FRAME_HEADER_SIZE))
        for index, want in enumerate(hashes):
            self._recv_header(sock, frame)
            hdr = wire.unpack_frame_header(frame)
            if hdr.kind is FrameKind.ABORT:
                raise StreamBroken(f"{self._peer} aborted the stream at block {index}")
            if hdr.index != index or hdr.block_hash != want:
                raise wire.WireError(
                    f"frame for block {hdr.index} ({hdr.block_hash:016x}), "
                    f"expected block {index} ({want:016x})"
                )
            if hdr.kind is FrameKind.MISSING:
                self._push(want)
                continue
            algo = hdr.checksum_algo
            assert algo is not None  # unpack_frame_header guarantees it for BLOCK frames
            if not wire.algo_bit(algo) & self._accept:
                raise wire.WireError(f"block {index} checksummed with {algo.name}, not offered")
            if hdr.length > self._max_block:
                raise wire.WireError(f"block of {hdr.length} bytes is over max_block_bytes")
            self._reserve(hdr.length)
            if self._allocate is None:
                view = memoryview(self._recv_bytes(sock, hdr.length))  # nothing to discard
                self._verify(index, want, algo, hdr.checksum, view)
            else:
                view = byte_view(self._allocate(hdr.length))
                try:
                    if view.nbytes != hdr.length or view.readonly:
                        raise ValueError(f"allocate({hdr.length}) returned an unusable buffer")
                    self._recv_exact(sock, view)
                    self._verify(index, want, algo, hdr.checksum, view)
                except BaseException:
                    if self._discard is not None:
                        self._call_soon(self._discard, view)
                    raise
            self._push(FetchedBlock(index, want, view, Checksum(algo, hdr.checksum)), hdr.length)
        if stream.kept and self._pool is not None:
            self._give_back(sock)

    def _verify(
        self, index: int, block_hash: int, algo: ChecksumAlgo, expected: int, view: memoryview
    ) -> None:
        if wire.checksum(algo, view) != expected:
            raise ChecksumMismatch(
                f"block {index} ({block_hash:016x}) from {self._peer} failed its "
                f"{algo.name} check; dropped"
            )

    def _recv_bytes(self, sock: socket.socket, size: int) -> bytes:
        """A payload as a new ``bytes`` the kernel writes into (``recv`` with ``MSG_WAITALL``
        allocates it and receives in place: no copy). A peer that is slow mid-block costs one
        copy to reassemble it (TLS: always one copy)."""
        if self._tls:
            buf = bytearray(size)
            self._recv_exact(sock, memoryview(buf))
            return bytes(buf)
        self._arm(sock)
        try:
            data = sock.recv(size, socket.MSG_WAITALL)
        except BlockingIOError:  # SO_RCVTIMEO ran out before a single byte came
            raise TimeoutError("no bytes") from None
        if not data and size:
            raise EOFError(f"peer closed the stream {size} bytes short of a frame")
        if len(data) == size:
            return data
        buf = bytearray(size)
        buf[: len(data)] = data
        self._recv_exact(sock, memoryview(buf)[len(data) :])
        return bytes(buf)
