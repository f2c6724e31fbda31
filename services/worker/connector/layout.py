"""The layout key: which engines may exchange KV block bytes.

Two engines can use each other's blocks only if the bytes mean the same thing: same model
weights, block size, number of layers, KV heads, head size, KV dtype, tensor-parallel shard and
byte layout of a block (the attention backend's). The key is a readable string of exactly those
values; the block hash (which already covers the tokens, the hash seed, LoRA and cache salt)
names a block within it.

Pure. ``kvmesh/kv/layout.py`` (``KvLayout``, the kvmanager's side of the contract) will become the
one definition; until then this string is what the connector sends, and the kvmanager client
can parse it back (``parse_layout_key``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

LAYOUT_VERSION = "kvmesh-kv1"


@dataclass(frozen=True, slots=True)
class BlockLayout:
    """What a block's bytes depend on."""

    model: str  # served model name (mesh-wide), else the model path
    block_size: int  # tokens per block
    num_layers: int  # attention layers with their own KV
    num_kv_heads: int  # KV heads in this shard
    head_size: int
    dtype: str  # KV cache dtype, e.g. float32, bfloat16, fp8_e4m3
    tp_rank: int
    tp_size: int
    device: str  # the platform whose attention backend laid the bytes out: cpu, cuda, ...

    def key(self) -> str:
        """``kvmesh-kv1;model=...;block=32;...``; ``;`` and ``=`` in the model name are
        replaced, so the key always parses back."""
        parts = [LAYOUT_VERSION]
        for name, value in asdict(self).items():
            text = str(value).replace(";", "_").replace("=", "_")
            parts.append(f"{name}={text}")
        return ";".join(parts)

    def bytes_per_block(self, element_size: int) -> int:
        """K and V of one block over all layers of this shard."""
        return (
            2
            * self.num_layers
            * self.num_kv_heads
            * self.block_size
            * self.head_size
            * (element_size)
        )


def parse_layout_key(key: str) -> BlockLayout:
    """The inverse of ``BlockLayout.key``. Raises ValueError for anything else."""
    version, *items = key.split(";")
    if version != LAYOUT_VERSION:
        raise ValueError(f"not a {LAYOUT_VERSION} layout key: {key!r}")
    values = dict(item.split("=", 1) for item in items)
    ints = ("block_size", "num_layers", "num_kv_heads", "head_size", "tp_rank", "tp_size")
    try:
        return BlockLayout(
            **{k: (int(v) if k in ints else v) for k, v in values.items()}  # type: ignore[arg-type]
        )
    except TypeError as exc:
        raise ValueError(f"bad layout key {key!r}: {exc}") from exc
