"""KV layouts: everything that makes two KV blocks interchangeable, and the checks on a block.
The contract between the engines' KV connector and the kvmanagers (both sides import it here).

A block is stored under ``(layout.key, block_hash)``: the same hash under two layouts (another
model, dtype, block size, or another tensor-parallel rank's shard) is two different blocks.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field, fields

from kvmesh.errors import InvalidArgument
from kvmesh.kv.events import BlockHash

# Bytes per element of the KV cache dtypes vLLM names (``--kv-cache-dtype``; resolve "auto" to
# the model's dtype first).
DTYPE_BYTES: dict[str, int] = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "fp8": 1,
    "fp8_e4m3": 1,
    "fp8_e5m2": 1,
    "int8": 1,
    "uint8": 1,
}

KEY_VERSION = "kvlayout/1"  # part of every key: bump it if the key's recipe ever changes
_HASH_LIMIT = 1 << 64


class BadLayout(InvalidArgument):
    """A KV layout field is out of range (the message names the field and the value)."""


class BadBlock(InvalidArgument):
    """A block does not fit its layout (payload size) or its hash is not an unsigned 64-bit int."""


class LayoutMismatch(InvalidArgument):
    """A block or peer uses another KV layout than the one expected (the message names the
    fields that differ)."""


@dataclass(frozen=True, slots=True)
class KvLayout:
    """One KV cache layout. ``key`` and ``block_bytes`` are derived from the other fields."""

    model: str  # served model name (or path): blocks of two models never mix
    block_size: int  # tokens per block
    num_layers: int  # attention layers holding KV
    num_kv_heads: int  # KV heads in THIS rank's shard (model's KV heads / tp_size, at least 1)
    head_size: int  # elements per head
    dtype: str  # KV cache dtype, a key of DTYPE_BYTES
    tp_rank: int = 0  # tensor-parallel rank whose shard these blocks are
    tp_size: int = 1  # tensor-parallel world size
    # The platform whose attention backend laid the bytes out (cpu, cuda, ...): the same shapes
    # are ordered differently on different backends. Empty: not stated.
    device: str = ""
    key: str = field(init=False, repr=False, compare=False)  # 16 hex digits, stable
    block_bytes: int = field(init=False, repr=False, compare=False)  # payload of one block

    def __post_init__(self) -> None:
        if not self.model:
            raise BadLayout("layout.model must be a non-empty model name")
        for name in ("block_size", "num_layers", "num_kv_heads", "head_size", "tp_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise BadLayout(f"layout.{name} must be an int >= 1, got {value!r}")
        if not isinstance(self.tp_rank, int) or not 0 <= self.tp_rank < self.tp_size:
            raise BadLayout(
                f"layout.tp_rank must be in [0, tp_size={self.tp_size}), got {self.tp_rank!r}"
            )
        if self.dtype not in DTYPE_BYTES:
            raise BadLayout(
                f"layout.dtype must be one of {sorted(DTYPE_BYTES)}, got {self.dtype!r}"
            )
        canonical = "|".join(
            [
                KEY_VERSION,
                *(
                    f"{f.name}={getattr(self, f.name)}"
                    for f in _IDENTITY_FIELDS
                    if f.name != "device" or self.device  # unstated: keys stay as they were
                ),
            ]
        )
        digest = hashlib.blake2b(canonical.encode(), digest_size=8).hexdigest()
        object.__setattr__(self, "key", digest)
        size = 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_size
        object.__setattr__(self, "block_bytes", size * DTYPE_BYTES[self.dtype])

    def describe(self) -> str:
        """A short human-readable form for messages and logs."""
        return (
            f"{self.model} bs={self.block_size} L={self.num_layers} H={self.num_kv_heads}"
            f" D={self.head_size} {self.dtype} tp={self.tp_rank}/{self.tp_size} [{self.key}]"
        )

    def require_same(self, other: KvLayout) -> None:
        """Raises LayoutMismatch naming every field where ``other`` differs from this layout."""
        diffs = [
            f"{f.name} {getattr(other, f.name)!r} != {getattr(self, f.name)!r}"
            for f in _IDENTITY_FIELDS
            if getattr(other, f.name) != getattr(self, f.name)
        ]
        if diffs:
            raise LayoutMismatch(
                f"KV layout mismatch (got != expected): {', '.join(diffs)}; expected"
                f" {self.describe()}"
            )

    def check_payload(self, size_bytes: int) -> None:
        """Raises BadBlock unless a payload of ``size_bytes`` is one block of this layout."""
        if size_bytes != self.block_bytes:
            raise BadBlock(
                f"block payload is {size_bytes} bytes but layout {self.describe()} needs"
                f" {self.block_bytes} (2 * layers * block_size * kv_heads * head_size * dtype)"
            )


_IDENTITY_FIELDS = tuple(f for f in fields(KvLayout) if f.init)


def check_block_hash(block_hash: int) -> BlockHash:
    """The hash as a BlockHash, or BadBlock unless it is an unsigned 64-bit int."""
    if not isinstance(block_hash, int) or isinstance(block_hash, bool):
        raise BadBlock(f"block hash must be an int, got {type(block_hash).__name__}")
    if not 0 <= block_hash < _HASH_LIMIT:
        raise BadBlock(f"block hash must be in [0, 2**64), got {block_hash}")
    return BlockHash(block_hash)


def check_layout_key(key: str) -> str:
    """``key`` if it has the shape of a ``KvLayout.key`` (16 lowercase hex digits), else
    BadLayout."""
    if len(key) != 16 or any(c not in "0123456789abcdef" for c in key):
        raise BadLayout(f"layout key must be 16 lowercase hex digits (KvLayout.key), got {key!r}")
    return key
