"""The kvmanager's Prometheus metrics: per tier fill, hits, misses, bytes moved and evictions;
peer fetch (blocks and bytes fetched, failures) and the data plane (blocks and bytes served).

Refreshed on the event loop every few seconds from the store's counters (the HTTP thread never
reads the store, which the loop mutates). The ``*_total`` ones are Prometheus counters
(``MirroredCounter``: the store counts, the metric mirrors its totals), the rest gauges."""

from __future__ import annotations

from dataclasses import fields

from prometheus_client import CollectorRegistry, Gauge

from kvmesh.kv.events import Tier
from kvmesh.metrics import EtcdGauges, MirroredCounter

from .arena import ArenaStats
from .core.retention import RetentionStats
from .peer import DataPlaneStats, PeerService, PeerStats
from .store import StoreStats, TieredStore

_TIERS = (Tier.CPU, Tier.DISK)
_ARENA_COUNTERS = ("allocations", "fallbacks")  # the arena's cumulative stats


class KvManagerMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = r = registry or CollectorRegistry()
        self.etcd = EtcdGauges(r, "kvmesh_kvmanager", "kvmanager")
        self.capacity = Gauge(
            "kvmesh_kvmanager_tier_capacity_bytes", "Tier budget.", ["tier"], registry=r
        )
        self.used = Gauge(
            "kvmesh_kvmanager_tier_used_bytes",
            "Bytes held or being written on the tier (never above its budget).",
            ["tier"],
            registry=r,
        )
        self.blocks = Gauge(
            "kvmesh_kvmanager_tier_blocks", "Readable blocks on the tier.", ["tier"], registry=r
        )
        self.pinned = Gauge(
            "kvmesh_kvmanager_tier_pinned_blocks",
            "Blocks pinned by readers (never evicted while pinned).",
            ["tier"],
            registry=r,
        )
        # Per tier, for a dashboard's one query per panel. A get looks in RAM, then on disk:
        # a RAM miss is a disk hit or a miss; a disk miss is a miss (bad files included).
        self.tier_hits = MirroredCounter(
            "kvmesh_kvmanager_tier_hits_total",
            "Gets served from the tier since start.",
            ["tier"],
            registry=r,
        )
        self.tier_misses = MirroredCounter(
            "kvmesh_kvmanager_tier_misses_total",
            "Gets that looked in the tier and did not find the block there, since start.",
            ["tier"],
            registry=r,
        )
        self.evictions = MirroredCounter(
            "kvmesh_kvmanager_evictions_total",
            "Blocks removed from the tier to make room since start (demotions RAM -> disk and"
            " bad files dropped are not evictions).",
            ["tier"],
            registry=r,
        )
        self.evicted_bytes = MirroredCounter(
            "kvmesh_kvmanager_evicted_bytes_total",
            "Bytes of the blocks counted by kvmesh_kvmanager_evictions_total.",
            ["tier"],
            registry=r,
        )
        # Session retention (docs/agents.md#retention).
        self.retained_sessions = Gauge(
            "kvmesh_kvmanager_retained_sessions", "Live sessions whose blocks are kept.", registry=r
        )
        self.retention_budget = Gauge(
            "kvmesh_kvmanager_retention_budget_bytes", "The node's retention budget.", registry=r
        )
        self.retained_blocks = Gauge(
            "kvmesh_kvmanager_retained_blocks",
            "Retained blocks with a readable copy on the tier.",
            ["tier"],
            registry=r,
        )
        self.retained_bytes = Gauge(
            "kvmesh_kvmanager_retained_bytes",
            "Bytes of the retained copies on the tier.",
            ["tier"],
            registry=r,
        )
        self.retention = {
            f.name: MirroredCounter(
                f"kvmesh_kvmanager_retention_{f.name}_total",
                f"Session retention: {f.name.replace('_', ' ')} since start.",
                registry=r,
            )
            for f in fields(RetentionStats)
        }
        # The store's cumulative counters, mirrored as counters.
        self.counters = {
            f.name: MirroredCounter(
                f"kvmesh_kvmanager_{f.name}_total",
                f"Store counter {f.name} since start.",
                registry=r,
            )
            for f in fields(StoreStats)
        }
        self.peer = {
            f.name: MirroredCounter(
                f"kvmesh_kvmanager_peer_{f.name}_total",
                f"Peer fetch counter {f.name} since start.",
                registry=r,
            )
            for f in fields(PeerStats)
        }
        # The CPU tier's arena: capacity_bytes, populated_bytes, in_use_bytes as they are;
        # allocations and fallbacks (no slot free: a heap buffer instead) as counters.
        self.arena: dict[str, Gauge | MirroredCounter] = {
            f.name: (
                MirroredCounter(
                    f"kvmesh_kvmanager_arena_{f.name}_total",
                    f"CPU tier arena: {f.name} since start.",
                    registry=r,
                )
                if f.name in _ARENA_COUNTERS
                else Gauge(
                    f"kvmesh_kvmanager_arena_{f.name}",
                    f"CPU tier arena: {f.name.replace('_', ' ')}.",
                    registry=r,
                )
            )
            for f in fields(ArenaStats)
        }
        self.data_plane = {
            f.name: MirroredCounter(
                f"kvmesh_kvmanager_data_plane_{f.name}_total",
                f"Data plane (serving peers) counter {f.name} since start.",
                registry=r,
            )
            for f in fields(DataPlaneStats)
        }

    def refresh(self, store: TieredStore, peers: PeerService | None = None) -> None:
        for tier in _TIERS:
            u = store.usage(tier)
            self.capacity.labels(tier.value).set(u.budget_bytes)
            self.used.labels(tier.value).set(u.used_bytes)
            self.blocks.labels(tier.value).set(u.blocks)
            self.pinned.labels(tier.value).set(u.pinned)
        for name, gauge in self.counters.items():
            gauge.set(getattr(store.stats, name))
        retention = store.retention
        self.retained_sessions.set(len(retention))
        self.retention_budget.set(retention.budget_bytes)
        for name, counter in self.retention.items():
            counter.set(getattr(retention.stats, name))
        for tier, (blocks, nbytes) in store.retained_usage().items():
            self.retained_blocks.labels(tier.value).set(blocks)
            self.retained_bytes.labels(tier.value).set(nbytes)
        s = store.stats
        self.tier_hits.labels(Tier.CPU.value).set(s.hits_cpu)
        self.tier_misses.labels(Tier.CPU.value).set(s.hits_disk + s.misses)
        if store.has_disk:  # a get looks on disk only if there is a disk tier
            self.tier_hits.labels(Tier.DISK.value).set(s.hits_disk)
            self.tier_misses.labels(Tier.DISK.value).set(s.misses)
        for tier in _TIERS:
            blocks, nbytes = store.evictions(tier)
            self.evictions.labels(tier.value).set(blocks)
            self.evicted_bytes.labels(tier.value).set(nbytes)
        if (arena := store.arena_stats) is not None:
            for name, metric in self.arena.items():
                metric.set(getattr(arena, name))
        if peers is not None:
            for name, gauge in self.peer.items():
                gauge.set(getattr(peers.stats, name))
            if peers.data_plane_stats is not None:
                for name, gauge in self.data_plane.items():
                    gauge.set(getattr(peers.data_plane_stats, name))
