"""Is a peer fetch worth it? Prices fetching a prefix from another node's kvmanager over the
measured speed of that very link against recomputing it on the chosen worker. Pure.

For a request routed to worker ``w`` (its node's kvmanager ``K``), holding ``local`` leading
blocks itself (its engine, ``K``'s tiers), each peer store ``p`` of ``w``'s layout that holds
``b_p > local`` blocks is one option, recomputing is another::

    fetch_s(p)    = latency_s + (b_p - local) x B x (link_s_per_token(K <- p) + load_s_per_token(K))
    option(p)     = fetch_s(p) + (best - b_p) x B x prefill_s_per_token(w)
    recompute     = (best - local) x B x prefill_s_per_token(w)

with ``B`` the block size and ``best`` the longest peer prefix (the prompt past it is computed
whatever is chosen, so it is left out of every option alike). The cheapest option wins; a peer
whose link is too slow is skipped for a faster, shorter one or for recomputing.

- ``link_s_per_token(K <- p)``: what ``K`` measured fetching from ``p`` and published on its
  etcd record (``KvManagerRecord.peer_s_per_token``, services/kvmanager/core/rates.py), one link
  each. ``load_s_per_token(K)``: ``K``'s measured CPU tier -> engine speed (the fetched blocks
  land there first), 0 until measured. A link ``K`` never fetched over is *unmeasured*: priced at
  its latency alone, so it is tried (and so measured); the fetch budget below bounds what that
  try can cost.
- ``prefill_s_per_token(w)``: the worker's own measured prefill speed (its load reports,
  ``scheduler.rates.PrefillRates``; the fleet's mean, then ``default_prefill_s_per_token``, until
  it has reported enough).
- **Probes.** A link skipped as slow is not fetched over, so its rate would never change: once
  every ``probe_interval_s`` per (kvmanager, peer) pair the peer is hinted anyway (when it holds
  ``min_gain_blocks`` more), to measure the link again.
- **Fetch budget.** A hint carries ``max_fetch_s``: the longest its fetch is worth waiting for,
  the time recomputing the blocks it brings would take (at least ``budget_floor_s``, so that an
  estimate's noise does not cut a healthy fetch short). The worker's connector gives up there
  and recomputes what has not arrived, instead of waiting its whole peer-fetch timeout.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Protocol

from kvmesh.errors import InvalidArgument

from .scheduler.rates import PrefillRates
from .types import LoadSnapshot


class LinkRates(Protocol):
    """The kvmanagers' measured speeds (their etcd records: ``KvManagerSet`` has them)."""

    def s_per_token(self, kvmanager_id: str, layout_key: str, kind: str) -> float:
        """Seconds per token the kvmanager measured for ``kind`` (cpu, disk, peer); 0: none."""

    def peer_s_per_token(self, kvmanager_id: str, peer_id: str, layout_key: str) -> float:
        """Seconds per token of ``kvmanager_id``'s fetches from ``peer_id``; 0: never measured."""


@dataclass(frozen=True, slots=True)
class PeerCostConfig:
    enabled: bool = True  # price hints; False: hint on blocks gained alone, no budget
    latency_s: float = 2e-3  # a fetch's fixed cost: OpenFetch, the data plane's connect
    default_prefill_s_per_token: float = 5e-5  # until a worker (or the fleet) has reported
    min_sample_tokens: int = 2048  # prefill report deltas smaller than this wait for more
    probe_interval_s: float = 30.0  # hint a link skipped as slow at most this often; 0: never
    budget_floor_s: float = 0.25  # a hint's max_fetch_s is never below this, seconds

    def __post_init__(self) -> None:
        for name in ("latency_s", "probe_interval_s", "budget_floor_s"):
            v = getattr(self, name)
            if not (v >= 0 and math.isfinite(v)):
                raise InvalidArgument(f"peer cost {name} is {v}; use seconds >= 0")
        if not self.default_prefill_s_per_token > 0:
            raise InvalidArgument(
                f"peer cost default_prefill_s_per_token is {self.default_prefill_s_per_token};"
                " use seconds > 0"
            )
        if self.min_sample_tokens < 1:
            raise InvalidArgument(
                f"peer cost min_sample_tokens is {self.min_sample_tokens}; use 1 or more"
            )


@dataclass(frozen=True, slots=True)
class PeerOption:
    """One peer store as a source for a request: ``blocks`` its prefix, and its price."""

    kvmanager_id: str
    blocks: int
    fetch_s: float  # estimated time to fetch the blocks beyond the worker's own
    total_s: float  # fetch_s plus recomputing the rest up to the longest peer prefix
    measured: bool  # the link's speed was measured (else priced at its latency alone)


@dataclass(frozen=True, slots=True)
class PeerPrice:
    """The verdict for a request: ``chosen`` (None: recompute), the fastest ``best`` option
    skipped when it lost to a cheaper one or to recomputing, and the recompute time."""

    chosen: PeerOption | None
    recompute_s: float  # recomputing everything past the worker's own prefix, up to ``best``
    skipped: PeerOption | None = None  # the longest peer, when it was not chosen
    probe: bool = False  # chosen only to measure its link again (module doc)
    max_fetch_s: float = 0.0  # the chosen fetch's budget (0: none)


class PeerCost:
    """Prices peer options with measured link and prefill speeds (see module doc).

    ``load_of``: a worker's latest load report (its prefill counters), None when unknown;
    ``clock``: seconds, for the probes."""

    def __init__(
        self,
        rates: LinkRates | None,
        load_of: Callable[[str], LoadSnapshot | None],
        config: PeerCostConfig | None = None,
        clock: Callable[[], float] | None = None,
    ) -> None:
        self._cfg = config or PeerCostConfig()
        self._rates = rates
        self._load_of = load_of
        self._clock = clock or time.monotonic
        self.prefill = PrefillRates(
            self._cfg.default_prefill_s_per_token, self._cfg.min_sample_tokens
        )
        self._probed: dict[tuple[str, str], float] = {}  # (kvmanager, peer) -> last probe

    @property
    def enabled(self) -> bool:
        return self._cfg.enabled and self._rates is not None

    def link_s_per_token(self, kvmanager_id: str, peer_id: str, layout_key: str) -> float:
        """Measured seconds per token to bring a block from ``peer_id`` into an engine beside
        ``kvmanager_id`` (the link, then the CPU tier's load); 0: the link is unmeasured."""
        rates = self._rates
        if rates is None:
            return 0.0
        link = rates.peer_s_per_token(kvmanager_id, peer_id, layout_key)
        if not link:
            return 0.0
        return link + rates.s_per_token(kvmanager_id, layout_key, "cpu")

    def price(
        self,
        worker_id: str,
        kvmanager_id: str,
        layout_key: str,
        block_size: int,
        local_blocks: int,
        peers: Iterable[tuple[str, int]],
        min_gain_blocks: int,
    ) -> PeerPrice:
        """The cheapest source for a request on ``worker_id`` (beside ``kvmanager_id``) holding
        ``local_blocks``, among ``peers`` ((peer kvmanager id, blocks), each holding at least
        ``min_gain_blocks`` more than the worker) and recomputing."""
        cfg = self._cfg
        load = self._load_of(worker_id)
        if load is not None:
            self.prefill.observe(worker_id, load)
        prefill = self.prefill.s_per_token(worker_id)
        options = [(kid, b) for kid, b in peers if b - local_blocks >= min_gain_blocks]
        if not options:
            return PeerPrice(None, 0.0)
        best = max(b for _, b in options)
        recompute_s = (best - local_blocks) * block_size * prefill
        priced = []
        for kid, blocks in options:
            rate = self.link_s_per_token(kvmanager_id, kid, layout_key)
            fetch_s = cfg.latency_s + (blocks - local_blocks) * block_size * rate
            total = fetch_s + (best - blocks) * block_size * prefill
            priced.append(PeerOption(kid, blocks, fetch_s, total, rate > 0))
        # Cheapest first; ties: the longer prefix, then the smaller id (deterministic).
        priced.sort(key=lambda o: (o.total_s, -o.blocks, o.kvmanager_id))
        longest = min(priced, key=lambda o: (-o.blocks, o.kvmanager_id))
        top = priced[0]
        probe = False
        if top.total_s >= recompute_s:
            probe_with = self._probe(kvmanager_id, longest)
            if probe_with is None:
                return PeerPrice(None, recompute_s, skipped=longest)
            top, probe = probe_with, True
        budget = max(cfg.budget_floor_s, (top.blocks - local_blocks) * block_size * prefill)
        skipped = longest if longest is not top else None
        return PeerPrice(top, recompute_s, skipped, probe, budget)

    def _probe(self, kvmanager_id: str, option: PeerOption) -> PeerOption | None:
        """``option`` when its link is due for a probe (and mark it probed), else None."""
        interval = self._cfg.probe_interval_s
        if not interval:
            return None
        key = (kvmanager_id, option.kvmanager_id)
        now = self._clock()
        last = self._probed.get(key)
        if last is None:  # the link's first skip: a probe is due one interval later
            self._probed[key] = now
            return None
        if now - last < interval:
            return None
        self._probed[key] = now
        return option
