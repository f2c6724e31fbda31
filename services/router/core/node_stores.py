"""Which node store backs which worker's lower tiers. Pure: the adapter (``tiersync.py``) feeds
the kvmanagers' etcd records in and carries the plan out (tier event streams, index links).

Each node runs one kvmanager (``/kvmesh/<cluster>/kvmanagers/<id>``, ``KvManagerRecord.node``).
A worker publishes its ``node`` and ``kv_layout``, the key of the KV layout of the blocks it saves
to that node's kvmanager. For every kvmanager and every layout used by a serving worker (on any
node: other nodes' workers may fetch from it, ``peers.py``), the router follows that kvmanager's
tier event stream of that layout (a *store* in the index), and links each worker to its node's
store; a block means nothing across layouts, so each layout is its own store, and a worker on a
node without a kvmanager (or without a layout) has no lower tiers.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from kvmesh.discovery.keys import KvManagerRecord, WorkerId, WorkerRecord, WorkerState

from .index_types import StoreId, store_id

log = logging.getLogger(__name__)

_LAYOUT_KEY = re.compile(r"[0-9a-f]{16}")  # KvLayout.key: 16 lowercase hex digits


class KvManagerSet:
    """The live kvmanagers, fed by etcd (like ``WorkerSet``: the adapter parses the records,
    ``kvmesh/discovery/keys.py``)."""

    def __init__(self) -> None:
        self._by_id: dict[str, KvManagerRecord] = {}

    def apply_snapshot(self, records: Iterable[KvManagerRecord]) -> None:
        self._by_id = {r.kvmanager_id: r for r in records}

    def apply_put(self, record: KvManagerRecord) -> None:
        self._by_id[record.kvmanager_id] = record

    def apply_delete(self, kvmanager_id: str) -> None:
        self._by_id.pop(kvmanager_id, None)

    def get(self, kvmanager_id: str) -> KvManagerRecord | None:
        return self._by_id.get(kvmanager_id)

    def s_per_token(self, kvmanager_id: str, layout_key: str, kind: str) -> float:
        """The transfer speed the kvmanager measured and published (its record's
        ``transfer_s_per_token``), seconds per token; 0: none (``scheduler.TransferRates``)."""
        rec = self._by_id.get(kvmanager_id)
        if rec is None:
            return 0.0
        return rec.transfer_s_per_token.get(layout_key, {}).get(kind, 0.0)

    def peer_s_per_token(self, kvmanager_id: str, peer_id: str, layout_key: str) -> float:
        """How fast ``kvmanager_id`` fetched from ``peer_id`` (its record's
        ``peer_s_per_token``: that one link), seconds per token; 0: never measured
        (``peer_cost.LinkRates``)."""
        rec = self._by_id.get(kvmanager_id)
        if rec is None:
            return 0.0
        return rec.peer_s_per_token.get(peer_id, {}).get(layout_key, 0.0)

    def __len__(self) -> int:
        return len(self._by_id)

    def by_node(self) -> dict[str, KvManagerRecord]:
        """The kvmanager of each node. Should two claim one node, the smallest id serves it
        (deterministic on every router)."""
        out: dict[str, KvManagerRecord] = {}
        for kid in sorted(self._by_id):
            rec = self._by_id[kid]
            if rec.node and rec.address:
                if rec.node in out:
                    log.debug(
                        "kvmanagers %s and %s both claim node %s", out[rec.node], kid, rec.node
                    )
                    continue
                out[rec.node] = rec
        return out


@dataclass(frozen=True, slots=True)
class TierStream:
    """One kvmanager's tier event stream of one layout: a store in the index."""

    store: StoreId
    kvmanager_id: str
    layout_key: str
    address: str  # the kvmanager's gRPC host:port


@dataclass(frozen=True, slots=True)
class TierPlan:
    """The streams to follow and which store each worker's lower tiers are."""

    streams: Mapping[StoreId, TierStream] = field(default_factory=dict)
    links: Mapping[WorkerId, StoreId] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class TierChanges:
    """What it takes to go from one plan to the next."""

    start: tuple[TierStream, ...] = ()  # new streams, or ones whose kvmanager moved
    stop: tuple[StoreId, ...] = ()  # streams no longer wanted: forget their stores
    links: tuple[tuple[WorkerId, StoreId | None], ...] = ()  # to set (None: unlink)

    def __bool__(self) -> bool:
        return bool(self.start or self.stop or self.links)


def plan_tiers(workers: Iterable[WorkerRecord], kvmanagers: KvManagerSet) -> TierPlan:
    """The plan for the serving workers (a draining worker is not routed to: no lower tiers).

    Every kvmanager is followed for every layout some serving worker uses, on any node: a
    kvmanager whose node has no worker of that layout (any more) still holds blocks a worker
    elsewhere may fetch from it (peer hints, ``peers.py``). Workers link to their node's store."""
    by_node = kvmanagers.by_node()
    layouts: set[str] = set()
    links: dict[WorkerId, StoreId] = {}
    for rec in workers:
        if rec.state is not WorkerState.SERVING or not rec.kv_layout:
            continue
        if not _LAYOUT_KEY.fullmatch(rec.kv_layout):
            log.debug("worker %s: kv_layout %r is not a layout key", rec.worker_id, rec.kv_layout)
            continue
        layouts.add(rec.kv_layout)
        kvm = by_node.get(rec.node)
        if kvm is not None:
            links[rec.worker_id] = store_id(kvm.kvmanager_id, rec.kv_layout)
    streams: dict[StoreId, TierStream] = {}
    for kvm in by_node.values():
        for layout in sorted(layouts):
            sid = store_id(kvm.kvmanager_id, layout)
            streams[sid] = TierStream(sid, kvm.kvmanager_id, layout, kvm.address)
    return TierPlan(streams, links)


def diff_plans(old: TierPlan, new: TierPlan) -> TierChanges:
    start = tuple(
        s
        for sid, s in sorted(new.streams.items())
        if (o := old.streams.get(sid)) is None or o.address != s.address
    )
    stop = tuple(sorted(sid for sid in old.streams if sid not in new.streams))
    links: list[tuple[WorkerId, StoreId | None]] = [
        (wid, sid) for wid, sid in sorted(new.links.items()) if old.links.get(wid) != sid
    ]
    links += [(wid, None) for wid in sorted(old.links) if wid not in new.links]
    return TierChanges(start, stop, tuple(links))
