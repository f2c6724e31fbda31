"""The kvmanagers' tier event streams (KvManager.WatchKvEvents of one layout), fed to the index
as node stores, and the links from each worker to its node's store.

``TierSync`` follows ``/kvmesh/<cluster>/kvmanagers/`` (``on_snapshot`` / ``on_put`` /
``on_delete``, for a ``PrefixWatcher``) and the worker set (``refresh()`` after every worker
change). After each, it plans (``core/node_stores.py``) which (kvmanager, layout) streams the serving
workers need, opens and closes ``KvEventSubscriber`` streams to match (same snapshot, resume and
resync rules as the workers' streams), drops the stores of closed streams from the index, and
links or unlinks workers. A kvmanager that leaves etcd, or a worker whose layout or node changes,
so loses those lower tiers at once.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping, Sequence

import grpc

from kvmesh.discovery.keys import (
    WorkerRecord,
    kvmanager_from_entry,
    kvmanager_id_from_key,
    kvmanager_records,
)
from kvmesh.kv.events import KvEventBatch
from kvmesh.tls import Tls
from kvmesh.v1 import kvmanager_pb2, kvmanager_pb2_grpc

from .connections import ConnectionMap
from .core.index import KvIndex, StoreId
from .core.node_stores import KvManagerSet, TierPlan, TierStream, diff_plans, plan_tiers
from .kvsync import (
    BACKOFF_S,
    MAX_MESSAGE_BYTES,
    EventCall,
    KvEventSubscriber,
    KvStreamStats,
    OpenEvents,
    WatchFactory,
)

log = logging.getLogger(__name__)


def tier_events(layout_key: str) -> WatchFactory:
    """``KvManager.WatchKvEvents`` of one layout, by its key."""

    def factory(channel: grpc.aio.Channel) -> OpenEvents:
        stub = kvmanager_pb2_grpc.KvManagerStub(channel)

        def open_(epoch: str, from_seq: int) -> EventCall:
            request = kvmanager_pb2.KvManagerWatchKvEventsRequest(
                layout_key=layout_key, epoch=epoch, from_seq=from_seq
            )
            return stub.WatchKvEvents(request)

        return open_

    return factory


class TierSync:
    def __init__(
        self,
        cluster: str,
        index: KvIndex,
        workers: Callable[[], Iterable[WorkerRecord]],
        backoff_s: Sequence[float] = BACKOFF_S,
        max_message_bytes: int = MAX_MESSAGE_BYTES,
        tls: Tls | None = None,
    ) -> None:
        self._tls = tls
        self._cluster = cluster
        self.kvmanagers = KvManagerSet()
        self._index = index
        self._workers = workers
        self._backoff_s = tuple(backoff_s)
        self._max_message_bytes = max_message_bytes
        self._plan = TierPlan()
        self._streams: ConnectionMap[StoreId, KvEventSubscriber[StoreId]] = ConnectionMap(
            KvEventSubscriber.close
        )

    # ---- etcd (a PrefixWatcher on the kvmanagers prefix) -----------------------------------
    def on_snapshot(self, items: dict[str, str]) -> None:
        self.kvmanagers.apply_snapshot(kvmanager_records(self._cluster, items))
        self.refresh()

    def on_put(self, key: str, value: str) -> None:
        record = kvmanager_from_entry(self._cluster, key, value)
        if record is not None:
            self.kvmanagers.apply_put(record)
            self.refresh()

    def on_delete(self, key: str) -> None:
        kvmanager_id = kvmanager_id_from_key(self._cluster, key)
        if kvmanager_id is not None:
            self.kvmanagers.apply_delete(kvmanager_id)
            self.refresh()

    # ---- the plan ---------------------------------------------------------------------------
    def refresh(self) -> None:
        """Follows the kvmanagers and the worker set as they are now (on the loop)."""
        plan = plan_tiers(self._workers(), self.kvmanagers)
        changes = diff_plans(self._plan, plan)
        self._plan = plan
        if not changes:
            return
        index = self._index
        for sid in changes.stop:
            self._streams.drop(sid)
            index.drop_store(sid)
            log.info("tier events of %s: no longer needed (kvmanager or workers gone)", sid)
        for stream in changes.start:
            if stream.store in self._streams:  # the kvmanager moved: its old blocks are hints
                index.mark_degraded(stream.store)
            self._start(stream)
        for wid, linked in changes.links:
            index.link(wid, linked)

    def _start(self, stream: TierStream) -> None:
        sid = stream.store
        index = self._index

        def on_batch(batch: KvEventBatch) -> bool:
            return index.apply_store(sid, batch).needs_resync

        sub = KvEventSubscriber(
            sid,
            stream.address,
            on_batch,
            on_lost=index.mark_degraded,
            on_live=index.mark_live,
            backoff_s=self._backoff_s,
            max_message_bytes=self._max_message_bytes,
            watch=tier_events(stream.layout_key),
            tls=self._tls,
        )
        self._streams.put(sid, stream.address, sub)
        sub.start()
        log.info(
            "following tier events of kvmanager %s, layout %s, at %s",
            stream.kvmanager_id,
            stream.layout_key,
            stream.address,
        )

    # ---- queries ----------------------------------------------------------------------------
    @property
    def plan(self) -> TierPlan:
        return self._plan

    def stats(self) -> Mapping[StoreId, tuple[TierStream, KvStreamStats]]:
        streams = self._plan.streams
        return {sid: (streams[sid], sub.stats) for sid, sub in self._streams.items()}

    async def close(self) -> None:
        await self._streams.close()
