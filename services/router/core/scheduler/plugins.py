"""The scheduler's plugin interfaces: tiny Protocols, after llm-d's router.

A scheduling cycle runs one profile over the candidates of a request::

    [Admission (flow control: in the servicer, before the cycle; core/admission.py)]
        -> Filter* (narrow the candidates)
        -> Scorer* (a score in [0, 1] per candidate; the framework clamps, weights and sums)
        -> Picker  (choose one, usually the best total)

Plugins see the request and the candidates through a ``CycleContext``, which also carries what
plugins share within one cycle (the prefix match, computed once) and across cycles (the ledger
of requests in flight). Plugins that learn from what happened implement ``Feedback``.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvmesh.discovery.keys import WorkerId
from kvmesh.kv.events import BlockHash

from ..types import RouteDecision, RouteRequest
from ..workers import WorkerView
from .ledger import InFlightLedger


# ---- the KV block index, as the precise prefix scorer sees it ----------------------------------
class PrefixMatchLike(Protocol):
    """One worker's match of a request's block hashes."""

    @property
    def blocks(self) -> int:
        """Contiguous matched prefix, in blocks, counted from the request's first block."""

    @property
    def gpu_blocks(self) -> int:
        """How many of those blocks are best held in the engine's own (GPU) cache; the three
        tier counts add up to ``blocks`` (each block counted once, on its best tier)."""

    @property
    def cpu_blocks(self) -> int: ...

    @property
    def disk_blocks(self) -> int: ...

    @property
    def exact(self) -> bool:
        """False when the index's view of the worker is degraded (events lost, resyncing)."""


class PrefixIndex(Protocol):
    def match(
        self, hashes: Sequence[BlockHash], workers: Iterable[WorkerId] | None = None
    ) -> Mapping[WorkerId, PrefixMatchLike]:
        """Each worker's contiguous matched prefix of ``hashes`` (workers with no match may be
        absent). ``workers`` limits the answer to those workers; None: all."""


@dataclass(frozen=True, slots=True)
class Matched:
    """A ``PrefixMatchLike`` value for sources that know no tiers (the approximate scorer)."""

    blocks: int
    gpu_blocks: int = 0
    cpu_blocks: int = 0
    disk_blocks: int = 0
    exact: bool = False


class PrefixSource(Protocol):
    """A plugin that can say how much of a request each candidate already holds. The first one in
    a profile is the profile's prefix source: the cost model and the decision's
    ``cached_blocks`` read it through ``CycleContext.prefix()``."""

    def prefix_match(self, ctx: CycleContext) -> Mapping[WorkerId, PrefixMatchLike]: ...


class VolumeSource(Protocol):
    """Recent routed volume per worker: the profile's first ``routed-volume`` scorer's count
    (``CycleContext.volume_source``), which the ``volume-bound`` filter bounds."""

    def routed_volume(self, worker_id: str) -> float:
        """The worker's prompt tokens routed recently (decayed per decision); 0: none."""


class CostSource(Protocol):
    """Estimated time to first token per candidate: the profile's first ``ttft-cost`` scorer
    (``CycleContext.cost_source``), which ``volume-bound`` with ``move_slack_s`` reads to move
    a request off a worker past the bound only when the move is cheap."""

    def ttft_estimates(
        self, ctx: CycleContext, candidates: Sequence[WorkerView]
    ) -> Mapping[WorkerId, float]:
        """Seconds to first token on each candidate (memoised on ``ctx`` for the cycle)."""


# ---- the cycle's context ------------------------------------------------------------------------
class CycleContext:
    """One scheduling cycle: the request, the eligible candidates (set after the filters), the
    ledger, the prefix match computed at most once per cycle, the profile's routed-volume
    count (None without a ``routed-volume`` scorer) and its TTFT estimate (None without a
    ``ttft-cost`` scorer; ``costs`` is that scorer's memo for the cycle)."""

    __slots__ = (
        "_prefix",
        "candidates",
        "cost_source",
        "costs",
        "ledger",
        "prefix_source",
        "request",
        "volume_source",
    )

    def __init__(
        self,
        request: RouteRequest,
        candidates: Sequence[WorkerView],
        ledger: InFlightLedger,
        source: PrefixSource | None,
        volume: VolumeSource | None = None,
        cost: CostSource | None = None,
    ) -> None:
        self.request = request
        self.candidates = candidates
        self.ledger = ledger
        self.prefix_source = source
        self.volume_source = volume
        self.cost_source = cost
        # (the estimating plugin, its seconds per worker): set by the first estimate of the
        # cycle, so a filter's estimate is the scorer's too (one estimate per decision).
        self.costs: tuple[object, Mapping[WorkerId, float]] | None = None
        self._prefix: Mapping[WorkerId, PrefixMatchLike] | None = None

    def prefix(self) -> Mapping[WorkerId, PrefixMatchLike]:
        """The profile's prefix source's match for the eligible candidates (memoised)."""
        if self._prefix is None:
            if self.prefix_source is None or not self.request.block_hashes:
                self._prefix = {}
            else:
                self._prefix = self.prefix_source.prefix_match(self)
        return self._prefix

    @property
    def prefix_computed(self) -> bool:
        return self._prefix is not None


# ---- the plugin kinds ---------------------------------------------------------------------------
class Filter(Protocol):
    name: str

    def filter(self, ctx: CycleContext, candidates: Sequence[WorkerView]) -> Sequence[WorkerView]:
        """The candidates that may serve the request, in their given order."""


class BandFilter(Filter, Protocol):
    """A filter whose answer depends on the request's priority alone (``reserve``): flow
    control asks it which workers a band may use before any request is placed."""

    def views_for(
        self, candidates: Sequence[WorkerView], priority: int, note: bool = True
    ) -> Sequence[WorkerView]: ...


class Scorer(Protocol):
    name: str

    def score(self, ctx: CycleContext, candidates: Sequence[WorkerView]) -> Sequence[float]:
        """One score per candidate, in candidate order; 1 is best. The framework clamps to [0, 1]
        (NaN counts as 0), so a scorer need not, but every built-in does."""


@dataclass(frozen=True, slots=True)
class Choice:
    index: int  # the chosen candidate
    runner_up: int = -1  # the best candidate not tied with the winner; -1: none
    tied: int = 1  # candidates sharing the best total (the winner among them)
    uses_scores: bool = True  # False: the picker ignores scores (round-robin, random)


class Picker(Protocol):
    name: str

    def pick(
        self, ctx: CycleContext, candidates: Sequence[WorkerView], totals: Sequence[float]
    ) -> Choice: ...


class Feedback(Protocol):
    """Hooks for plugins that learn from routing (session table, approximate prefix). Each is
    optional: the scheduler calls whichever of them a plugin has, in profile order."""

    def on_routed(self, request: RouteRequest, decision: RouteDecision) -> None: ...

    def on_first_token(self, request: RouteRequest, worker_id: WorkerId) -> None: ...

    def on_finished(self, request: RouteRequest, worker_id: WorkerId) -> None: ...


class Admission(Protocol):
    """Flow control (tenant priorities, fairness, saturation queueing), in *front of* the
    scheduler, in the servicer: ``await admission.admit(request, ...)`` returns a ticket when
    the request may be scheduled (or raises ``ResourceExhausted`` / ``Unavailable`` with a
    ``retry_after_s``, or ``DeadlineExceeded``), and ``release(ticket, ...)`` is called when the
    request ends. It is async because it may hold a request in a per-band, per-tenant queue
    while every candidate is saturated; the scheduler itself stays synchronous. The decisions
    are ``core/admission.py``'s; ``services/router/admission.py`` (``AdmissionGate``) is the
    implementation. See docs/tenants.md."""

    async def admit(self, request: RouteRequest, output_tokens: int, deadline_s: float) -> Any: ...

    def release(
        self, ticket: Any, prompt_tokens: int, cached_tokens: int, output_tokens: int | None
    ) -> None: ...


class TransferRates(Protocol):
    """The kvmanagers' measured transfer speeds (their etcd records: ``KvManagerSet``)."""

    def s_per_token(self, kvmanager_id: str, layout_key: str, kind: str) -> float:
        """Seconds per token of KV the kvmanager measured for ``kind`` (cpu, disk: its tier to
        a worker; peer: another kvmanager to it) of the layout; 0: not measured."""


@dataclass(slots=True)
class PluginEnv:
    """What plugins may depend on beyond their parameters, given when a profile is built."""

    index: PrefixIndex | None = None  # the KV block index (precise prefix scorer)
    rng: random.Random = field(default_factory=random.Random)  # seed it for reproducible runs
    transfer_rates: TransferRates | None = None  # measured tier/peer speeds (ttft-cost)
