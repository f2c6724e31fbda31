"""kvmesh.v1.KvManager over gRPC: converts messages to core values, calls the store, streams
the per-layout tier events, and moves same-node block bytes through attached shared memory.

Spans: OpenTelemetry's server interceptor makes one span per RPC, parented by the caller's
trace context (gRPC metadata); inside it, ``kv.lookup`` and ``kv.get_blocks`` (and
``kv.fetch_from_peer``, in ``peer.py``) carry counts and ids, never block bytes."""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import grpc
from opentelemetry.trace import Span, Status, StatusCode

from kvmesh import errors
from kvmesh.kv.eventlog import KvEventLog
from kvmesh.kv.events import Tier
from kvmesh.kv.fanout import KvEventHub
from kvmesh.kv.layout import BadBlock, KvLayout, check_layout_key
from kvmesh.kv_stream import serve_kv_events
from kvmesh.kv_wire import TIER_PB, layout_from_pb
from kvmesh.telemetry import tracer
from kvmesh.v1 import kvmanager_pb2, kvmanager_pb2_grpc, worker_pb2

from .core.plan import LayoutEvent
from .core.rates import Transfer, TransferMeter
from .peer import FetchProgress, PeerRef, PeerService
from .shm import ALIGN, ShmRegistry
from .store import TieredStore

log = logging.getLogger(__name__)
_tracer = tracer(__name__)


class LayoutHubs:
    """One numbered event log (and subscriber fan-out) per layout, fed by the store's events."""

    def __init__(self, kvmanager_id: str, epoch: str, buffer_batches: int, queue_batches: int):
        self._id = kvmanager_id
        self.epoch = epoch
        self._buffer = buffer_batches
        self._queue = queue_batches
        self._hubs: dict[str, KvEventHub] = {}

    def hub(self, layout_key: str) -> KvEventHub:
        h = self._hubs.get(layout_key)
        if h is None:
            log_ = KvEventLog(self._id, self.epoch, self._buffer)
            h = self._hubs[layout_key] = KvEventHub(log_, self._queue)
        return h

    @property
    def layout_keys(self) -> list[str]:
        """The layouts events were published for (every layout a block was stored under)."""
        return list(self._hubs)

    def publish(self, events: list[LayoutEvent]) -> None:
        """The store's event sink (on the loop): one batch per layout per call, in order."""
        by_layout: dict[str, list] = {}  # type: ignore[type-arg]
        for e in events:
            by_layout.setdefault(e.layout_key, []).append(e.event)
        for key, evs in by_layout.items():
            self.hub(key).publish(evs)

    def close(self) -> None:
        for h in self._hubs.values():
            h.close()


class KvManagerServicer(kvmanager_pb2_grpc.KvManagerServicer):
    def __init__(
        self,
        store: TieredStore,
        hubs: LayoutHubs,
        info: Callable[[], kvmanager_pb2.KvManagerInfo],
        max_message_bytes: int,
        peers: PeerService,
        fetch_timeout_s: float,
        shm: ShmRegistry,
    ) -> None:
        self._peers = peers
        self._shm = shm
        self._fetch_timeout_s = fetch_timeout_s
        self._store = store
        self._hubs = hubs
        self._info = info
        self._max_message_bytes = max_message_bytes
        self.draining = False
        # Measured speeds of what this kvmanager serves and fetches (published on its record)
        self.rates = TransferMeter()

    def _check_serving(self) -> None:
        if self.draining:
            raise errors.Unavailable("kvmanager is shutting down; recompute or retry later")

    async def GetInfo(
        self, request: kvmanager_pb2.KvManagerInfoRequest, context: grpc.aio.ServicerContext
    ) -> kvmanager_pb2.KvManagerInfo:
        return self._info()

    async def RetainSession(
        self, request: kvmanager_pb2.RetainSessionRequest, context: grpc.aio.ServicerContext
    ) -> kvmanager_pb2.RetainSessionResponse:
        self._check_serving()
        got, held, previous_held = self._store.retain_session(
            request.tenant,
            request.session_id,
            request.layout_key,
            request.block_hashes,
            request.ttl_s,
        )
        return kvmanager_pb2.RetainSessionResponse(
            retained_blocks=got.retained_blocks,
            held_blocks=held,
            renewed=got.renewed,
            previous_blocks=len(got.previous),
            previous_held_blocks=previous_held,
            released_sessions=len(got.released),
            truncated=got.truncated,
        )

    async def ReleaseSession(
        self, request: kvmanager_pb2.ReleaseSessionRequest, context: grpc.aio.ServicerContext
    ) -> kvmanager_pb2.ReleaseSessionResponse:
        self._check_serving()
        if not request.session_id:
            raise errors.InvalidArgument("a session id is required", "session_id")
        released = self._store.release_session(request.tenant, request.session_id)
        return kvmanager_pb2.ReleaseSessionResponse(released=released)

    async def PrefetchSession(
        self, request: kvmanager_pb2.PrefetchSessionRequest, context: grpc.aio.ServicerContext
    ) -> kvmanager_pb2.PrefetchSessionResponse:
        self._check_serving()
        if not request.session_id:
            raise errors.InvalidArgument("a session id is required", "session_id")
        got = await self._store.prefetch_session(
            request.tenant, request.session_id, context.time_remaining()
        )
        return kvmanager_pb2.PrefetchSessionResponse(
            retained_blocks=got.retained,
            in_cpu_blocks=got.in_cpu,
            promoted_blocks=got.promoted,
            on_disk_blocks=got.on_disk,
            missing_blocks=got.missing,
        )

    async def Lookup(
        self, request: kvmanager_pb2.LookupRequest, context: grpc.aio.ServicerContext
    ) -> kvmanager_pb2.LookupResponse:
        self._check_serving()
        layout = layout_from_pb(request.layout)
        with _tracer.start_as_current_span("kv.lookup") as span:
            tiers = self._store.lookup(layout, request.block_hashes)
            if span.is_recording():
                span.set_attributes(
                    {
                        "kv.layout": layout.key,
                        "kv.blocks_asked": len(request.block_hashes),
                        "kv.blocks_found": len(tiers),
                    }
                )
        return kvmanager_pb2.LookupResponse(tiers=[TIER_PB[t] for t in tiers])

    async def PutBlocks(
        self,
        request_iterator: AsyncIterator[kvmanager_pb2.PutBlocksRequest],
        context: grpc.aio.ServicerContext,
    ) -> kvmanager_pb2.PutBlocksResponse:
        counts = _PutCounts()
        layout: KvLayout | None = None
        try:
            self._check_serving()
            async for msg in request_iterator:
                layout = await self._put_message(layout, msg, counts)
        except Exception as exc:  # sent with its status by the host's error interceptor
            log.info("PutBlocks ended after %d blocks: %s", counts.stored, exc)
            raise
        return kvmanager_pb2.PutBlocksResponse(stored=counts.stored, already_held=counts.held)

    async def PutBlockBatch(
        self, request: kvmanager_pb2.PutBlocksRequest, context: grpc.aio.ServicerContext
    ) -> kvmanager_pb2.PutBlocksResponse:
        counts = _PutCounts()
        try:
            self._check_serving()
            await self._put_message(None, request, counts)
        except Exception as exc:  # sent with its status by the host's error interceptor
            log.info("PutBlockBatch ended after %d blocks: %s", counts.stored, exc)
            raise
        return kvmanager_pb2.PutBlocksResponse(stored=counts.stored, already_held=counts.held)

    async def _put_message(
        self, layout: KvLayout | None, msg: kvmanager_pb2.PutBlocksRequest, counts: _PutCounts
    ) -> KvLayout:
        """Stores one PutBlocksRequest's blocks under its layout (or ``layout``, the stream's,
        when it names none); returns the layout in force after it."""
        if msg.HasField("layout"):
            got = layout_from_pb(msg.layout)
            if layout is not None:
                layout.require_same(got)
            layout = got
        if layout is None:
            raise errors.InvalidArgument(
                "the first PutBlocksRequest must name the layout (set layout)"
            )
        # Every shared-memory region of the message is copied out before the first await:
        # once a call is cancelled or over, its regions are never read again.
        blocks = [(b.block_hash, self._payload(layout, b), _parent(b)) for b in msg.blocks]
        for h, data, parent in blocks:
            if not await self._store.put(layout, h, data, parent):
                counts.held += 1
            counts.stored += 1
        return layout

    def _payload(self, layout: KvLayout, block: kvmanager_pb2.KvBlock) -> bytes | memoryview:
        """A PutBlocks block's bytes: inline, or copied out of its shared-memory region straight
        into the buffer the store will keep (an arena slot when one is free)."""
        if block.WhichOneof("payload") != "shm":
            return block.data
        r = block.shm
        if r.length != layout.block_bytes:
            raise BadBlock(
                f"block {block.block_hash:#x}: a shm region of {r.length} bytes for a block of"
                f" {layout.block_bytes} ({layout.describe()})"
            )
        data = memoryview(self._store.allocate(r.length))
        self._shm.get(r.shm_id).read_into(r.offset, data)
        self._shm.stats.bytes_in += data.nbytes
        return data

    async def GetBlocks(
        self, request: kvmanager_pb2.GetBlocksRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[kvmanager_pb2.GetBlocksResponse]:
        # start_span, not start_as_current_span: a context attached inside an async generator
        # may be detached from another task when the generator is closed.
        span = _tracer.start_span(
            "kv.get_blocks", attributes={"kv.blocks_asked": len(request.block_hashes)}
        )
        sent = _Sent()
        started = time.perf_counter()
        layout: KvLayout | None = None
        try:
            self._check_serving()
            layout = layout_from_pb(request.layout)
            span.set_attribute("kv.layout", layout.key)
            if request.HasField("shm"):
                span.set_attribute("kv.shm", True)
                async for msg in self._get_into_shm(layout, request, context, sent):
                    yield msg
                return
            for h in request.block_hashes:
                tier = next(iter(self._store.lookup(layout, [h])), None)
                data = await self._store.get(layout, h)
                if data is None:
                    yield kvmanager_pb2.GetBlocksResponse(missing=h)
                    return
                sent.add(tier, len(data))
                yield kvmanager_pb2.GetBlocksResponse(
                    block=kvmanager_pb2.KvBlock(block_hash=h, data=bytes(data)),
                    tier=TIER_PB[tier if tier is not None else Tier.CPU],
                )
        except Exception as exc:
            span.record_exception(exc)
            span.set_status(Status(StatusCode.ERROR, type(exc).__name__))
            raise
        finally:
            if layout is not None and sys.exc_info()[0] is None:  # served to its end
                sent.measure(self.rates, layout, time.perf_counter() - started)
            sent.end(span)

    async def _get_into_shm(
        self,
        layout: KvLayout,
        request: kvmanager_pb2.GetBlocksRequest,
        context: grpc.aio.ServicerContext,
        sent: _Sent,
    ) -> AsyncIterator[kvmanager_pb2.GetBlocksResponse]:
        """GetBlocks into the caller's segment: each block is copied to the next aligned offset
        of the region (inline once the region is full); the regions go back in runs."""
        region = request.shm
        self._shm.get(region.shm_id).check(region.offset, region.length)
        cursor, end = region.offset, region.offset + region.length
        msg = kvmanager_pb2.GetBlocksResponse()
        inline = 0
        for h in request.block_hashes:
            tier = next(iter(self._store.lookup(layout, [h])), None)
            data = await self._store.get(layout, h)
            if data is None:
                msg.missing = h
                break
            if context.done():
                return  # cancelled or past its deadline: the caller may reuse the region now
            sent.add(tier, len(data))
            start = -(-cursor // ALIGN) * ALIGN
            block = msg.blocks.add(block_hash=h)
            if start + len(data) <= end:
                # Looked up again after the await: a segment detached meanwhile is NOT_FOUND.
                self._shm.get(region.shm_id).write(start, data)
                self._shm.stats.bytes_out += len(data)
                block.shm.shm_id = region.shm_id
                block.shm.offset = start
                block.shm.length = len(data)
                cursor = start + len(data)
            else:
                block.data = bytes(data)
                inline += len(data)
            msg.tiers.append(TIER_PB[tier if tier is not None else Tier.CPU])
            if inline >= _INLINE_RUN_BYTES:
                yield msg
                msg, inline = kvmanager_pb2.GetBlocksResponse(), 0
        if msg.blocks or msg.HasField("missing"):
            yield msg

    async def AttachShm(
        self, request: kvmanager_pb2.AttachShmRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[kvmanager_pb2.AttachShmResponse]:
        self._check_serving()
        seg = self._shm.attach(request.name, request.size_bytes, request.token)
        try:
            yield kvmanager_pb2.AttachShmResponse(shm_id=seg.id)
            # The stream is the lease: it lasts until DetachShm or shutdown (then it ends OK), or
            # until the caller cancels it or its connection goes (then this task is cancelled).
            await seg.detached.wait()
        finally:
            self._shm.detach(seg.id)

    async def DetachShm(
        self, request: kvmanager_pb2.DetachShmRequest, context: grpc.aio.ServicerContext
    ) -> kvmanager_pb2.DetachShmResponse:
        return kvmanager_pb2.DetachShmResponse(detached=self._shm.detach(request.shm_id))

    def WatchKvEvents(
        self,
        request: kvmanager_pb2.KvManagerWatchKvEventsRequest,
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[worker_pb2.KvEventBatch]:
        # A plain function returning the stream (the error interceptor maps what either
        # raises), not a generator of its own: one hop fewer per batch.
        if request.layout_key:
            key = check_layout_key(request.layout_key)
            what = f"tier event (layout {key})"
        else:
            layout = layout_from_pb(request.layout)
            key, what = layout.key, f"tier event ({layout.describe()})"
        hub = self._hubs.hub(key)
        return serve_kv_events(
            hub,
            request.epoch,
            request.from_seq,
            context,
            self._max_message_bytes,
            what,
            "--max-message-bytes",
        )

    async def OpenFetch(
        self, request: kvmanager_pb2.OpenFetchRequest, context: grpc.aio.ServicerContext
    ) -> kvmanager_pb2.OpenFetchResponse:
        self._check_serving()
        if request.layout_key:
            key = check_layout_key(request.layout_key)
        else:
            key = layout_from_pb(request.layout).key
        grant = self._peers.open_fetch(key, request.block_hashes, request.ttl_s)
        resp = kvmanager_pb2.OpenFetchResponse(
            data_plane_address=grant.data_plane_address,
            token=grant.token,
            block_hashes=grant.block_hashes,
            layout_key=grant.layout_key,
            ttl_s=grant.ttl_s,
            data_plane_tls=grant.data_plane_tls,
            data_plane_auth_only=grant.data_plane_auth_only,
        )
        if grant.parent_hash is not None:
            resp.parent_hash = grant.parent_hash
        return resp

    async def FetchFromPeer(
        self, request: kvmanager_pb2.FetchFromPeerRequest, context: grpc.aio.ServicerContext
    ) -> kvmanager_pb2.FetchFromPeerResponse:
        progress = FetchProgress()
        layout: KvLayout | None = None
        source = request.peer_kvmanager_id or request.peer_address
        try:
            self._check_serving()
            layout = layout_from_pb(request.layout)
            peer = PeerRef(request.peer_kvmanager_id, request.peer_address)
            await self._peers.fetch(
                layout,
                request.block_hashes,
                peer,
                _budget(context, self._fetch_timeout_s),
                progress,
            )
        except Exception as exc:  # sent with its status by the host's error interceptor
            log.info("FetchFromPeer ended after %d blocks: %s", progress.fetched, exc)
            context.set_trailing_metadata(((FETCHED_KEY, str(progress.fetched)),))
            if layout is not None:
                # What arrived says how fast the link is; a fetch that ran out of time with
                # nothing stored says at least that one block takes longer than that.
                blocks = progress.fetched
                if not blocks and isinstance(exc, errors.DeadlineExceeded):
                    blocks = 1
                self._measure_peer(layout, source, blocks, progress.seconds)
            raise
        context.set_trailing_metadata(((FETCHED_KEY, str(progress.fetched)),))
        self._measure_peer(layout, source, progress.fetched, progress.seconds)
        return kvmanager_pb2.FetchFromPeerResponse(
            fetched=progress.fetched,
            already_held=progress.already_held,
            bytes=progress.bytes,
            seconds=progress.seconds,
            peer_missing=progress.peer_missing,
            prefix_blocks=progress.prefix_blocks,
        )

    def _measure_peer(self, layout: KvLayout, source: str, blocks: int, seconds: float) -> None:
        """One fetch's speed, for the kvmanager's own rate and that of the link to ``source``."""
        self.rates.add(layout.key, Transfer.PEER, blocks * layout.block_size, seconds, source)


class _Sent:
    """What one GetBlocks served: blocks, bytes, and blocks per tier (for its span)."""

    __slots__ = ("blocks", "bytes", "tiers")

    def __init__(self) -> None:
        self.blocks = 0
        self.bytes = 0
        self.tiers: dict[Tier, int] = {}

    def add(self, tier: Tier | None, nbytes: int) -> None:
        self.blocks += 1
        self.bytes += nbytes
        t = tier if tier is not None else Tier.CPU
        self.tiers[t] = self.tiers.get(t, 0) + 1

    def measure(self, meter: TransferMeter, layout: KvLayout, seconds: float) -> None:
        """One sample per tier served, the call's time split by blocks (a call is mostly one
        tier: a prefix's blocks sit together)."""
        if not self.blocks:
            return
        for tier, n in self.tiers.items():
            kind = Transfer.DISK if tier is Tier.DISK else Transfer.CPU
            meter.add(layout.key, kind, n * layout.block_size, seconds * n / self.blocks)

    def end(self, span: Span) -> None:
        if span.is_recording():
            attrs: dict[str, int] = {"kv.blocks_sent": self.blocks, "kv.bytes_sent": self.bytes}
            for tier, n in self.tiers.items():
                attrs[f"kv.blocks_from_{tier.value}"] = n
            span.set_attributes(attrs)
        span.end()


@dataclass(slots=True)
class _PutCounts:
    stored: int = 0  # blocks stored or found held
    held: int = 0  # of those, held already


def _parent(block: kvmanager_pb2.KvBlock) -> int | None:
    return block.parent_hash if block.HasField("parent_hash") else None


_INLINE_RUN_BYTES = 16 << 20  # GetBlocks into shm: inline bytes (region full) per message
FETCHED_KEY = "kvmesh-peer-fetched"  # trailing metadata of FetchFromPeer: blocks stored


def _budget(context: grpc.aio.ServicerContext, default_s: float) -> float:
    """The time this call may spend: the caller's deadline less a margin to answer in (so the
    caller hears what happened rather than its own DEADLINE_EXCEEDED), else ``default_s``."""
    left = context.time_remaining()
    if left is None:
        return default_s
    return left - min(0.25, 0.1 * left)
