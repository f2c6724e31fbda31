"""Peer hints: after the scheduler picks a worker, name another node's kvmanager that holds a
longer prefix of the request than the worker itself (its engine, its node's kvmanager), so that
the worker's connector can have its own kvmanager fetch the difference (KvManager.FetchFromPeer)
instead of recomputing it. Pure: the KV index answers, nothing is called.

A peer must hold blocks of the worker's own KV layout (a block hash means nothing across
layouts), so the candidates are the other kvmanagers' stores of the layout of the worker's
linked store; a worker with no linked store has no kvmanager to fetch into and gets no hint.
Cost: one walk over the request's hashes for all peer stores (a miss is one dict lookup), plus
the worker's own match when some peer holds anything.

The same walk counts the leading blocks the worker's own node store holds (``store_blocks``,
when the index follows that store exactly): sent with the request, it lets the worker's KV
connector skip its lookup in its kvmanager when its engine's own cache covers them, the usual
case (the lookup is a round trip on the engine's thread, holding up the whole step).

With a ``PeerCost`` (``peer_cost.py``) the hint is priced: fetching from each peer over the
measured speed of its link against recomputing on the chosen worker at its measured prefill
speed. A peer behind a slow link is skipped (``PeerChoice.skipped``) for a faster one or for
recomputing, and a hint carries the longest its fetch is worth waiting for (``max_fetch_s``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from kvmesh.discovery.keys import WorkerId
from kvmesh.errors import InvalidArgument
from kvmesh.kv.events import BlockHash

from .index_types import (
    HolderId,
    PrefixMatch,
    StoreId,
    StoreMatch,
    ViewState,
    WorkerKvView,
    store_parts,
)
from .peer_cost import PeerCost, PeerOption
from .recent_prefills import RecentPrefills
from .types import PeerHint


class StoreIndex(Protocol):
    """What peer hints need of the KV index (``KvIndex`` has it)."""

    def linked(self, worker_id: WorkerId) -> StoreId | None: ...

    def links(self) -> Mapping[WorkerId, StoreId]: ...

    def view(self, worker_id: HolderId) -> WorkerKvView: ...

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
    # A worker on the same node store holding that many more blocks than the chosen one (it
    # just computed them; its save is on the way): the hint names the node's own kvmanager and
    # the worker waits up to this long for the save to land before recomputing. 0: no wait.
    sibling_wait_s: float = 0.25

    def __post_init__(self) -> None:
        if self.min_gain_blocks < 1:
            raise InvalidArgument(
                f"peer hint min_gain_blocks is {self.min_gain_blocks}; use 1 or more"
            )
        if not 0 <= self.sibling_wait_s <= 10:
            raise InvalidArgument(
                f"peer hint sibling_wait_s is {self.sibling_wait_s}; use 0-10 seconds"
            )


@dataclass(frozen=True, slots=True)
class PeerChoice:
    """``hint``: the peer to name (None: none); ``skipped``: a peer holding more that was left
    out because fetching from it is slower (priced: its ``fetch_s`` and ``recompute_s``);
    ``store_blocks``: the leading blocks the worker's own node store holds, when the index's
    view of that store is exact (None: unknown), which lets the worker's connector skip its
    lookup when its engine's cache covers them."""

    hint: PeerHint | None = None
    skipped: PeerHint | None = None
    store_blocks: int | None = None


_NONE = PeerChoice()


class PeerHints:
    """``decide(hashes, worker_id)``: the best peer for a request routed to a worker, if any.

    ``cost``: prices each peer's fetch against recomputing (``peer_cost.py``); None, or one not
    enabled: the peer with the longest prefix, on blocks gained alone. ``block_size_of``: the
    worker's tokens per block (the price is in tokens). ``recent``: the prompts workers
    computed moments ago (``computed``), before the index hears of them; None: the index alone."""

    def __init__(
        self,
        index: StoreIndex,
        config: PeerHintConfig | None = None,
        cost: PeerCost | None = None,
        block_size_of: Callable[[WorkerId], int] | None = None,
        recent: RecentPrefills | None = None,
    ) -> None:
        self._index = index
        self._recent = recent
        self._cfg = config or PeerHintConfig()
        self._cost = cost if cost is not None and cost.enabled else None
        self._block_size_of = block_size_of

    def hint(self, hashes: Sequence[BlockHash], worker_id: WorkerId) -> PeerHint | None:
        return self.decide(hashes, worker_id).hint

    def computed(self, hashes: Sequence[BlockHash], worker_id: WorkerId) -> None:
        """``worker_id`` has just computed the prompt ``hashes`` (its first token came): its
        siblings may wait for its save before the index hears of it (``recent_prefills.py``)."""
        if self._recent is not None and hashes:
            self._recent.computed(hashes, worker_id)

    def _sibling_ahead(
        self, hashes: Sequence[BlockHash], worker_id: WorkerId, store: StoreId, past: int
    ) -> tuple[int, int]:
        """How many leading blocks of ``hashes`` the other workers linked to ``store`` hold:
        the most one holds per the index, and the most one computed within the last seconds
        (``RecentPrefills``). Such a sibling saves what it computes to that store, so the
        store's count may trail it by one save (``save_interval_s``) and the store's tier
        events: a request routed here right after the sibling's prefill (a fan-out's later
        choices, a request balanced off a busy worker) would otherwise skip a lookup that
        hits, or look before the save lands. Past the first ``past`` blocks only: (0, 0) when
        no sibling holds block ``past``, which one index lookup tells (a block hash chains
        every token before it), so the index's walk runs only when one is ahead."""
        if past >= len(hashes):
            return 0, 0
        siblings = {w for w, s in self._index.links().items() if s == store and w != worker_id}
        if not siblings:
            return 0, 0
        recent = self._recent.held(hashes, siblings) if self._recent is not None else 0
        if recent <= past and not self._index.match(hashes[past : past + 1], siblings):
            return 0, 0
        m = next(iter(self._index.match(hashes, siblings).values()), None)
        return (m.blocks if m is not None else 0), recent

    def decide(self, hashes: Sequence[BlockHash], worker_id: WorkerId) -> PeerChoice:
        """Unpriced: the store of the worker's layout on another kvmanager with the longest
        contiguous prefix of ``hashes`` (ties: smallest store id), when it beats what the worker
        holds by ``min_gain_blocks`` or more. Priced: the cheapest of those stores, or none
        when recomputing is cheaper (module doc)."""
        if not hashes:
            return _NONE
        index = self._index
        own = index.linked(worker_id)
        if own is None:
            return _NONE
        own_kvm, layout = store_parts(own)
        peers = (
            [
                s
                for s in index.stores()
                if s != own and (parts := store_parts(s))[1] == layout and parts[0] != own_kvm
            ]
            if self._cfg.enabled
            else []
        )
        own_exact = index.view(own).state is ViewState.EXACT
        walk = [*peers, own] if own_exact else peers
        matches = dict(index.match_stores(hashes, walk)) if walk else {}  # one walk for all
        own_match = matches.pop(own, None)
        store_blocks = (own_match.blocks if own_match is not None else 0) if own_exact else None
        indexed, recent = self._sibling_ahead(hashes, worker_id, own, store_blocks or 0)
        if store_blocks is not None and max(indexed, recent) > store_blocks:
            store_blocks = None  # the sibling's saves may be on the way: let the connector look
        base = PeerChoice(store_blocks=store_blocks)
        best = next(iter(matches.values()), None)
        most = max(best.blocks if best is not None else 0, recent)
        min_gain = self._cfg.min_gain_blocks
        if most < min_gain:
            return base
        mine = index.match(hashes, [worker_id]).get(worker_id)
        local = mine.blocks if mine is not None else 0
        wait_s = self._cfg.sibling_wait_s
        if (
            self._cfg.enabled
            and wait_s > 0
            and recent - local >= min_gain
            and (best is None or best.blocks <= recent)
        ):  # wait (briefly) for the sibling's save to land in the node store, then load it.
            # Only for a prefill of the last seconds: a sibling's older blocks that the store
            # lacks (never saved, or evicted since) are not on their way.
            hint = PeerHint(own_kvm, recent, local, max_fetch_s=wait_s, wait_s=wait_s)
            return PeerChoice(hint, store_blocks=store_blocks)
        if best is None or best.blocks - local < min_gain:
            return base
        block_size = self._block_size_of(worker_id) if self._block_size_of is not None else 0
        if self._cost is None or block_size <= 0:
            hint = PeerHint(store_parts(best.store)[0], best.blocks, local, best.exact)
            return PeerChoice(hint, store_blocks=store_blocks)
        exact = {store_parts(m.store)[0]: m.exact for m in matches.values()}
        price = self._cost.price(
            worker_id,
            own_kvm,
            layout,
            block_size,
            local,
            ((store_parts(m.store)[0], m.blocks) for m in matches.values()),
            min_gain,
        )

        def as_hint(
            o: PeerOption | None, budget_s: float = 0.0, probe: bool = False
        ) -> PeerHint | None:
            if o is None:
                return None
            return PeerHint(
                o.kvmanager_id,
                o.blocks,
                local,
                exact[o.kvmanager_id],
                fetch_s=o.fetch_s,
                recompute_s=price.recompute_s,
                max_fetch_s=budget_s,
                probe=probe,
            )

        return PeerChoice(
            as_hint(price.chosen, price.max_fetch_s, price.probe),
            as_hint(price.skipped),
            store_blocks,
        )
