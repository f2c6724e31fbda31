"""The connector's side of same-node shared memory: a segment this process creates in
``/dev/shm`` and the node's kvmanager maps (``AttachShm``), so block bytes move by memcpy
instead of inside gRPC messages.

Layout: the first ``HEADER_BYTES`` hold a random token (the kvmanager checks it: only a process
that can read the segment knows it); the rest is split in two areas, one for saves (the saver
thread) and one for loads (the engine thread), so the two never wait for each other.

Pure: no grpc, vLLM or torch imports.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import secrets
from pathlib import Path

SHM_DIR = Path("/dev/shm")
NAME_PREFIX = "kvmesh-"
HEADER_BYTES = 4096  # the token's page; the kvmanager refuses regions there
TOKEN_BYTES = 16
ALIGN = 4096  # the areas start page-aligned


class ShmSegment:
    """A shared-memory segment created (and, on ``close``, unlinked and unmapped) by this
    process. ``buf`` is a writable memoryview of all of it."""

    def __init__(self, size_bytes: int, directory: Path = SHM_DIR) -> None:
        if size_bytes < HEADER_BYTES + 2 * ALIGN:
            raise ValueError(f"a shm segment needs at least {HEADER_BYTES + 2 * ALIGN} bytes")
        self.name = f"{NAME_PREFIX}{os.getpid()}-{secrets.token_hex(16)}"
        self.path = directory / self.name
        self.size = size_bytes
        self.token = secrets.token_bytes(TOKEN_BYTES)
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        fd = os.open(self.path, flags, 0o600)
        try:
            os.ftruncate(fd, size_bytes)
            self._mm: mmap.mmap | None = mmap.mmap(fd, size_bytes)
        except BaseException:
            self.unlink()
            raise
        finally:
            os.close(fd)  # the mapping is enough; without a descriptor nobody can shrink it
        self.buf = memoryview(self._mm)
        self.buf[:TOKEN_BYTES] = self.token
        half = (size_bytes - HEADER_BYTES) // 2 // ALIGN * ALIGN
        self.save_area = (HEADER_BYTES, half)  # (offset, length)
        self.load_area = (HEADER_BYTES + half, half)

    def unlink(self) -> None:
        """Removes the name (the kvmanager does this itself once it has mapped the segment)."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)

    def close(self) -> None:
        """Unlinks and unmaps. Views handed out (a load's blocks) that are still alive keep the
        mapping until they go; it is never reused."""
        self.unlink()
        if self._mm is None:
            return
        mm, self._mm = self._mm, None
        try:
            self.buf.release()
            mm.close()
        except BufferError:
            pass  # views still alive: the mapping goes with the last of them
