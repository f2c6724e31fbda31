"""``KvManagerBlockClient``: the connector's block store is the node's kvmanager daemon
(kvmesh.v1.KvManager over gRPC: Lookup, GetBlocks, PutBlocks).

Runs inside vLLM's engine process, on the engine thread (lookup, load) and the connector's saver
thread (lookup, save): a synchronous gRPC channel, which is thread-safe. Every call has a
deadline, and a kvmanager that is down, slow or refuses answers "nothing" (0 blocks, no bytes):
the engine recomputes, it never waits long and never fails a request for it.

Bytes travel inside the gRPC messages for now; same-node shared memory is the next step for the
bulk path (docs/connector.md).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator, Sequence

import grpc

from kvmesh.v1 import kvmanager_pb2, kvmanager_pb2_grpc
from services.kvmanager.core.layout import KvLayout

from .client import BlockBytes, StoreConfig
from .layout import parse_layout_key

log = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 64 * 1024 * 1024  # the kvmanager's default max_message_bytes
_PUT_BATCH_BYTES = 16 * 1024 * 1024  # payload per PutBlocksRequest
_WARN_EVERY_S = 30.0


def kv_layout(layout_key: str) -> KvLayout:
    """The kvmanager's ``KvLayout`` for a connector layout key."""
    b = parse_layout_key(layout_key)
    return KvLayout(
        model=b.model,
        block_size=b.block_size,
        num_layers=b.num_layers,
        num_kv_heads=b.num_kv_heads,
        head_size=b.head_size,
        dtype=b.dtype,
        tp_rank=b.tp_rank,
        tp_size=b.tp_size,
        device=b.device,
    )


def _layout_pb(layout: KvLayout) -> kvmanager_pb2.KvLayout:
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


class KvManagerBlockClient:
    """A ``KvBlockClient`` over a kvmanager at ``address`` (host:port)."""

    def __init__(
        self,
        address: str,
        lookup_timeout_s: float = 0.5,
        load_timeout_s: float = 10.0,
        save_timeout_s: float = 30.0,
    ) -> None:
        self.address = address
        self._lookup_timeout_s = lookup_timeout_s
        self._load_timeout_s = load_timeout_s
        self._save_timeout_s = save_timeout_s
        self._channel = grpc.insecure_channel(
            address,
            options=[
                ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ],
        )
        self._stub = kvmanager_pb2_grpc.KvManagerStub(self._channel)
        self._layouts: dict[str, kvmanager_pb2.KvLayout] = {}
        self._lock = threading.Lock()
        self._last_warning = 0.0

    @classmethod
    def from_config(cls, config: StoreConfig) -> KvManagerBlockClient:
        """The ``client_factory`` for ``StoreConfig(store="factory")``: ``store_path`` holds the
        kvmanager's host:port."""
        if not config.store_path:
            raise ValueError("the kvmanager client needs store_path = the kvmanager's host:port")
        return cls(config.store_path)

    # ---- KvBlockClient -------------------------------------------------------------------
    def lookup(self, layout_key: str, block_hashes: Sequence[int]) -> int:
        if not block_hashes:
            return 0
        try:
            resp = self._stub.Lookup(
                kvmanager_pb2.LookupRequest(
                    layout=self._layout(layout_key), block_hashes=block_hashes
                ),
                timeout=self._lookup_timeout_s,
            )
        except grpc.RpcError as exc:
            self._warn("lookup", exc)
            return 0
        return len(resp.tiers)

    def load(self, layout_key: str, block_hashes: Sequence[int]) -> list[BlockBytes] | None:
        out: list[BlockBytes] = []
        if not block_hashes:
            return out
        call = self._stub.GetBlocks(
            kvmanager_pb2.GetBlocksRequest(
                layout=self._layout(layout_key), block_hashes=block_hashes
            ),
            timeout=self._load_timeout_s,
        )
        try:
            for i, msg in enumerate(call):
                if msg.HasField("missing") or msg.block.block_hash != block_hashes[i]:
                    break
                out.append(msg.block.data)
        except grpc.RpcError as exc:
            self._warn("load", exc)
        finally:
            call.cancel()
        return out

    def save(
        self,
        layout_key: str,
        block_hashes: Sequence[int],
        parent_hash: int | None,
        blocks: Sequence[BlockBytes],
    ) -> None:
        if not block_hashes:
            return
        layout = self._layout(layout_key)
        try:
            self._stub.PutBlocks(
                _batches(layout, block_hashes, parent_hash, blocks), timeout=self._save_timeout_s
            )
        except grpc.RpcError as exc:
            self._warn("save", exc)

    def discard(self, layout_key: str, block_hashes: Sequence[int]) -> None:
        # The kvmanager checks every block's size against its layout on PutBlocks and every disk
        # file's checksum on read, so it never hands out a block of the wrong size; nothing to drop.
        log.warning(
            "kvmanager %s served %d unusable blocks of layout %s: layouts disagree on block size",
            self.address,
            len(block_hashes),
            layout_key,
        )

    def close(self) -> None:
        self._channel.close()

    # ---- internals -----------------------------------------------------------------------
    def _layout(self, layout_key: str) -> kvmanager_pb2.KvLayout:
        pb = self._layouts.get(layout_key)
        if pb is None:
            pb = _layout_pb(kv_layout(layout_key))
            with self._lock:
                self._layouts[layout_key] = pb
        return pb

    def _warn(self, what: str, exc: grpc.RpcError) -> None:
        now = time.monotonic()
        if now - self._last_warning >= _WARN_EVERY_S:  # a down kvmanager: not a line per step
            self._last_warning = now
            code = exc.code() if isinstance(exc, grpc.Call) else None
            log.warning(
                "kvmanager %s %s failed (%s): recomputing instead",
                self.address,
                what,
                code.name if code is not None else exc,
            )


def _batches(
    layout: kvmanager_pb2.KvLayout,
    block_hashes: Sequence[int],
    parent_hash: int | None,
    blocks: Sequence[BlockBytes],
) -> Iterator[kvmanager_pb2.PutBlocksRequest]:
    msg = kvmanager_pb2.PutBlocksRequest(layout=layout)
    size = 0
    parent = parent_hash
    for h, data in zip(block_hashes, blocks, strict=True):
        b = msg.blocks.add(block_hash=h, data=bytes(data))
        if parent is not None:
            b.parent_hash = parent
        parent = h
        size += len(b.data)
        if size >= _PUT_BATCH_BYTES:
            yield msg
            msg = kvmanager_pb2.PutBlocksRequest()
            size = 0
    if msg.blocks:
        yield msg
