"""The KV data plane's wire format: fixed-size headers packed and unpacked, and block checksums.
Pure: no sockets, no asyncio. The protocol is described in docs/kvmanager-dataplane.md.

One TCP connection carries one fetch:

    client -> server   Request       24 bytes: magic, version, accepted checksums, ticket token
    server -> client   StreamHeader  16 bytes: magic, version, status, block count
    server -> client   per block, in the ticket's order:
                       FrameHeader   32 bytes: magic, kind, checksum algorithm, index,
                                     block hash, payload length, checksum
                       payload       ``length`` bytes (none for a missing block)

All integers are little-endian. A refused request gets a StreamHeader with a non-OK status and
no frames. The server closes the connection after the last frame, unless the request asked to
keep it (``Request.keep_alive``) and the stream header says it is kept (``StreamHeader.kept``):
then, after the last frame, the connection waits for the client's next request (the pooled
connections of the ``auth`` mode: ``pool.ConnectionPool``).
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass
from enum import IntEnum, IntFlag
from types import ModuleType
from typing import Final

from kvmesh.errors import KvmeshError

_blake3: ModuleType | None
try:  # vLLM depends on blake3; the data plane works without it (crc32 is always there).
    import blake3 as _blake3
except ImportError:  # pragma: no cover - depends on the environment
    _blake3 = None
_xxhash: ModuleType | None
try:  # a kvmesh dependency; a peer without it still speaks CRC32.
    import xxhash as _xxhash
except ImportError:  # pragma: no cover - depends on the environment
    _xxhash = None

MAGIC: Final = b"KVDP"
FRAME_MAGIC: Final = b"KB"
VERSION: Final = 1
TOKEN_BYTES: Final = 16

_REQUEST = struct.Struct("<4sBBH16s")  # magic, version, flags, accepted checksums, token
_STREAM = struct.Struct("<4sBBHQ")  # magic, version, status, flags, block count
# Request flags (the byte an older peer sends as 0 and ignores).
REQUEST_KEEP_ALIVE: Final = 0x01  # the client would send another request on this connection
# Stream header flags.
STREAM_KEPT: Final = 0x01  # after the last frame, the server waits for the next request
_FRAME = struct.Struct("<2sBBIQQQ")  # magic, kind, checksum algo, index, hash, length, checksum

REQUEST_SIZE: Final = _REQUEST.size
STREAM_HEADER_SIZE: Final = _STREAM.size
FRAME_HEADER_SIZE: Final = _FRAME.size
assert (REQUEST_SIZE, STREAM_HEADER_SIZE, FRAME_HEADER_SIZE) == (24, 16, 32)

U64_MAX: Final = (1 << 64) - 1


class WireError(KvmeshError):
    """Bytes that are not this protocol (bad magic, unknown version or value, short header)."""


class ChecksumAlgo(IntEnum):
    """How a payload's checksum is computed. CRC32 is mandatory for every peer."""

    CRC32 = 1  # zlib.crc32 of the payload
    BLAKE3_64 = 2  # the first 8 bytes of the payload's BLAKE3 digest, little-endian
    XXH3_64 = 3  # xxhash's XXH3 64-bit digest of the payload (seed 0)


class ChecksumSet(IntFlag):
    """The algorithms a client can verify, as a bitmask on the wire (bit ``algo - 1``)."""

    CRC32 = 1 << (ChecksumAlgo.CRC32 - 1)
    BLAKE3_64 = 1 << (ChecksumAlgo.BLAKE3_64 - 1)
    XXH3_64 = 1 << (ChecksumAlgo.XXH3_64 - 1)


_KNOWN_ALGOS: Final = int(ChecksumSet.CRC32 | ChecksumSet.BLAKE3_64 | ChecksumSet.XXH3_64)


@dataclass(frozen=True, slots=True)
class Checksum:
    """A block's checksum as the wire carries it; a store that verified or computed one keeps
    it, so serving the block never needs another pass over its bytes."""

    algo: ChecksumAlgo
    value: int


class Status(IntEnum):
    """The server's answer to a request, in the stream header."""

    OK = 0
    UNKNOWN_TICKET = 1  # no such token (never issued, already used, or revoked)
    EXPIRED_TICKET = 2
    BUSY = 3  # too many streams at once; recompute or try later
    BAD_REQUEST = 4  # wrong magic/version or no checksum both sides know
    SHUTTING_DOWN = 5


class FrameKind(IntEnum):
    BLOCK = 0  # ``length`` payload bytes follow
    MISSING = 1  # the server no longer holds this block; no payload
    ABORT = 2  # the server failed; nothing follows and the connection closes


@dataclass(frozen=True, slots=True)
class Request:
    token: bytes
    accepted: ChecksumSet = ChecksumSet.CRC32
    keep_alive: bool = False  # the client would reuse the connection after this stream


@dataclass(frozen=True, slots=True)
class StreamHeader:
    status: Status
    block_count: int = 0
    kept: bool = False  # OK only: the connection takes another request after the last frame


@dataclass(frozen=True, slots=True)
class FrameHeader:
    kind: FrameKind
    index: int  # position of the block in the ticket's list
    block_hash: int
    length: int = 0  # payload bytes (BLOCK only)
    checksum_algo: ChecksumAlgo | None = None  # BLOCK only: per frame, so a server can pass on
    checksum: int = 0  # the checksum its store already holds, whichever the client accepts


def available_algos() -> ChecksumSet:
    """The checksums this process can compute."""
    algos = ChecksumSet.CRC32
    if _blake3 is not None:
        algos |= ChecksumSet.BLAKE3_64
    if _xxhash is not None:
        algos |= ChecksumSet.XXH3_64
    return algos


def algo_bit(algo: ChecksumAlgo) -> ChecksumSet:
    return ChecksumSet(1 << (algo - 1))


def checksum(algo: ChecksumAlgo, data: bytes | bytearray | memoryview) -> int:
    """The checksum of ``data`` as the frame header carries it. zlib and blake3 release the GIL
    on large inputs; XXH3 holds it, but for ~50 us per 2 MiB (about 40 GB/s a core here)."""
    if algo is ChecksumAlgo.CRC32:
        return zlib.crc32(data)
    if algo is ChecksumAlgo.BLAKE3_64:
        if _blake3 is None:
            raise WireError("blake3 is not installed in this process")
        return int.from_bytes(_blake3.blake3(data).digest(8), "little")
    if algo is ChecksumAlgo.XXH3_64:
        if _xxhash is None:
            raise WireError("xxhash is not installed in this process")
        return int(_xxhash.xxh3_64_intdigest(data))
    raise WireError(f"unknown checksum algorithm {algo!r}")


def _check_magic(got: bytes, want: bytes, what: str) -> None:
    if got != want:
        raise WireError(
            f"bad {what} magic {got!r}, expected {want!r}: not a kvmesh data plane peer"
        )


def _check_version(version: int) -> None:
    if version != VERSION:
        raise WireError(f"unsupported data plane version {version}, this side speaks {VERSION}")


def _need(buf: bytes | bytearray | memoryview, size: int, what: str) -> None:
    if len(buf) != size:
        raise WireError(f"{what} is {len(buf)} bytes, expected {size}")


def pack_request(req: Request) -> bytes:
    if len(req.token) != TOKEN_BYTES:
        raise WireError(f"ticket token is {len(req.token)} bytes, expected {TOKEN_BYTES}")
    flags = REQUEST_KEEP_ALIVE if req.keep_alive else 0
    return _REQUEST.pack(MAGIC, VERSION, flags, int(req.accepted), req.token)


def unpack_request(buf: bytes | bytearray | memoryview) -> Request:
    _need(buf, REQUEST_SIZE, "request")
    magic, version, flags, accepted, token = _REQUEST.unpack(buf)
    _check_magic(magic, MAGIC, "request")
    _check_version(version)
    # Bits we do not know are algorithms or flags of a newer peer: keep only ours.
    return Request(
        token=token,
        accepted=ChecksumSet(accepted & _KNOWN_ALGOS),
        keep_alive=bool(flags & REQUEST_KEEP_ALIVE),
    )


def pack_stream_header(hdr: StreamHeader) -> bytes:
    flags = STREAM_KEPT if hdr.kept and hdr.status is Status.OK else 0
    return _STREAM.pack(MAGIC, VERSION, hdr.status, flags, hdr.block_count)


def unpack_stream_header(buf: bytes | bytearray | memoryview) -> StreamHeader:
    _need(buf, STREAM_HEADER_SIZE, "stream header")
    magic, version, status, flags, count = _STREAM.unpack(buf)
    _check_magic(magic, MAGIC, "stream header")
    _check_version(version)
    try:
        code = Status(status)
    except ValueError:
        raise WireError(f"bad stream header: unknown status {status}") from None
    return StreamHeader(code, count, kept=code is Status.OK and bool(flags & STREAM_KEPT))


def pack_frame_header(hdr: FrameHeader) -> bytes:
    if hdr.kind is FrameKind.BLOCK and hdr.checksum_algo is None:
        raise WireError("a BLOCK frame needs a checksum algorithm")
    if hdr.kind is not FrameKind.BLOCK and (hdr.length or hdr.checksum_algo is not None):
        raise WireError(f"a {hdr.kind.name} frame carries no payload and no checksum")
    algo = 0 if hdr.checksum_algo is None else int(hdr.checksum_algo)
    return _FRAME.pack(
        FRAME_MAGIC, hdr.kind, algo, hdr.index, hdr.block_hash, hdr.length, hdr.checksum
    )


def unpack_frame_header(buf: bytes | bytearray | memoryview) -> FrameHeader:
    _need(buf, FRAME_HEADER_SIZE, "frame header")
    magic, kind, algo, index, block_hash, length, crc = _FRAME.unpack(buf)
    _check_magic(magic, FRAME_MAGIC, "frame")
    try:
        frame_kind = FrameKind(kind)
    except ValueError:
        raise WireError(f"bad frame header: unknown kind {kind}") from None
    if frame_kind is not FrameKind.BLOCK:
        if length or algo:
            raise WireError(f"a {frame_kind.name} frame with a payload or checksum")
        return FrameHeader(frame_kind, index, block_hash)
    try:
        checksum_algo = ChecksumAlgo(algo)
    except ValueError:
        raise WireError(f"bad frame header: unknown checksum algorithm {algo}") from None
    return FrameHeader(frame_kind, index, block_hash, length, checksum_algo, crc)


def preferred_algo() -> ChecksumAlgo:
    """The cheapest checksum this process can compute: XXH3 (about 40 GB/s a core here) when
    xxhash is installed, else BLAKE3 (about 6.5 GB/s), else CRC32 (about 5 GB/s); measured in
    docs/kvmanager-dataplane.md. The checksum guards against corruption, not against a forger:
    peers are trusted, the ticket is the access control."""
    if _xxhash is not None:
        return ChecksumAlgo.XXH3_64
    return ChecksumAlgo.BLAKE3_64 if _blake3 is not None else ChecksumAlgo.CRC32


def choose_algo(
    accepted: ChecksumSet, preferred: ChecksumAlgo, local: ChecksumSet | None = None
) -> ChecksumAlgo | None:
    """The checksum a server computes for a client: its preferred one when both sides know
    it, else CRC32 when both know that, else None (the request is refused)."""
    local = available_algos() if local is None else local
    both = accepted & local
    if both & algo_bit(preferred):
        return preferred
    if both & ChecksumSet.CRC32:
        return ChecksumAlgo.CRC32
    return None
