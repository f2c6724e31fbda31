"""Protobuf <-> core values of the kvmanager API (protobuf stays at the edge)."""

from __future__ import annotations

from kvmesh.v1 import kvmanager_pb2

from .core.layout import KvLayout


def layout_from_pb(msg: kvmanager_pb2.KvLayout) -> KvLayout:
    """The core value of a layout message (BadLayout, an INVALID_ARGUMENT, names what is wrong)."""
    return KvLayout(
        model=msg.model,
        block_size=msg.block_size,
        num_layers=msg.num_layers,
        num_kv_heads=msg.num_kv_heads,
        head_size=msg.head_size,
        dtype=msg.dtype,
        tp_rank=msg.tp_rank,
        tp_size=msg.tp_size or 1,
        device=msg.device,
    )


def layout_to_pb(layout: KvLayout) -> kvmanager_pb2.KvLayout:
    return kvmanager_pb2.KvLayout(
        model=layout.model,
        block_size=layout.block_size,
        num_layers=layout.num_layers,
        num_kv_heads=layout.num_kv_heads,
        head_size=layout.head_size,
        dtype=layout.dtype,
        tp_rank=layout.tp_rank,
        tp_size=layout.tp_size,
        device=layout.device,
    )
