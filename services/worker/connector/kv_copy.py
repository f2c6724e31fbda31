"""Block bytes in and out of vLLM's paged KV cache tensors (worker side).

A stored block is the concatenation, layer by layer (in the KV cache group's layer order), of
that layer's slice for the block, in the tensor's own memory order. On CPU (vLLM's
``CPU_ATTN`` backend, layout ``LBHNC``) each layer's cache is one tensor
``[num_blocks, num_kv_heads, block_size, 2 * head_size]`` whose per-block slice is, for each KV
head, ``block_size x head_size`` keys followed by ``block_size x head_size`` values. Layouts
with K and V outermost (``[2, num_blocks, ...]``, e.g. FlashAttention on GPU) are handled too:
then a layer's slice is all keys of the block, then all values.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from .client import BlockBytes


@dataclass(frozen=True, slots=True)
class KvLayer:
    """One layer's KV cache tensor and where its blocks are."""

    name: str
    tensor: torch.Tensor
    block_dim: int  # the dimension that indexes blocks: 0, or 1 for [2, num_blocks, ...]
    nbytes: int  # bytes of one block of this layer

    @property
    def block_shape(self) -> tuple[int, ...]:
        return tuple(s for d, s in enumerate(self.tensor.shape) if d != self.block_dim)


def kv_layers(
    kv_caches: Mapping[str, torch.Tensor], layer_names: Sequence[str], num_blocks: int
) -> list[KvLayer]:
    """The layers to copy, in ``layer_names`` order; layers sharing one tensor count once."""
    layers: list[KvLayer] = []
    seen: set[int] = set()
    for name in layer_names:
        t = kv_caches[name]
        if t.data_ptr() in seen:
            continue
        seen.add(t.data_ptr())
        if t.shape[0] == num_blocks:
            dim = 0
        elif t.dim() > 1 and t.shape[0] == 2 and t.shape[1] == num_blocks:
            dim = 1
        else:
            raise ValueError(
                f"KV cache of {name} has shape {tuple(t.shape)}; cannot find its {num_blocks} "
                "blocks"
            )
        layers.append(KvLayer(name, t, dim, t.numel() * t.element_size() // num_blocks))
    return layers


def read_blocks(layers: Sequence[KvLayer], block_ids: Sequence[int]) -> np.ndarray:
    """A copy of ``block_ids`` as an ``[n, bytes per block]`` uint8 array (row i: block i)."""
    n = len(block_ids)
    out = np.empty((n, sum(x.nbytes for x in layers)), dtype=np.uint8)
    ids = torch.tensor(list(block_ids), dtype=torch.long)
    with torch.inference_mode():
        off = 0
        for layer in layers:
            sel = layer.tensor.index_select(layer.block_dim, ids).movedim(layer.block_dim, 0)
            raw = sel.contiguous().view(torch.uint8).reshape(n, layer.nbytes)
            out[:, off : off + layer.nbytes] = raw.numpy()
            off += layer.nbytes
    return out


def write_blocks(
    layers: Sequence[KvLayer], block_ids: Sequence[int], blocks: Sequence[BlockBytes]
) -> None:
    """Writes ``blocks`` (each exactly one block's bytes) into ``block_ids``."""
    n = len(block_ids)
    staging = np.empty((n, sum(x.nbytes for x in layers)), dtype=np.uint8)
    for i in range(n):
        staging[i] = np.frombuffer(blocks[i], dtype=np.uint8)
    ids = torch.tensor(list(block_ids), dtype=torch.long)
    with torch.inference_mode():
        off = 0
        for layer in layers:
            t = layer.tensor
            src = torch.from_numpy(staging[:, off : off + layer.nbytes]).contiguous()
            src = src.view(t.dtype).view(n, *layer.block_shape).movedim(0, layer.block_dim)
            t.index_copy_(layer.block_dim, ids, src)
            off += layer.nbytes
