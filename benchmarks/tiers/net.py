"""Raw loopback TCP, the wire's limit: a sender child process (``python -m
benchmarks.tiers.net``) that answers each connection's (chunk, total) request with ``total``
bytes sent ``chunk`` at a time, and a receiver that ``recv_into``s one reused buffer. No framing,
no checksum, no allocation."""

from __future__ import annotations

import os
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

REQUEST = struct.Struct("<QQ")  # chunk bytes, total bytes
ROOT = Path(__file__).resolve().parents[2]


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view = memoryview(buf)
    while view:
        got = sock.recv_into(view)
        if not got:
            raise ConnectionError("peer closed")
        view = view[got:]
    return bytes(buf)


def serve() -> None:
    """The sender: prints its port, then serves connections (one thread each) until killed."""
    lsock = socket.create_server(("127.0.0.1", 0))
    print(lsock.getsockname()[1], flush=True)
    chunks: dict[int, memoryview] = {}
    lock = threading.Lock()

    def one(conn: socket.socket) -> None:
        with conn:
            chunk, total = REQUEST.unpack(_recv_exact(conn, REQUEST.size))
            with lock:
                data = chunks.setdefault(chunk, memoryview(os.urandom(chunk)))
            for _ in range(total // chunk):
                conn.sendall(data)

    while True:
        conn, _ = lsock.accept()
        threading.Thread(target=one, args=(conn,), daemon=True).start()


class Sender:
    """The sender child process."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "benchmarks.tiers.net"], cwd=ROOT, stdout=subprocess.PIPE
        )
        assert self.proc.stdout is not None
        self.port = int(self.proc.stdout.readline())

    def receive(self, chunk: int, total: int) -> float:
        """Seconds to receive ``total`` bytes sent ``chunk`` at a time (connect included)."""
        buf = bytearray(chunk)
        view = memoryview(buf)
        t = time.perf_counter()
        with socket.create_connection(("127.0.0.1", self.port)) as sock:
            sock.sendall(REQUEST.pack(chunk, total))
            left = total
            while left:
                got = sock.recv_into(view[: min(chunk, left)], 0, socket.MSG_WAITALL)
                if not got:
                    raise ConnectionError(f"sender closed with {left} bytes to go")
                left -= got
        return time.perf_counter() - t

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()


if __name__ == "__main__":
    serve()
