"""Blocking socket helpers both ends of the data plane share (each stream's thread owns its
socket; the loop only accepts, reads a request and shuts a socket down to wake a thread).

Over TLS the socket is an ``ssl.SSLSocket`` (blocking, its timeout set per call): it has no
``sendmsg`` and takes no ``MSG_*`` flags, so ``send_buffers`` writes each buffer with
``sendall`` (small ones coalesced) and the readers use plain ``recv_into``."""

from __future__ import annotations

import asyncio
import contextlib
import select
import socket
import ssl
import struct
import time

Buffer = bytes | bytearray | memoryview


def byte_view(data: Buffer) -> memoryview:
    view = memoryview(data)
    if not view.c_contiguous:
        raise ValueError("block data must be C-contiguous")
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def set_sock_timeout(sock: socket.socket, option: int, seconds: float) -> None:
    """SO_RCVTIMEO / SO_SNDTIMEO: a blocking call that moves no byte for this long fails with
    EAGAIN (one that moved some returns what it moved). 0 would mean forever: at least 1 us."""
    usec = max(1, round(seconds * 1e6))
    sock.setsockopt(
        socket.SOL_SOCKET, option, struct.pack("@ll", usec // 1_000_000, usec % 1_000_000)
    )


def sendmsg_all(sock: socket.socket, bufs: list[bytes | memoryview]) -> None:
    """``sendmsg`` until every buffer is sent (one call unless SO_SNDTIMEO cuts it short)."""
    views = [memoryview(b) for b in bufs]
    while views:
        try:
            n = sock.sendmsg(views)
        except BlockingIOError:  # SO_SNDTIMEO ran out with nothing sent: the peer stalls
            raise TimeoutError("peer stopped reading") from None
        while n:
            first = views[0]
            if n >= first.nbytes:
                n -= first.nbytes
                views.pop(0)
            else:
                views[0] = first[n:]
                n = 0
        while views and not views[0].nbytes:
            views.pop(0)


def set_send_timeout(sock: socket.socket, seconds: float) -> None:
    """Each blocking send moving no byte (plain: SO_SNDTIMEO) or not done (TLS: a write of one
    buffer) within ``seconds`` fails; the socket stays blocking otherwise."""
    if isinstance(sock, ssl.SSLSocket):
        sock.settimeout(seconds)
    else:
        sock.settimeout(None)
        set_sock_timeout(sock, socket.SO_SNDTIMEO, seconds)


_TLS_COALESCE_BYTES = 64 << 10  # buffers smaller than this are joined before a TLS write


def send_buffers(sock: socket.socket, bufs: list[bytes | memoryview]) -> None:
    """Every buffer, in order: one gathering ``sendmsg`` on a plain socket; over TLS one
    ``sendall`` per large buffer, the small ones (headers, small blocks) joined so that a
    32-byte header is not a TLS record and a system call of its own."""
    if not isinstance(sock, ssl.SSLSocket):
        sendmsg_all(sock, bufs)
        return
    pending = bytearray()
    for buf in bufs:
        view = memoryview(buf)
        if view.nbytes < _TLS_COALESCE_BYTES:
            pending += view
            if len(pending) >= _TLS_COALESCE_BYTES:
                sock.sendall(pending)
                pending = bytearray()
            continue
        if pending:
            sock.sendall(pending)
            pending = bytearray()
        sock.sendall(view)
    if pending:
        sock.sendall(pending)


def end_tls(tls: ssl.SSLSocket) -> socket.socket:
    """Closes TLS on a connection both ends agreed to go on with in plaintext (the data plane's
    ``auth`` mode): sends close_notify and waits for the peer's (``unwrap``, bounded by the
    socket's timeout), then the same TCP connection as a plain socket, so ``sendmsg`` and
    ``MSG_WAITALL`` work again. OpenSSL reads the peer's records one by one (no read-ahead):
    no byte sent after its close_notify is left in TLS's buffer."""
    tls.unwrap()
    return socket.socket(tls.family, tls.type, tls.proto, fileno=tls.detach())


def readable_now(sock: socket.socket) -> bool:
    """Whether a read would not wait: bytes TLS already decrypted, or bytes in the kernel."""
    if isinstance(sock, ssl.SSLSocket) and sock.pending():
        return True
    ready, _, _ = select.select([sock], [], [], 0)
    return bool(ready)


def conn_shutdown(sock: socket.socket) -> None:
    """Wakes any thread blocked on ``sock`` (its call fails at once); safe if already closed.
    On a TLS socket the descriptor is shut down under TLS (``SSLSocket.shutdown`` would also
    drop the TLS state a blocked thread still uses)."""
    with contextlib.suppress(OSError, ValueError):
        socket.socket.shutdown(sock, socket.SHUT_RDWR)


def recv_exact_blocking(sock: socket.socket, size: int, deadline: float) -> bytes:
    """``size`` bytes from a blocking socket (TLS too) by ``deadline`` (``time.monotonic``)."""
    buf = bytearray(size)
    view = memoryview(buf)
    got = 0
    while got < size:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"{got} of {size} bytes before the deadline")
        sock.settimeout(left)
        n = sock.recv_into(view[got:], size - got)
        if not n:
            raise EOFError(f"connection closed after {got} of {size} bytes")
        got += n
    return bytes(buf)


async def sock_recv_exact(loop: asyncio.AbstractEventLoop, sock: socket.socket, size: int) -> bytes:
    buf = bytearray(size)
    view = memoryview(buf)
    got = 0
    while got < size:
        n = await loop.sock_recv_into(sock, view[got:])
        if not n:
            raise EOFError(f"connection closed after {got} of {size} bytes")
        got += n
    return bytes(buf)
