"""Peer hints: after the scheduler picks a worker, name another node's kvmanager that holds a
longer prefix of the request than the worker itself (its engine, its node's kvmanager), so that
the worker's connector can have its own kvmanager fetch the difference (KvManager.FetchFromPeer)
instead of recomputing it. Pure: the KV index answers, nothing is called.

A peer must hold blocks of the worker's own KV layout (a block hash means nothing across
layouts), so the candidates are the other kvmanagers' stores of the layout of the worker's
linked store; a worker with no linked store has no kvmanager to fetch into and gets no hint.
Cost: one walk over the request's hashes for all peer stores (a miss is one dict lookup), plus
the worker's own match when some peer holds anything.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from kvmesh.discovery.keys import WorkerId
from kvmesh.errors import InvalidArgument
from kvmesh.kv.events import BlockHash

from .index_types import PrefixMatch, StoreId, StoreMatch, store_parts
from .types import PeerHint


class StoreIndex(Protocol):
    """What peer hints need of the KV index (``KvIndex`` has it)."""

    def linked(self, worker_id: WorkerId) -> StoreId | None: ...

    def stores(self) -> tuple[StoreId, ...]: ...

    def match_stores(
        self, hashes: Sequence[BlockHash], stores: Iterable[StoreId] | None = None
    ) -> Mapping[StoreId, StoreMatch]: ...

    def match(
        self, hashes: Sequence[BlockHash], workers: Iterable[WorkerId] | None = None
    ) -> Mapping[WorkerId, PrefixMatch]: ...


@dataclass(frozen=True, slots=True)
class PeerHintConfig:
    enabled: bool = True  # name a peer kvmanager in the worker call when one holds more
    # Hint only when the peer holds at least this many more blocks than the worker: fewer are
    # cheaper to recompute than a fetch's round trips.
    min_gain_blocks: int = 4

    def __post_init__(self) -> None:
        if self.min_gain_blocks < 1:
            raise InvalidArgument(
                f"peer hint min_gain_blocks is {self.min_gain_blocks}; use 1 or more"
            )


class PeerHints:
    """``hint(hashes, worker_id)``: the best peer for a request routed to a worker, if any."""

    def __init__(self, index: StoreIndex, config: PeerHintConfig | None = None) -> None:
        self._index = index
        self._cfg = config or PeerHintConfig()

    def hint(self, hashes: Sequence[BlockHash], worker_id: WorkerId) -> PeerHint | None:
        """The store of the worker's layout on another kvmanager with the longest contiguous
        prefix of ``hashes`` (ties: smallest store id), when it beats what the worker holds by
        ``min_gain_blocks`` or more; else None."""
        if not self._cfg.enabled or not hashes:
            return None
        index = self._index
        own = index.linked(worker_id)
        if own is None:
            return None
        own_kvm, layout = store_parts(own)
        peers = [
            s
            for s in index.stores()
            if s != own and (parts := store_parts(s))[1] == layout and parts[0] != own_kvm
        ]
        if not peers:
            return None
        best = next(iter(index.match_stores(hashes, peers).values()), None)
        if best is None or best.blocks < self._cfg.min_gain_blocks:
            return None
        mine = index.match(hashes, [worker_id]).get(worker_id)
        local = mine.blocks if mine is not None else 0
        if best.blocks - local < self._cfg.min_gain_blocks:
            return None
        return PeerHint(store_parts(best.store)[0], best.blocks, local, best.exact)
