"""Same-node shared memory: segments that local clients (the connector in vLLM's engine process)
create in ``/dev/shm`` and this kvmanager maps, so PutBlocks and GetBlocks move block bytes by
one memcpy each way instead of inside gRPC messages (docs/kvmanager.md#shared-memory).

Trust: a segment is only opened by a plain file name starting ``kvmesh-`` inside the configured
directory (no path, no symlink followed), must be a regular file of exactly the announced size,
and must start with the caller's 16-byte token (only someone who can read the segment knows it).
Once mapped, the name is unlinked (no one else can open it from then on) and the file descriptor
closed, so nobody holding only a mapping can shrink it. Every region a call names is checked
against the segment; a length is never trusted.

Call it from the event loop only: attach, detach and every copy run there, so a detached
segment's mapping is closed between two copies, never during one, and a closed mapping cannot be
written (mmap raises).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import hmac
import logging
import mmap
import os
import re
import secrets
import stat
from dataclasses import dataclass
from pathlib import Path

from kvmesh.errors import InvalidArgument, NotFound, ResourceExhausted, Unavailable
from kvmesh.settings import setting

log = logging.getLogger(__name__)

NAME_PREFIX = "kvmesh-"
HEADER_BYTES = 4096  # a segment's first page: its token; never a block's region
TOKEN_BYTES = 16
ALIGN = 64  # GetBlocks places each block at a multiple of this
_NAME = re.compile(r"kvmesh-[A-Za-z0-9_-]{1,200}")


class ShmOff(Unavailable):
    """This kvmanager does not map shared memory (``--shm-dir ''``): send bytes inline."""


class ShmNotFound(NotFound):
    """No segment of that name here (the caller is on another node), or the id is not attached."""


class BadShm(InvalidArgument):
    """A bad segment name, file, size or token, or a region outside its segment."""


class TooManyShm(ResourceExhausted):
    """As many segments are attached as ``max_segments`` allows."""


@dataclass(frozen=True, slots=True)
class ShmConfig:
    dir: Path | None = setting(
        Path("/dev/shm"), "where same-node clients' shared-memory segments are; empty: off"
    )
    max_segments: int = setting(
        64, "shared-memory segments attached at once (one per engine process and TP rank)"
    )
    max_segment_bytes: int = setting(64 << 30, "the largest shared-memory segment mapped, bytes")

    def __post_init__(self) -> None:
        if self.max_segments < 1:
            raise InvalidArgument(f"shm max_segments must be >= 1, got {self.max_segments}")
        if self.max_segment_bytes <= HEADER_BYTES:
            raise InvalidArgument(
                f"shm max_segment_bytes must be > {HEADER_BYTES}, got {self.max_segment_bytes}"
            )


@dataclass(slots=True)
class ShmStats:
    attached: int = 0  # segments attached now
    attaches: int = 0
    refused: int = 0  # AttachShm refused (not found: another node; bad name, size, token)
    bytes_in: int = 0  # block bytes copied out of segments (PutBlocks)
    bytes_out: int = 0  # block bytes copied into segments (GetBlocks)


class Segment:
    """One attached segment: its mapping, and an event set when it is detached."""

    def __init__(self, shm_id: int, name: str, mm: mmap.mmap) -> None:
        self.id = shm_id
        self.name = name
        self.size = len(mm)
        self.detached = asyncio.Event()
        self._mm: mmap.mmap | None = mm

    def check(self, offset: int, length: int) -> None:
        """BadShm unless [offset, offset + length) is inside the segment, past its header."""
        if offset < HEADER_BYTES or length < 0 or offset + length > self.size:
            raise BadShm(
                f"region [{offset}, {offset + length}) is outside segment {self.id:#x}'s block"
                f" area [{HEADER_BYTES}, {self.size})"
            )

    def read(self, offset: int, length: int) -> bytes:
        """A copy of the region as a new ``bytes``."""
        self.check(offset, length)
        return self._map()[offset : offset + length]

    def read_into(self, offset: int, out: bytearray | memoryview) -> None:
        """Copies the region of ``len(out)`` bytes at ``offset`` into ``out`` (one memcpy)."""
        view = memoryview(out)
        self.check(offset, view.nbytes)
        with memoryview(self._map()) as whole, whole[offset : offset + view.nbytes] as region:
            view[:] = region  # both views released here: detach can close the mapping

    def write(self, offset: int, data: bytes | memoryview) -> None:
        self.check(offset, len(data))
        self._map()[offset : offset + len(data)] = data

    def _map(self) -> mmap.mmap:
        if self._mm is None:
            raise ShmNotFound(f"shared-memory segment {self.id:#x} is detached")
        return self._mm

    def close(self) -> None:
        self.detached.set()
        if self._mm is not None:
            mm, self._mm = self._mm, None
            mm.close()  # never exported (slices copy), so this cannot fail on views


class ShmRegistry:
    """The segments attached to this kvmanager, by id."""

    def __init__(self, config: ShmConfig) -> None:
        self._config = config
        self._segments: dict[int, Segment] = {}
        self.stats = ShmStats()

    @property
    def enabled(self) -> bool:
        return self._config.dir is not None

    def attach(self, name: str, size: int, token: bytes) -> Segment:
        """Maps the client's segment ``name``; see the module docstring for what is checked."""
        try:
            seg = self._attach(name, size, token)
        except Exception:
            self.stats.refused += 1
            raise
        self.stats.attaches += 1
        self.stats.attached = len(self._segments)
        log.info("attached shared memory %s (%d bytes) as %#x", name, seg.size, seg.id)
        return seg

    def _attach(self, name: str, size: int, token: bytes) -> Segment:
        root = self._config.dir
        if root is None:
            raise ShmOff("this kvmanager does not map shared memory (--shm-dir is empty)")
        if not _NAME.fullmatch(name):
            raise BadShm(
                f"shm name must be {NAME_PREFIX!r} then 1-200 letters, digits, '-' or '_';"
                f" got {name[:80]!r}"
            )
        if not HEADER_BYTES < size <= self._config.max_segment_bytes:
            raise BadShm(
                f"shm size_bytes must be in ({HEADER_BYTES}, {self._config.max_segment_bytes}],"
                f" got {size}"
            )
        if len(token) != TOKEN_BYTES:
            raise BadShm(f"shm token must be {TOKEN_BYTES} bytes, got {len(token)}")
        if len(self._segments) >= self._config.max_segments:
            raise TooManyShm(
                f"{len(self._segments)} shared-memory segments are attached already (the most)"
            )
        path = root / name
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
        except FileNotFoundError:
            raise ShmNotFound(f"no shared-memory segment {name} in {root} on this node") from None
        except OSError as exc:
            what = "a symlink" if exc.errno == errno.ELOOP else exc.strerror
            raise BadShm(f"cannot open shared-memory segment {name}: {what}") from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise BadShm(f"shared-memory segment {name} is not a regular file")
            if st.st_size != size:
                raise BadShm(f"shared-memory segment {name} is {st.st_size} bytes, not {size}")
            mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        if not hmac.compare_digest(mm[:TOKEN_BYTES], token):
            mm.close()
            raise BadShm(f"shared-memory segment {name} does not start with the caller's token")
        # From now on nobody can open it (and nobody but its creator, if it kept a descriptor,
        # can shrink it under the mapping).
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        shm_id = secrets.randbits(64) or 1
        while shm_id in self._segments:
            shm_id = secrets.randbits(64) or 1
        seg = self._segments[shm_id] = Segment(shm_id, name, mm)
        return seg

    def get(self, shm_id: int) -> Segment:
        seg = self._segments.get(shm_id)
        if seg is None:
            raise ShmNotFound(f"shared-memory segment {shm_id:#x} is not attached here")
        return seg

    def detach(self, shm_id: int) -> bool:
        """Unmaps the segment; False if it was not attached."""
        seg = self._segments.pop(shm_id, None)
        if seg is None:
            return False
        seg.close()
        self.stats.attached = len(self._segments)
        log.info("detached shared memory %s (%#x)", seg.name, shm_id)
        return True

    def close(self) -> None:
        """Detaches every segment (their AttachShm streams end)."""
        for shm_id in list(self._segments):
            self.detach(shm_id)
