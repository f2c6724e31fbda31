"""The server side of a ``WatchKvEvents`` stream, shared by the worker and the kvmanager: initial
metadata (how far the log is), then the first batches (a snapshot, or the missed batches of a
resumed epoch, encoded off the event loop), then live batches until the hub closes."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import grpc

from kvmesh import errors
from kvmesh.kv.fanout import KvEventHub
from kvmesh.kv_wire import KV_EPOCH_KEY, KV_RESUMED_KEY, KV_SEQ_KEY, kv_batch_to_pb
from kvmesh.v1 import worker_pb2

log = logging.getLogger(__name__)


async def serve_kv_events(
    hub: KvEventHub,
    epoch: str,
    from_seq: int,
    context: grpc.aio.ServicerContext,
    max_send_bytes: int = 0,
    what: str = "KV event",
    limit_setting: str = "",
) -> AsyncIterator[worker_pb2.KvEventBatch]:
    """Streams ``hub``'s batches to one subscriber that asked to resume at (epoch, from_seq).
    ``max_send_bytes`` (0: no limit): a larger snapshot ends the call RESOURCE_EXHAUSTED, naming
    ``limit_setting`` (the setting that raises the limit)."""
    sub = hub.subscribe(epoch, from_seq)
    try:
        # Headers first: they tell the subscriber how far the log is, so one that resumed with
        # nothing missed knows at once that it is up to date.
        await context.send_initial_metadata(
            (
                (KV_EPOCH_KEY, hub.log.epoch),
                (KV_SEQ_KEY, str(hub.log.seq)),
                (KV_RESUMED_KEY, "1" if sub.resumed else "0"),
            )
        )
        # The batches are immutable values: a big snapshot is encoded off the event loop.
        first = await asyncio.to_thread(lambda: [kv_batch_to_pb(b) for b in sub.initial])
        if sub.resumed:
            log.info(
                "%s subscriber resumed epoch=%s from seq %d (%d batches missed)",
                what,
                epoch,
                from_seq,
                len(first),
            )
        else:
            size = first[0].ByteSize()
            log.info(
                "%s subscriber starts with a snapshot: epoch=%s seq=%d blocks=%d bytes=%d "
                "(asked for epoch=%r from seq %d)",
                what,
                hub.log.epoch,
                first[0].seq,
                sum(len(e.stored.block_hashes) for e in first[0].events),
                size,
                epoch,
                from_seq,
            )
            if max_send_bytes and size > max_send_bytes:
                raise errors.ResourceExhausted(
                    f"the {what} snapshot is {size} bytes, over the send limit of "
                    f"{max_send_bytes} bytes ({limit_setting or 'max_send_bytes'})"
                )
        for msg in first:
            yield msg
        while (batch := await sub.next()) is not None:
            yield kv_batch_to_pb(batch)
    except errors.KvmeshError as exc:  # sent with its status by the host's error interceptor
        log.info("%s stream ended: %s", what, exc)
        raise
    finally:
        sub.close()
