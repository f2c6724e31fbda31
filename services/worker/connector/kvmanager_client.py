"""``KvManagerBlockClient``: the connector's block store is the node's kvmanager daemon
(kvmesh.v1.KvManager over gRPC: Lookup, GetBlocks, PutBlocks, PutBlockBatch).

Runs inside vLLM's engine process, on the engine thread (lookup, load) and the connector's saver
thread (lookup, save): a synchronous gRPC channel, which is thread-safe. Every call has a
deadline, and a kvmanager that is down, slow or refuses answers "nothing" (0 blocks, no bytes):
the engine recomputes, it never waits long and never fails a request for it.

Same node, the bytes move through shared memory (docs/connector.md#shared-memory): a background
thread creates a segment in /dev/shm and attaches it to the kvmanager (``AttachShm``, whose
stream is the lease). Saves copy blocks into the segment's save area and send only regions
(``PutBlockBatch``, a unary call: a client-streaming one costs ~3x the CPU in this process);
loads name the load area and get the blocks back as views of it, valid until the next ``load``.
Until the segment is attached, or when it cannot be (another node, shared memory off), the bytes
travel inside the messages.

Tracing: a request's W3C trace context (``traceparent``/``tracestate``, put into its
``kv_transfer_params`` under ``TRACE_PARAM`` by the worker) goes out unchanged as gRPC metadata
on the calls made for that request (``traced_calls``), so the kvmanager's spans join the
request's trace. This process needs no OpenTelemetry SDK for that. Saves (the saver thread,
batches of several requests) go untraced.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from kvmesh.kv.events import Tier
from kvmesh.kv.layout import KvLayout
from kvmesh.kv_wire import TIER_OF, layout_to_pb
from kvmesh.tls import Tls, open_blocking_channel
from kvmesh.v1 import kvmanager_pb2, kvmanager_pb2_grpc

from .client import BlockBytes, SaveChain, StoreConfig
from .layout import parse_layout_key
from .shm import SHM_DIR, ShmSegment

log = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 64 * 1024 * 1024  # the kvmanager's default max_message_bytes
# The kvmanager is a local daemon: after it restarts, find it again within about a second
# instead of gRPC's default reconnect backoff (1 s growing to 120 s), during which every lookup
# would fail fast and the engine would recompute what the kvmanager holds.
RECONNECT_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
]
_PUT_BATCH_BYTES = 16 * 1024 * 1024  # payload per PutBlocksRequest
_WARN_EVERY_S = 30.0
SHM_BYTES = 256 * 1024 * 1024  # default segment size: half for saves, half for loads
_SHM_RETRY_S = 30.0  # after a refused AttachShm (another node, shm off), try again this late
_SHM_REATTACH_S = 1.0  # after a lease that ended (kvmanager restart, detach), attach again
_DETACH_TIMEOUT_S = 1.0


TRACE_PARAM = "kvmesh_trace"
"""The key of the request's trace context in its ``kv_transfer_params``: a dict of W3C headers
(``traceparent``, optionally ``tracestate``), as ``opentelemetry.propagate.inject`` writes them."""
TRACE_HEADERS = ("traceparent", "tracestate")

TraceMetadata = tuple[tuple[str, str], ...]
"""gRPC metadata carrying a trace context (plain strings: it is pickled between processes)."""

_call_metadata: ContextVar[TraceMetadata | None] = ContextVar(
    "kvmesh_kv_call_metadata", default=None
)


def trace_metadata(params: Mapping[str, Any] | None) -> TraceMetadata | None:
    """The gRPC metadata for the trace context in a request's ``kv_transfer_params``; None when
    it carries none (or a malformed one: tracing never fails a request)."""
    raw = params.get(TRACE_PARAM) if isinstance(params, Mapping) else None
    if not isinstance(raw, Mapping) or not isinstance(raw.get("traceparent"), str):
        return None
    if not raw["traceparent"]:
        return None
    return tuple((k, v) for k in TRACE_HEADERS if isinstance(v := raw.get(k), str) and v)


@contextlib.contextmanager
def traced_calls(metadata: TraceMetadata | None) -> Iterator[None]:
    """kvmanager calls made in this block (this thread or context) carry ``metadata``."""
    token = _call_metadata.set(metadata)
    try:
        yield
    finally:
        _call_metadata.reset(token)


def call_metadata() -> TraceMetadata | None:
    """The metadata ``traced_calls`` set for the calls made now (None: untraced)."""
    return _call_metadata.get()


@dataclass(frozen=True, slots=True)
class _Link:
    """An attached segment: valid while it is ``KvManagerBlockClient._link``."""

    segment: ShmSegment
    shm_id: int
    lease: grpc.Future  # the AttachShm call: cancelling it detaches


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


class KvManagerBlockClient:
    """A ``KvBlockClient`` over a kvmanager at ``address`` (host:port). ``shm_bytes`` > 0: move
    bytes through a shared-memory segment of that size when the kvmanager can attach it."""

    def __init__(
        self,
        address: str,
        lookup_timeout_s: float = 0.5,
        load_timeout_s: float = 10.0,
        save_timeout_s: float = 30.0,
        shm_bytes: int = SHM_BYTES,
        shm_dir: Path = SHM_DIR,
        tls: Tls | None = None,
    ) -> None:
        """``tls``: mutual TLS to the kvmanager with the worker's certificate (``kvmesh/tls.py``;
        shared memory works the same over it); None: plaintext."""
        self.address = address
        self._lookup_timeout_s = lookup_timeout_s
        self._load_timeout_s = load_timeout_s
        self._save_timeout_s = save_timeout_s
        self._channel = open_blocking_channel(
            address,
            tls,
            options=[
                ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                *RECONNECT_OPTIONS,
            ],
        )
        self._stub = kvmanager_pb2_grpc.KvManagerStub(self._channel)
        self._layouts: dict[str, kvmanager_pb2.KvLayout] = {}
        self._lock = threading.Lock()
        self._last_warning = 0.0
        # Shared memory: the attached segment (None: bytes go inline), the lock of each of its
        # areas (held while a call uses it), and the thread that attaches and holds the lease.
        self._shm_bytes = shm_bytes
        self._shm_dir = shm_dir
        self._link: _Link | None = None
        self._attached = threading.Event()
        self._save_area = threading.Lock()
        self._load_area = threading.Lock()
        self._closing = threading.Event()
        self._lease: grpc.Future | None = None  # the AttachShm call in progress, if any
        self._shm_thread: threading.Thread | None = None  # started by the first save or load

    @classmethod
    def from_config(cls, config: StoreConfig) -> KvManagerBlockClient:
        """The ``client_factory`` for ``StoreConfig(store="factory")``: ``store_path`` holds the
        kvmanager's host:port."""
        if not config.store_path:
            raise ValueError("the kvmanager client needs store_path = the kvmanager's host:port")
        return cls(config.store_path, tls=config.client_tls())

    def wait_shm(self, timeout_s: float) -> bool:
        """Starts attaching a shared-memory segment if that has not started, and waits until
        one is attached; False if none is after ``timeout_s``."""
        self._start_shm()
        return self._attached.wait(timeout_s) and self._link is not None

    @property
    def shm_id(self) -> int | None:
        """The id of the attached segment (None: bytes go inline)."""
        link = self._link
        return link.shm_id if link is not None else None

    # ---- KvBlockClient -------------------------------------------------------------------
    def lookup(self, layout_key: str, block_hashes: Sequence[int]) -> int:
        return len(self.lookup_tiers(layout_key, block_hashes))

    def lookup_tiers(self, layout_key: str, block_hashes: Sequence[int]) -> list[Tier]:
        """The kvmanager's tier (CPU or disk) of each leading block it holds."""
        if not block_hashes:
            return []
        try:
            resp = self._stub.Lookup(
                kvmanager_pb2.LookupRequest(
                    layout=self._layout(layout_key), block_hashes=block_hashes
                ),
                timeout=self._lookup_timeout_s,
                metadata=_call_metadata.get(),
            )
        except grpc.RpcError as exc:
            self._warn("lookup", exc)
            return []
        return [TIER_OF.get(t, Tier.CPU) for t in resp.tiers]

    def load(self, layout_key: str, block_hashes: Sequence[int]) -> list[BlockBytes] | None:
        """Blocks loaded through shared memory are views of this client's segment: valid until
        the next ``load`` call (use or copy them before)."""
        if not block_hashes:
            return []
        layout = self._layout(layout_key)
        link = self._link
        if link is None:
            self._start_shm()
        if link is not None and self._load_area.acquire(blocking=False):
            try:
                if self._link is link:  # still attached: the segment stays mapped meanwhile
                    return self._load_shm(link, layout, block_hashes)
            finally:
                self._load_area.release()
        return self._load_inline(layout, block_hashes)

    def save(
        self,
        layout_key: str,
        block_hashes: Sequence[int],
        parent_hash: int | None,
        blocks: Sequence[BlockBytes],
    ) -> None:
        self.save_chains(layout_key, [SaveChain(block_hashes, parent_hash, blocks)])

    def save_chains(self, layout_key: str, chains: Sequence[SaveChain]) -> int:
        """Every chain in as few PutBlocks calls as the save area allows (one, usually); the
        kvmanager skips the blocks it holds. Returns how many it held already."""
        items = _items(chains)
        if not items:
            return 0
        layout = self._layout(layout_key)
        link = self._link
        if link is None:
            self._start_shm()
        held = 0
        if link is not None and self._save_area.acquire(blocking=False):
            try:
                if self._link is link:
                    got = self._save_shm(link, layout, items)
                    if got is None:
                        return 0  # failed: those blocks are a later miss
                    done, held = got
                    items = items[done:]
                    if not items:
                        return held
            finally:
                self._save_area.release()
        return held + self._save_inline(layout, items)

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
        with self._lock:
            self._closing.set()
        link = self._link
        if link is not None:
            self._detach(link)
        lease = self._lease
        if lease is not None:
            lease.cancel()
        if self._shm_thread is not None:
            self._shm_thread.join(5.0)
        self._channel.close()

    # ---- the bytes inline ------------------------------------------------------------------
    def _load_inline(
        self, layout: kvmanager_pb2.KvLayout, block_hashes: Sequence[int]
    ) -> list[BlockBytes]:
        out: list[BlockBytes] = []
        call = self._stub.GetBlocks(
            kvmanager_pb2.GetBlocksRequest(layout=layout, block_hashes=block_hashes),
            timeout=self._load_timeout_s,
            metadata=_call_metadata.get(),
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

    def _save_inline(self, layout: kvmanager_pb2.KvLayout, items: Sequence[_Item]) -> int:
        try:
            resp = self._stub.PutBlocks(_batches(layout, items), timeout=self._save_timeout_s)
        except grpc.RpcError as exc:
            self._warn("save", exc)
            return 0
        return int(resp.already_held)

    # ---- the bytes through shared memory ---------------------------------------------------
    def _load_shm(
        self, link: _Link, layout: kvmanager_pb2.KvLayout, block_hashes: Sequence[int]
    ) -> list[BlockBytes]:
        """GetBlocks into the load area (the caller holds it); blocks that do not fit come
        inline. A call that does not end cleanly gives the segment up (``_detach``): the
        kvmanager might still be writing into the area, which the next load would read."""
        start, length = link.segment.load_area
        region = kvmanager_pb2.ShmRegion(shm_id=link.shm_id, offset=start, length=length)
        call = self._stub.GetBlocks(
            kvmanager_pb2.GetBlocksRequest(layout=layout, block_hashes=block_hashes, shm=region),
            timeout=self._load_timeout_s,
            metadata=_call_metadata.get(),
        )
        buf = link.segment.buf
        out: list[BlockBytes] = []
        clean = True
        try:
            for msg in call:
                for b in msg.blocks:
                    if len(out) >= len(block_hashes) or b.block_hash != block_hashes[len(out)]:
                        clean = False
                        break
                    if b.WhichOneof("payload") != "shm":
                        out.append(b.data)
                        continue
                    r = b.shm
                    if r.shm_id != link.shm_id or not (
                        start <= r.offset and r.offset + r.length <= start + length
                    ):
                        clean = False
                        break
                    out.append(buf[r.offset : r.offset + r.length])
                if not clean:
                    log.warning("kvmanager %s answered GetBlocks out of order", self.address)
                    del out[:]
                    break
        except grpc.RpcError as exc:
            clean = False
            self._warn("load", exc)
        finally:
            call.cancel()
        if not clean:
            self._detach(link)
        return out

    def _save_shm(
        self, link: _Link, layout: kvmanager_pb2.KvLayout, items: Sequence[_Item]
    ) -> tuple[int, int] | None:
        """PutBlocks through the save area (the caller holds it): fills it with blocks, sends
        their regions, and once stored fills it again. Returns how many leading items are done
        (the rest do not fit the area: send them inline) and how many of those the kvmanager
        held already, or None when a call failed."""
        start, length = link.segment.save_area
        buf = link.segment.buf
        done = held = 0
        while done < len(items):
            msg = kvmanager_pb2.PutBlocksRequest(layout=layout)
            cursor = start
            n = done
            while n < len(items):
                h, parent, block = items[n]
                data = memoryview(block).cast("B")
                if cursor + data.nbytes > start + length:
                    break
                buf[cursor : cursor + data.nbytes] = data
                b = msg.blocks.add(block_hash=h)
                b.shm.shm_id, b.shm.offset, b.shm.length = link.shm_id, cursor, data.nbytes
                if parent is not None:
                    b.parent_hash = parent
                cursor += -(-data.nbytes // 64) * 64
                n += 1
            if n == done:
                return done, held  # a block larger than the area
            try:
                resp = self._stub.PutBlockBatch(msg, timeout=self._save_timeout_s)
            except grpc.RpcError as exc:
                self._warn("save", exc)
                # It may still be reading the area: never write it again.
                self._detach(link)
                return None
            held += resp.already_held
            done = n
        return done, held

    def _start_shm(self) -> None:
        """Starts the shared-memory thread once (a client that only looks up, as the scheduler's
        does, never makes a segment); until it has attached one, bytes go inline."""
        if self._shm_thread is not None or self._shm_bytes <= 0:
            return
        with self._lock:
            if self._shm_thread is None and not self._closing.is_set():
                self._shm_thread = threading.Thread(
                    target=self._run_shm, name="kvmesh-kv-shm", daemon=True
                )
                self._shm_thread.start()

    def _run_shm(self) -> None:
        """The shared-memory thread: attach a segment, hold the lease until it ends, again."""
        while not self._closing.is_set():
            attached = self._attach_and_hold()
            self._closing.wait(_SHM_REATTACH_S if attached else _SHM_RETRY_S)

    def _attach_and_hold(self) -> bool:
        """Creates a segment and attaches it; blocks while attached. False: it was refused."""
        try:
            segment = ShmSegment(self._shm_bytes, self._shm_dir)
        except OSError as exc:
            log.info("no shared memory for kvmanager %s (%s): bytes go inline", self.address, exc)
            return False
        attached = False
        try:
            call = self._stub.AttachShm(
                kvmanager_pb2.AttachShmRequest(
                    name=segment.name, size_bytes=segment.size, token=segment.token
                )
            )  # no deadline: the call lasts as long as the attachment (close cancels it)
            self._lease = call
            if self._closing.is_set():
                call.cancel()
            first = next(call, None)
            segment.unlink()  # the kvmanager did already, once it had mapped it
            if first is None or self._closing.is_set():
                return False
            attached = True
            self._link = _Link(segment, first.shm_id, call)
            self._attached.set()
            log.info(
                "kvmanager %s attached shared memory %s (%d bytes)",
                self.address,
                segment.name,
                segment.size,
            )
            for _ in call:  # the lease: ends on detach, cancel, or the kvmanager going away
                pass
        except grpc.RpcError as exc:
            if not attached and not self._closing.is_set():
                code = exc.code() if isinstance(exc, grpc.Call) else None
                log.info(
                    "kvmanager %s cannot attach shared memory (%s: %s): bytes go inline",
                    self.address,
                    code.name if code is not None else "error",
                    exc.details() if isinstance(exc, grpc.Call) else exc,
                )
        finally:
            self._link = None
            self._attached.clear()
            self._lease = None
            with self._save_area, self._load_area:  # no call is using the segment any more
                segment.close()
        return attached

    def _detach(self, link: _Link) -> None:
        """Stops using ``link``: the kvmanager unmaps it (DetachShm answers once it has), the
        lease ends, and the thread attaches a fresh segment."""
        if self._link is link:
            self._link = None
        try:
            self._stub.DetachShm(
                kvmanager_pb2.DetachShmRequest(shm_id=link.shm_id), timeout=_DETACH_TIMEOUT_S
            )
        except grpc.RpcError as exc:
            log.info("kvmanager %s DetachShm failed: %s", self.address, exc)
        link.lease.cancel()

    # ---- internals -----------------------------------------------------------------------
    def _layout(self, layout_key: str) -> kvmanager_pb2.KvLayout:
        pb = self._layouts.get(layout_key)
        if pb is None:
            pb = layout_to_pb(kv_layout(layout_key))
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


_Item = tuple[int, int | None, BlockBytes]
"""One block to save: its hash, its parent's (None: a chain's first) and its bytes."""


def _items(chains: Sequence[SaveChain]) -> list[_Item]:
    """The blocks of ``chains``, each with its parent: one PutBlocks stream carries them all."""
    out: list[_Item] = []
    for c in chains:
        parent = c.parent_hash
        for h, data in zip(c.block_hashes, c.blocks, strict=True):
            out.append((h, parent, data))
            parent = h
    return out


def _batches(
    layout: kvmanager_pb2.KvLayout, items: Sequence[_Item]
) -> Iterator[kvmanager_pb2.PutBlocksRequest]:
    msg = kvmanager_pb2.PutBlocksRequest(layout=layout)
    size = 0
    for h, parent, data in items:
        b = msg.blocks.add(block_hash=h, data=bytes(data))
        if parent is not None:
            b.parent_hash = parent
        size += len(b.data)
        if size >= _PUT_BATCH_BYTES:
            yield msg
            msg = kvmanager_pb2.PutBlocksRequest()
            size = 0
    if msg.blocks:
        yield msg
