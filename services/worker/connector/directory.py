"""``DirectoryBlockClient``: a ``KvBlockClient`` over a directory, one file per block.

For tests and single-host use: engines in different processes that point at the same directory
share their KV. Writes are atomic (a temp file renamed into place), so a reader sees a whole
block or none. Every file carries its key, its parent and a BLAKE2b digest of the payload; a
file that fails the check is reported as missing (the engine recomputes) and removed, so that a
later save can replace it; a save also replaces a file whose size is not the block's. Nothing is ever evicted: the directory grows until someone deletes
it.

Layout::

    <root>/<layout id>/layout.txt             the layout key, for humans
    <root>/<layout id>/<hh>/<hash:016x>.kvb   one block: header + payload

``<layout id>`` is the first 16 hex digits of SHA-256 of the layout key; ``<hh>`` the first two
hex digits of the block hash (at most 256 entries per directory level).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import struct
import threading
from collections.abc import Sequence
from pathlib import Path

from kvmesh.kv.events import Tier

from .client import BlockBytes

log = logging.getLogger(__name__)

_MAGIC = b"KVMB"
_VERSION = 1
_HAS_PARENT = 1
# magic, version, flags, block hash, parent hash, payload length, BLAKE2b-128 of the payload
_HEADER = struct.Struct(">4sBB2xQQQ16s")
HEADER_BYTES = _HEADER.size
_MASK64 = (1 << 64) - 1


def _digest(payload: BlockBytes) -> bytes:
    return hashlib.blake2b(payload, digest_size=16).digest()


def encode_block(block_hash: int, parent_hash: int | None, payload: BlockBytes) -> bytes:
    """One block file's bytes."""
    flags = 0 if parent_hash is None else _HAS_PARENT
    header = _HEADER.pack(
        _MAGIC,
        _VERSION,
        flags,
        block_hash & _MASK64,
        (parent_hash or 0) & _MASK64,
        len(payload),
        _digest(payload),
    )
    return header + bytes(payload)


def decode_block(block_hash: int, data: bytes) -> memoryview | None:
    """The payload of a block file, or None if the file is not a sound block ``block_hash``."""
    if len(data) < HEADER_BYTES:
        return None
    magic, version, _flags, stored_hash, _parent, length, digest = _HEADER.unpack_from(data)
    payload = memoryview(data)[HEADER_BYTES:]
    if (
        magic != _MAGIC
        or version != _VERSION
        or stored_hash != block_hash & _MASK64
        or length != len(payload)
        or digest != _digest(payload)
    ):
        return None
    return payload


class DirectoryBlockClient:
    """Blocks as files under ``root`` (created if missing). Thread- and process-safe."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self._root = Path(root)
        self._root.mkdir(parents=True, exist_ok=True)
        self._layouts: dict[str, Path] = {}
        self._lock = threading.Lock()

    @property
    def root(self) -> Path:
        return self._root

    def layout_dir(self, layout_key: str) -> Path:
        """The directory of ``layout_key``'s blocks (created, with its ``layout.txt``)."""
        with self._lock:
            path = self._layouts.get(layout_key)
        if path is not None:
            return path
        path = self._root / hashlib.sha256(layout_key.encode()).hexdigest()[:16]
        path.mkdir(parents=True, exist_ok=True)
        note = path / "layout.txt"
        if not note.exists():
            _write_atomic(note, layout_key.encode() + b"\n")
        with self._lock:
            self._layouts[layout_key] = path
        return path

    def block_path(self, layout_key: str, block_hash: int) -> Path:
        name = f"{block_hash & _MASK64:016x}"
        return self.layout_dir(layout_key) / name[:2] / f"{name}.kvb"

    # ---- KvBlockClient ----------------------------------------------------------------------
    def lookup(self, layout_key: str, block_hashes: Sequence[int]) -> int:
        n = 0
        for h in block_hashes:
            if not self.block_path(layout_key, h).is_file():
                break
            n += 1
        return n

    def lookup_tiers(self, layout_key: str, block_hashes: Sequence[int]) -> list[Tier]:
        """Files: every block is on disk (``TieredLookup``)."""
        return [Tier.DISK] * self.lookup(layout_key, block_hashes)

    def load(self, layout_key: str, block_hashes: Sequence[int]) -> list[BlockBytes] | None:
        out: list[BlockBytes] = []
        for h in block_hashes:
            path = self.block_path(layout_key, h)
            try:
                data = path.read_bytes()
            except OSError:
                break
            payload = decode_block(h, data)
            if payload is None:
                log.warning("block %016x in %s fails its check; removing it", h, path)
                _unlink_quietly(path)
                break
            out.append(payload)
        return out

    def save(
        self,
        layout_key: str,
        block_hashes: Sequence[int],
        parent_hash: int | None,
        blocks: Sequence[BlockBytes],
    ) -> None:
        if len(block_hashes) != len(blocks):
            raise ValueError(f"{len(block_hashes)} hashes for {len(blocks)} blocks")
        parent = parent_hash
        for h, payload in zip(block_hashes, blocks, strict=True):
            path = self.block_path(layout_key, h)
            if _size(path) != HEADER_BYTES + memoryview(payload).nbytes:
                # Missing, or not this block (a reader refused it for its size): (re)write it.
                path.parent.mkdir(exist_ok=True)
                _write_atomic(path, encode_block(h, parent, payload))
            parent = h

    def discard(self, layout_key: str, block_hashes: Sequence[int]) -> None:
        for h in block_hashes:
            _unlink_quietly(self.block_path(layout_key, h))

    def close(self) -> None:
        pass


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        tmp.write_bytes(data)
        os.replace(tmp, path)
    except BaseException:
        _unlink_quietly(tmp)
        raise


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return -1


def _unlink_quietly(path: Path) -> None:
    with contextlib.suppress(OSError):
        path.unlink()
