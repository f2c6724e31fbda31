"""Blocking socket helpers both ends of the data plane share (each stream's thread owns its
socket; the loop only accepts, reads a request and shuts a socket down to wake a thread)."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct

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


def conn_shutdown(sock: socket.socket) -> None:
    """Wakes any thread blocked on ``sock`` (its call fails at once); safe if already closed."""
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)


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
