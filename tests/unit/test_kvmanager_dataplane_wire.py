"""The data plane's wire format (services/kvmanager/peer/wire.py): headers round-trip, and
bytes that are not this protocol are refused with a WireError naming what is wrong."""

from __future__ import annotations

import struct
import zlib

import pytest
from hypothesis import given
from hypothesis import strategies as st

from services.kvmanager.peer import wire as w
from services.kvmanager.peer.wire import (
    ChecksumAlgo,
    ChecksumSet,
    FrameHeader,
    FrameKind,
    Request,
    Status,
    StreamHeader,
    WireError,
)

TOKEN = bytes(range(16))
u64 = st.integers(0, w.U64_MAX)


def test_sizes_are_fixed() -> None:
    assert (w.REQUEST_SIZE, w.STREAM_HEADER_SIZE, w.FRAME_HEADER_SIZE) == (24, 16, 32)
    assert len(w.pack_request(Request(TOKEN))) == w.REQUEST_SIZE
    assert len(w.pack_stream_header(StreamHeader(Status.OK, 3))) == w.STREAM_HEADER_SIZE


@pytest.mark.parametrize("accepted", [ChecksumSet.CRC32, ChecksumSet.CRC32 | ChecksumSet.BLAKE3_64])
def test_request_round_trip(accepted: ChecksumSet) -> None:
    assert w.unpack_request(w.pack_request(Request(TOKEN, accepted))) == Request(TOKEN, accepted)


def test_request_drops_checksum_bits_of_a_newer_peer() -> None:
    raw = bytearray(w.pack_request(Request(TOKEN)))
    raw[6] |= 0x80  # an algorithm this version does not know
    assert w.unpack_request(raw).accepted == ChecksumSet.CRC32


def test_keep_alive_and_kept_round_trip_and_an_older_peer_sends_neither() -> None:
    keep = Request(TOKEN, ChecksumSet.XXH3_64, keep_alive=True)
    assert w.unpack_request(w.pack_request(keep)) == keep
    assert w.pack_request(keep)[5] == w.REQUEST_KEEP_ALIVE  # the byte version 1 sent as 0
    assert not w.unpack_request(w.pack_request(Request(TOKEN))).keep_alive
    raw = bytearray(w.pack_request(keep))
    raw[5] |= 0x80  # a flag of a newer peer: ignored
    assert w.unpack_request(raw).keep_alive
    kept = StreamHeader(Status.OK, 3, kept=True)
    assert w.unpack_stream_header(w.pack_stream_header(kept)) == kept
    # A refusal never keeps the connection, whatever the flag says.
    refused = w.pack_stream_header(StreamHeader(Status.BUSY, kept=True))
    assert w.unpack_stream_header(refused) == StreamHeader(Status.BUSY)
    forged = bytearray(w.pack_stream_header(StreamHeader(Status.BUSY)))
    forged[6] = w.STREAM_KEPT
    assert not w.unpack_stream_header(forged).kept


def test_request_token_must_be_16_bytes() -> None:
    with pytest.raises(WireError, match="16"):
        w.pack_request(Request(b"short"))


@pytest.mark.parametrize("status", list(Status), ids=lambda s: s.name)
@given(count=u64)
def test_stream_header_round_trip(status: Status, count: int) -> None:
    hdr = StreamHeader(status, count)
    assert w.unpack_stream_header(w.pack_stream_header(hdr)) == hdr


@given(index=st.integers(0, 2**32 - 1), block_hash=u64, length=u64, value=u64)
def test_block_frame_round_trip(index: int, block_hash: int, length: int, value: int) -> None:
    for algo in ChecksumAlgo:
        hdr = FrameHeader(FrameKind.BLOCK, index, block_hash, length, algo, value)
        assert w.unpack_frame_header(w.pack_frame_header(hdr)) == hdr


@pytest.mark.parametrize("kind", [FrameKind.MISSING, FrameKind.ABORT], ids=lambda k: k.name)
def test_payloadless_frames_round_trip(kind: FrameKind) -> None:
    hdr = FrameHeader(kind, 7, 0xDEADBEEF)
    assert w.unpack_frame_header(w.pack_frame_header(hdr)) == hdr


BAD_BYTES = [
    pytest.param(
        w.unpack_request, b"XXXX" + w.pack_request(Request(TOKEN))[4:], "magic", id="request-magic"
    ),
    pytest.param(
        w.unpack_request,
        w.pack_request(Request(TOKEN))[:4] + b"\x02" + w.pack_request(Request(TOKEN))[5:],
        "version 2",
        id="request-version",
    ),
    pytest.param(
        w.unpack_request, w.pack_request(Request(TOKEN))[:-1], "23 bytes", id="request-short"
    ),
    pytest.param(
        w.unpack_stream_header,
        b"HTTP" + w.pack_stream_header(StreamHeader(Status.OK))[4:],
        "magic",
        id="stream-magic",
    ),
    pytest.param(
        w.unpack_stream_header,
        struct.pack("<4sBBHQ", b"KVDP", 9, 0, 0, 1),
        "version 9",
        id="stream-version",
    ),
    pytest.param(
        w.unpack_stream_header,
        struct.pack("<4sBBHQ", b"KVDP", 1, 200, 0, 1),
        "status 200",
        id="stream-status",
    ),
    pytest.param(w.unpack_stream_header, b"KVDP\x01", "5 bytes", id="stream-truncated"),
    pytest.param(
        w.unpack_frame_header,
        struct.pack("<2sBBIQQQ", b"ZZ", 0, 1, 0, 1, 1, 1),
        "magic",
        id="frame-magic",
    ),
    pytest.param(
        w.unpack_frame_header,
        struct.pack("<2sBBIQQQ", b"KB", 9, 1, 0, 1, 1, 1),
        "kind 9",
        id="frame-kind",
    ),
    pytest.param(
        w.unpack_frame_header,
        struct.pack("<2sBBIQQQ", b"KB", 0, 77, 0, 1, 1, 1),
        "algorithm 77",
        id="frame-algo",
    ),
    pytest.param(
        w.unpack_frame_header,
        struct.pack("<2sBBIQQQ", b"KB", 1, 0, 0, 1, 5, 0),
        "MISSING frame with a payload",
        id="missing-with-payload",
    ),
    pytest.param(
        w.unpack_frame_header,
        w.pack_frame_header(FrameHeader(FrameKind.MISSING, 0, 1))[:31],
        "31 bytes",
        id="frame-truncated",
    ),
    pytest.param(w.unpack_frame_header, b"", "0 bytes", id="frame-empty"),
]


@pytest.mark.parametrize(("unpack", "raw", "message"), BAD_BYTES)
def test_bad_bytes_are_refused(unpack, raw: bytes, message: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(WireError, match=message):
        unpack(raw)


def test_pack_refuses_inconsistent_frames() -> None:
    with pytest.raises(WireError, match="needs a checksum"):
        w.pack_frame_header(FrameHeader(FrameKind.BLOCK, 0, 1, 10))
    with pytest.raises(WireError, match="no payload"):
        w.pack_frame_header(FrameHeader(FrameKind.MISSING, 0, 1, 10))


def test_checksums_match_the_reference_values() -> None:
    assert w.checksum(ChecksumAlgo.CRC32, b"123456789") == 0xCBF43926 == zlib.crc32(b"123456789")
    if w.available_algos() & ChecksumSet.BLAKE3_64:
        # BLAKE3("") = af1349b9f5f9a1a6..., first 8 bytes read little-endian
        assert w.checksum(ChecksumAlgo.BLAKE3_64, b"") == 0xA6A1F9F5B94913AF
    # xxhash is a kvmesh dependency: XXH3-64("") with seed 0 (the xxHash reference value)
    assert w.checksum(ChecksumAlgo.XXH3_64, b"") == 0x2D06800538D394C2
    data = bytearray(b"x" * 100_000)
    view = memoryview(data)
    for algo in ChecksumAlgo:
        if w.algo_bit(algo) & w.available_algos():
            assert w.checksum(algo, view) == w.checksum(algo, bytes(data))
            data[5] ^= 1
            assert w.checksum(algo, view) != w.checksum(algo, b"x" * 100_000)
            data[5] ^= 1


CRC, B3, XX = ChecksumSet.CRC32, ChecksumSet.BLAKE3_64, ChecksumSet.XXH3_64
CHOICES = [
    pytest.param(CRC | B3 | XX, ChecksumAlgo.XXH3_64, CRC | XX, ChecksumAlgo.XXH3_64, id="xxh3"),
    pytest.param(CRC | B3, ChecksumAlgo.XXH3_64, CRC | XX, ChecksumAlgo.CRC32, id="old-client"),
    pytest.param(CRC | B3, ChecksumAlgo.BLAKE3_64, CRC | B3, ChecksumAlgo.BLAKE3_64, id="both-b3"),
    pytest.param(CRC, ChecksumAlgo.BLAKE3_64, CRC | B3, ChecksumAlgo.CRC32, id="client-crc-only"),
    pytest.param(CRC | B3, ChecksumAlgo.BLAKE3_64, CRC, ChecksumAlgo.CRC32, id="server-crc-only"),
    pytest.param(
        CRC | B3, ChecksumAlgo.CRC32, CRC | B3, ChecksumAlgo.CRC32, id="server-prefers-crc"
    ),
    pytest.param(B3, ChecksumAlgo.CRC32, CRC, None, id="nothing-in-common"),
    pytest.param(ChecksumSet(0), ChecksumAlgo.CRC32, CRC, None, id="client-offers-none"),
]


@pytest.mark.parametrize(("accepted", "preferred", "local", "want"), CHOICES)
def test_choose_algo(
    accepted: ChecksumSet, preferred: ChecksumAlgo, local: ChecksumSet, want: ChecksumAlgo | None
) -> None:
    assert w.choose_algo(accepted, preferred, local) is want


def test_xxh3_is_preferred_where_installed() -> None:
    assert w.available_algos() & ChecksumSet.XXH3_64
    assert w.preferred_algo() is ChecksumAlgo.XXH3_64
