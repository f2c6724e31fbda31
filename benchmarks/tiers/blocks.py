"""The block sizes benchmarked and their layouts, in the three spellings the code paths take: the
connector's layout key string, the kvmanager core's ``KvLayout`` and the protobuf message."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvmesh.kv.layout import KvLayout
from kvmesh.kv_wire import layout_to_pb
from kvmesh.v1 import kvmanager_pb2
from services.worker.connector.layout import BlockLayout


@dataclass(frozen=True, slots=True)
class BlockSpec:
    """A KV block shape. ``model`` gets a tag per run, so every run stores blocks nobody holds."""

    label: str
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_size: int
    dtype: str

    def connector_key(self, tag: str) -> str:
        """The layout key the worker's connector sends (``KvManagerBlockClient`` parses it)."""
        return BlockLayout(
            model=f"bench-tiers-{self.label}-{tag}",
            block_size=self.block_size,
            num_layers=self.num_layers,
            num_kv_heads=self.num_kv_heads,
            head_size=self.head_size,
            dtype=self.dtype,
            tp_rank=0,
            tp_size=1,
            device="cpu",
        ).key()

    def layout(self, tag: str) -> KvLayout:
        return KvLayout(
            model=f"bench-tiers-{self.label}-{tag}",
            block_size=self.block_size,
            num_layers=self.num_layers,
            num_kv_heads=self.num_kv_heads,
            head_size=self.head_size,
            dtype=self.dtype,
            device="cpu",
        )

    def pb(self, tag: str) -> kvmanager_pb2.KvLayout:
        return layout_to_pb(self.layout(tag))

    @property
    def block_bytes(self) -> int:
        return self.layout("size").block_bytes


# The tiny test model's block in float32 (2 layers, 2 KV heads, head 32, 32 tokens): 32 KiB.
TINY = BlockSpec("tiny", 32, 2, 2, 32, "float32")
# Llama-3-8B in bf16, 16-token blocks (32 layers, 8 KV heads, head 128): 2 MiB.
LLAMA_8B = BlockSpec("llama8b", 16, 32, 8, 128, "bfloat16")
# Qwen2.5-7B in bf16, 16-token blocks (28 layers, 4 KV heads, head 128): 896 KiB.
QWEN_7B = BlockSpec("qwen7b", 16, 28, 4, 128, "bfloat16")
SPECS = (TINY, LLAMA_8B)
PEER_SPECS = (TINY, QWEN_7B, LLAMA_8B)  # the peer part also measures a block in between


def random_blocks(n: int, block_bytes: int, seed: int = 0) -> np.ndarray:
    """``[n, block_bytes]`` random bytes: row i is block i."""
    return np.random.default_rng(seed).integers(0, 256, (n, block_bytes), dtype=np.uint8)


def count_for(total_bytes: int, block_bytes: int) -> int:
    """Blocks of ``block_bytes`` in ``total_bytes`` (at least 1)."""
    return max(1, total_bytes // block_bytes)
