"""The disk tier's files: one file per block, written atomically, checked when read. Blocking I/O:
call these from a thread, never from the event loop.

Layout of the directory (different layouts never collide)::

    <disk_dir>/<layout key>/layout.json             the KvLayout's fields (to rebuild at start)
    <disk_dir>/<layout key>/<hh>/<hash:016x>.kvb    a block; <hh> = the hash's first hex byte
    <disk_dir>/<layout key>/<hh>/.<hash:016x>.*.tmp a write in progress (deleted at start)

A block file is a 64-byte header then the payload. Header (little-endian): magic ``KVMB``, format
version (u16), flags (u16, bit 0: has a parent), block hash (u64), parent hash (u64, 0 if none),
payload length (u64), layout key (16 ASCII hex digits), CRC-32 of the payload (u32), 8 reserved
zero bytes, CRC-32 of the 60 bytes before it (u32).
"""

from __future__ import annotations

import itertools
import json
import os
import struct
import zlib
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path

from kvmesh.kv.events import BlockHash
from kvmesh.kv.layout import KvLayout

from .core.errors import CorruptBlock

MAGIC = b"KVMB"
FORMAT_VERSION = 1
HEADER = struct.Struct("<4sHHQQQ16sI8x")
HEADER_BYTES = HEADER.size + 4  # + the header's own CRC-32
ALLOC_BYTES = 4096  # disk use is counted in whole filesystem blocks
LAYOUT_FILE = "layout.json"
SUFFIX = ".kvb"
_FLAG_PARENT = 1
_tmp_seq = itertools.count()


def file_bytes(payload_bytes: int) -> int:
    """What one block file costs on disk: header and payload rounded up to 4 KiB."""
    return -(-(HEADER_BYTES + payload_bytes) // ALLOC_BYTES) * ALLOC_BYTES


def block_path(root: Path, layout_key: str, block_hash: int) -> Path:
    name = f"{block_hash:016x}"
    return root / layout_key / name[:2] / f"{name}{SUFFIX}"


@dataclass(frozen=True, slots=True)
class Header:
    layout_key: str
    block_hash: BlockHash
    parent: BlockHash | None
    payload_bytes: int
    payload_crc: int


def pack_header(h: Header) -> bytes:
    flags = _FLAG_PARENT if h.parent is not None else 0
    body = HEADER.pack(
        MAGIC,
        FORMAT_VERSION,
        flags,
        h.block_hash,
        h.parent or 0,
        h.payload_bytes,
        h.layout_key.encode("ascii"),
        h.payload_crc,
    )
    return body + struct.pack("<I", zlib.crc32(body))


def unpack_header(raw: bytes) -> Header:
    """Parses and checks a header (magic, version, its own CRC); CorruptBlock otherwise."""
    if len(raw) != HEADER_BYTES:
        raise CorruptBlock(f"short header: {len(raw)} of {HEADER_BYTES} bytes")
    body, (crc,) = raw[: HEADER.size], struct.unpack("<I", raw[HEADER.size :])
    if zlib.crc32(body) != crc:
        raise CorruptBlock("header checksum mismatch")
    magic, version, flags, block_hash, parent, size, key, payload_crc = HEADER.unpack(body)
    if magic != MAGIC or version != FORMAT_VERSION:
        raise CorruptBlock(f"not a v{FORMAT_VERSION} block file (magic {magic!r} v{version})")
    return Header(
        key.decode("ascii", "replace"),
        BlockHash(block_hash),
        BlockHash(parent) if flags & _FLAG_PARENT else None,
        size,
        payload_crc,
    )


def write_block(
    root: Path,
    layout: KvLayout,
    block_hash: BlockHash,
    parent: BlockHash | None,
    data: bytes | memoryview,
    fsync: bool,
) -> None:
    """Writes the block's file atomically: a tmp file in the same directory, renamed over."""
    path = block_path(root, layout.key, block_hash)
    if not path.parent.is_dir():
        write_layout(root, layout, fsync)
        path.parent.mkdir(parents=True, exist_ok=True)
    header = pack_header(Header(layout.key, block_hash, parent, len(data), zlib.crc32(data)))
    tmp = path.with_name(f".{path.stem}.{os.getpid()}.{next(_tmp_seq)}.tmp")
    try:
        with open(tmp, "xb") as f:
            f.write(header)
            f.write(data)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if fsync:
        _fsync_dir(path.parent)


def read_block(
    root: Path,
    layout: KvLayout,
    block_hash: BlockHash,
    allocate: Callable[[int], bytearray | memoryview] | None = None,
) -> tuple[bytes | memoryview, Header]:
    """The payload and header of a block file, fully checked; CorruptBlock if it is missing,
    short, long, of another block or layout, or fails its checksum. With ``allocate``, the
    payload is read into the buffer it returns (answered as a memoryview of it)."""
    path = block_path(root, layout.key, block_hash)
    data: bytes | memoryview
    try:
        with open(path, "rb") as f:
            header = _check_header(unpack_header(f.read(HEADER_BYTES)), layout, block_hash)
            if allocate is None:
                data = f.read(header.payload_bytes)
                got = len(data)
            else:
                data = memoryview(allocate(header.payload_bytes))
                got = f.readinto(data)
            extra = f.read(1)
    except FileNotFoundError as e:
        raise CorruptBlock(f"block file {path} is gone") from e
    if got != header.payload_bytes or extra:
        raise CorruptBlock(f"{path}: payload is not {header.payload_bytes} bytes")
    if zlib.crc32(data) != header.payload_crc:
        raise CorruptBlock(f"{path}: payload checksum mismatch")
    return data, header


def check_file(path: Path, layout: KvLayout) -> Header:
    """The cheap check done at start-up: header, name and size, not the payload checksum."""
    with open(path, "rb") as f:
        raw = f.read(HEADER_BYTES)
    try:
        block_hash = BlockHash(int(path.stem, 16))
    except ValueError as e:
        raise CorruptBlock(f"{path}: not a block file name") from e
    header = _check_header(unpack_header(raw), layout, block_hash)
    if path.stat().st_size != HEADER_BYTES + header.payload_bytes:
        raise CorruptBlock(f"{path}: size is not header + {header.payload_bytes} bytes")
    return header


@dataclass(frozen=True, slots=True)
class FoundBlock:
    layout: KvLayout
    block_hash: BlockHash
    parent: BlockHash | None
    mtime_ns: int  # when written: the only recency a restart knows


@dataclass(slots=True)
class ScanResult:
    blocks: list[FoundBlock]  # valid-looking block files, oldest first
    removed: list[str]  # files deleted, with why (tmp leftovers, bad headers, unusable layouts)


def scan(root: Path) -> ScanResult:
    """Lists the block files under ``root`` (created if missing) after the cheap check, and
    deletes leftover tmp files and files that fail it. Other files are left alone."""
    root.mkdir(parents=True, exist_ok=True)
    found: list[FoundBlock] = []
    removed: list[str] = []
    for layout_dir in sorted(p for p in root.iterdir() if p.is_dir() and _is_hex(p.name, 16)):
        why = ""
        try:
            layout: KvLayout | None = read_layout(layout_dir)
        except CorruptBlock as e:
            layout, why = None, str(e)
        for path in sorted(layout_dir.glob(f".{LAYOUT_FILE}.*.tmp")):
            _remove(path, "leftover tmp file", removed)
        for sub in sorted(p for p in layout_dir.iterdir() if p.is_dir() and _is_hex(p.name, 2)):
            for path in sorted(sub.iterdir()):
                if path.name.startswith(".") and path.name.endswith(".tmp"):
                    _remove(path, "leftover tmp file", removed)
                elif path.suffix != SUFFIX:
                    continue
                elif layout is None:
                    _remove(path, why, removed)
                else:
                    try:
                        header = check_file(path, layout)
                        mtime_ns = path.stat().st_mtime_ns
                    except (CorruptBlock, OSError) as e:
                        _remove(path, str(e), removed)
                        continue
                    found.append(FoundBlock(layout, header.block_hash, header.parent, mtime_ns))
    found.sort(key=lambda b: b.mtime_ns)
    return ScanResult(found, removed)


def _is_hex(name: str, digits: int) -> bool:
    return len(name) == digits and all(c in "0123456789abcdef" for c in name)


def _remove(path: Path, why: str, removed: list[str]) -> None:
    path.unlink(missing_ok=True)
    removed.append(f"{path}: {why}")


def delete_block(root: Path, layout_key: str, block_hash: BlockHash) -> None:
    block_path(root, layout_key, block_hash).unlink(missing_ok=True)


def _check_header(header: Header, layout: KvLayout, block_hash: BlockHash) -> Header:
    if header.layout_key != layout.key or header.block_hash != block_hash:
        raise CorruptBlock(
            f"file holds block {header.block_hash:016x} of layout {header.layout_key},"
            f" expected {block_hash:016x} of {layout.key}"
        )
    if header.payload_bytes != layout.block_bytes:
        raise CorruptBlock(
            f"payload {header.payload_bytes} bytes, layout needs {layout.block_bytes}"
        )
    return header


def write_layout(root: Path, layout: KvLayout, fsync: bool) -> None:
    """Writes ``<root>/<key>/layout.json`` (atomically) unless it is there already."""
    path = root / layout.key / LAYOUT_FILE
    if path.is_file():
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {f.name: getattr(layout, f.name) for f in fields(layout) if f.init}
    tmp = path.with_name(f".{LAYOUT_FILE}.{os.getpid()}.{next(_tmp_seq)}.tmp")
    tmp.write_text(json.dumps({"format": FORMAT_VERSION, "layout": doc}, indent=1))
    os.replace(tmp, path)
    if fsync:
        _fsync_dir(path.parent)


def read_layout(layout_dir: Path) -> KvLayout:
    """The layout a directory was written for; CorruptBlock if unreadable or not its key."""
    try:
        doc = json.loads((layout_dir / LAYOUT_FILE).read_text())
        layout = KvLayout(**doc["layout"])
    except Exception as e:  # any unreadable description means the same: unusable directory
        raise CorruptBlock(f"{layout_dir}: no valid {LAYOUT_FILE}: {e}") from e
    if layout.key != layout_dir.name:
        raise CorruptBlock(f"{layout_dir}: {LAYOUT_FILE} describes layout {layout.key}")
    return layout


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
