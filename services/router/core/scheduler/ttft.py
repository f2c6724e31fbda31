"""Time to first token, estimated per candidate from measured rates: wait, fetch, or recompute.

For each candidate ``w`` (``estimate``)::

    queue_s(w)   = prefill_tokens_in_flight(w) * prefill_s_per_token(w)   # this router's ledger
                   + running_requests(w) * running_request_s                # decode sharing steps
    fetch_s(w)   = load(cpu_tokens(w), cpu) + load(disk_tokens(w), disk)   # its node's tiers
                   + load(peer_tokens(w), peer)        # what another node's kvmanager adds
    prefill_s(w) = tokens_nobody_holds(w) * prefill_s_per_token(w)
    displace_s(w) = kv_cache_usage(w) * tokens_not_on_its_gpu(w) * refill_s_per_token(w)
    in_flight_s(w) = step_s(w) * (prefill_steps(w) + decode_steps)     # steps.py; in_flight: true
    ttft_s(w)    = queue_s(w) + fetch_s(w) + prefill_s(w) + displace_s(w) [+ in_flight_s(w)]

with ``load(n, link) = link latency + n * link s_per_token`` (0 for n = 0). The matched prefix on
``w``'s engine and its node's tiers comes from the profile's prefix source (the KV index);
``peer_tokens`` is what the best other node store of the same layout holds beyond that (the
router's peer hint names that store to the worker, core/peers.py), counted only past
``peer_min_gain_blocks`` as the hint is. A store's prefix is taken as the best match among the
candidates linked to it (their engines' blocks and the store's: equal to the store's own when
it holds what its engines do, as the connector's write-through makes it), which costs no walk
over the prompt beyond the index match; a store with no candidate linked to it is not counted.

``prefill_s_per_token(w)`` is measured: the worker's own engine reports the prompt tokens it
computed and the seconds those prefills took (WorkerLoad.prefill_computed_tokens /
prefill_seconds, from vLLM's per-request stats); ``rates.PrefillRates`` keeps a moving average per
worker, and the fleet's mean stands in for a worker that has reported none yet. The tier and
peer rates are each kvmanager's own measurements where it has published them
(``KvManagerRecord.transfer_s_per_token``, per KV layout: its CPU and disk tiers serving a
worker, and its fetches from peers, to which the CPU tier's load into the engine is added;
``services/kvmanager/core/rates.py``), and the configured rates otherwise (defaults: this
project's measurements in BENCHMARKS.md, scaled to the default prefill rate).

``displace_s`` is what this request costs the requests after it: every token it brings onto a
worker's GPU (fetched or computed) takes a cache slot there, and on a worker whose cache is full
of blocks in use (its reported ``kv_cache_usage``) that evicts another request's block, which
comes back later from the node's CPU tier at best (``refill_s_per_token``: the CPU tier's rate
when the worker has a node store, else its prefill rate). A session whose context is on its
worker's GPU brings in only its new tokens; moved elsewhere it brings its whole context, so under
cache pressure moving costs what it displaces, not only its own fetch. With caches that are not
full (usage well below 1) the term is small, and the cheapest wait/fetch/recompute wins as before.
(Found on the replay's saturated agentic runs: pricing this request's TTFT alone, sessions moved
to shorter queues, their contexts then held twice, and the evictions that followed cost more
hits than the moves saved; BENCHMARKS.md.) ``displacement: false`` leaves it out.

``in_flight_s`` (off unless ``in_flight: true``) prices the work a worker carries, cached
context included: each request and each context token in flight lengthen every engine step,
so the steps this request's prefill and decode ride (steps.py; rates fitted to the engines'
own decode timing, ``StepRates``). ``queue_s`` counts only the tokens still to prefill, so
without it a worker holding a hot prefix looks cheap for every request that shares it.

The score is ``(min_ttft + floor_s) / (ttft_s(w) + floor_s)``: 1 for the cheapest worker. A
session stays where its context is while waiting there costs less than fetching it elsewhere
(from the node tier or a peer) or recomputing it, and moves, with its cache, once it does not.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvmesh.discovery.keys import WorkerId

from ..index_types import StoreId, store_parts
from ..types import RouteRequest
from ..workers import WorkerView, outstanding
from .params import check, relative_scores
from .plugins import CycleContext, PluginEnv, TransferRates
from .rates import PrefillRates
from .steps import StepRates, in_flight_s

# The defaults' base: the simulator's prefill cost per token (docs/simulator.md) and the
# measured TTFT ratios of a 4K-token prompt loaded instead of recomputed (issue 4).
_PREFILL_S = 5e-5


@dataclass(frozen=True, slots=True)
class TtftParams:
    # Until a worker (and the fleet) has reported prefill work: seconds per computed token.
    prefill_s_per_token: float = _PREFILL_S
    min_sample_tokens: int = 2048  # report deltas smaller than this wait for more
    rate_half_life_samples: float = 8.0  # moving average of the measured rate
    running_request_s: float = 0.0  # slow-down per running request (s)
    cpu_s_per_token: float = 0.28 * _PREFILL_S  # node CPU tier -> engine (0.28x recompute)
    cpu_latency_s: float = 1e-3
    disk_s_per_token: float = 0.83 * _PREFILL_S  # node disk tier -> engine (0.83x)
    disk_latency_s: float = 5e-3
    peer_s_per_token: float = 0.44 * _PREFILL_S  # peer kvmanager -> node -> engine (0.44x)
    peer_latency_s: float = 2e-3
    peer_min_gain_blocks: int = 4  # as the router's peer hints (RouterConfig.peer_hint_min_blocks)
    floor_s: float = 0.05  # costs this close count as equal (keeps idle fleets from flapping)
    displacement: bool = True  # price the cache slots it takes on a full worker (module doc)
    # The work in flight (steps.py): what each request and each context token in flight add to
    # an engine step until the workers' reports measure them (defaults: the simulator's 8B
    # model on an H100, docs/simulator.md), the prefill tokens a step takes, and the decode
    # steps of a request (its expected output tokens). Off by default: measured as a trade, not
    # a win (BENCHMARKS.md, issue 12 fourth and fifth passes); in_flight: true adds the term.
    in_flight: bool = False
    seq_step_s: float = 1e-4
    context_step_s_per_token: float = 4e-8
    step_tokens: int = 8192
    decode_steps: float = 256.0
    learn_step_rates: bool = True  # fit the two rates to the engines' measured step times
    # Fit the prefill chunks sharing the steps as a regressor of their own (steps.py); false
    # (the better of the two on the replays): the rates include them, as the step time a
    # request rides, whatever fills the steps.
    step_fit_prefill: bool = False

    def __post_init__(self) -> None:
        for name in (
            "prefill_s_per_token",
            "running_request_s",
            "cpu_s_per_token",
            "cpu_latency_s",
            "disk_s_per_token",
            "disk_latency_s",
            "peer_s_per_token",
            "peer_latency_s",
            "seq_step_s",
            "context_step_s_per_token",
            "decode_steps",
        ):
            v = getattr(self, name)
            check(v >= 0.0, f"{name} is {v}; use seconds >= 0")
        check(self.prefill_s_per_token > 0, "prefill_s_per_token must be > 0")
        check(self.min_sample_tokens >= 1, "min_sample_tokens must be >= 1")
        check(self.rate_half_life_samples > 0, "rate_half_life_samples must be > 0")
        check(self.peer_min_gain_blocks >= 1, "peer_min_gain_blocks must be >= 1")
        check(self.floor_s > 0.0, f"floor_s is {self.floor_s}; use seconds > 0")
        check(self.step_tokens >= 1, "step_tokens must be >= 1")


@dataclass(frozen=True, slots=True)
class TtftTerms:
    """One candidate's estimate, term by term (seconds; their sum is the estimate)."""

    queue_s: float
    fetch_s: float
    prefill_s: float
    displace_s: float
    in_flight_s: float


class TtftCostScorer:
    """Favours the worker with the least estimated time to first token (see module doc)."""

    needs_prefix_source = True

    def __init__(
        self,
        name: str,
        params: TtftParams,
        index: Any = None,
        transfer_rates: TransferRates | None = None,
    ) -> None:
        self.name = name
        self._p = params
        self._measured = transfer_rates
        # Peer fetch needs the index's links of workers to node stores (KvIndex.linked);
        # without them no candidate gets peer tokens.
        self._stores = index if callable(getattr(index, "linked", None)) else None
        self.rates = PrefillRates(
            params.prefill_s_per_token, params.min_sample_tokens, params.rate_half_life_samples
        )
        self.steps = StepRates(
            params.seq_step_s, params.context_step_s_per_token, decode_steps=params.decode_steps
        )

    @property
    def params(self) -> TtftParams:
        return self._p

    @classmethod
    def build(cls, name: str, params: TtftParams, env: PluginEnv) -> TtftCostScorer:
        return cls(name, params, env.index, env.transfer_rates)

    def links(self, store: StoreId) -> tuple[float, float, float]:
        """(cpu, disk, peer) seconds per token into an engine backed by ``store``: what its
        kvmanager measured (a peer fetch: its measured peer -> node rate plus its CPU tier's
        load), else the configured rates."""
        p = self._p
        src = self._measured
        if src is None:
            return p.cpu_s_per_token, p.disk_s_per_token, p.peer_s_per_token
        kvm, layout = store_parts(store)
        cpu = src.s_per_token(kvm, layout, "cpu") or p.cpu_s_per_token
        disk = src.s_per_token(kvm, layout, "disk") or p.disk_s_per_token
        peer = src.s_per_token(kvm, layout, "peer")
        return cpu, disk, (peer + cpu if peer else p.peer_s_per_token)

    def _peer_bests(
        self, candidates: Sequence[WorkerView], matches: Mapping[WorkerId, Any]
    ) -> tuple[dict[WorkerId, StoreId], dict[str, list[tuple[int, str]]]]:
        """Each candidate's linked store, and per layout the two best (blocks, kvmanager) over
        the stores: a store's prefix is bounded by its workers' matches (their engine's blocks
        and the store's), and equals the best of them when the store holds what its engines
        do (write-through): no walk over the prompt beyond the index match already made."""
        linked = self._stores.linked if self._stores is not None else None
        if linked is None:
            return {}, {}
        links: dict[WorkerId, StoreId] = {}
        best: dict[StoreId, int] = {}
        for v in candidates:
            wid = v.record.worker_id
            sid = linked(wid)
            if sid is None:
                continue
            links[wid] = sid
            m = matches.get(wid)
            if m is not None and m.blocks > best.get(sid, 0):
                best[sid] = m.blocks
        top: dict[str, list[tuple[int, str]]] = {}
        for sid, blocks in best.items():
            kvm, layout = store_parts(sid)
            t = top.setdefault(layout, [])
            t.append((blocks, kvm))
            t.sort(reverse=True)
            del t[2:]
        return links, top

    def estimate(
        self,
        ctx: CycleContext,
        candidates: Sequence[WorkerView],
        terms: list[TtftTerms] | None = None,
    ) -> list[float]:
        """Estimated time to first token on each candidate, in seconds. ``terms``: a list to
        append each candidate's terms to (tracing; None, the default: not kept)."""
        p = self._p
        req = ctx.request
        prompt = req.prompt_tokens
        total_blocks = len(req.block_hashes)
        fallback_bs = prompt // total_blocks if total_blocks else 0
        matches: Mapping[WorkerId, Any] = ctx.prefix()
        tally = ctx.ledger.tally
        rates = self.rates
        steps = self.steps if p.in_flight and p.learn_step_rates else None
        for v in candidates:
            wid = v.record.worker_id
            rates.observe(wid, v.load)
            if steps is not None:
                t = tally(wid)
                steps.observe(
                    wid, v.load, t.prompt_tokens, t.prefill_tokens if p.step_fit_prefill else 0
                )
        if p.in_flight:
            seq_s, ctx_s = self.steps.rates()
            decode_steps = self.steps.decode_steps() if steps is not None else p.decode_steps
        links, top = self._peer_bests(candidates, matches)
        configured = (p.cpu_s_per_token, p.disk_s_per_token, p.peer_s_per_token)
        speeds: dict[StoreId, tuple[float, float, float]] = {}
        out = []
        for v in candidates:
            wid = v.record.worker_id
            rate = rates.s_per_token(wid)
            own = links.get(wid)
            if own is None:
                cpu_s, disk_s, peer_s = configured
            else:
                sp = speeds.get(own)
                if sp is None:
                    sp = speeds[own] = self.links(own)
                cpu_s, disk_s, peer_s = sp
            load = v.load
            t = tally(wid)
            queue = t.prefill_tokens * rate
            if p.running_request_s:
                queue += max(load.running_requests, 0) * p.running_request_s
            bs = v.record.block_size or fallback_bs
            m = matches.get(wid)
            have = m.blocks if m is not None and m.blocks > 0 else 0
            fetch = 0.0
            if m is not None and have:
                if m.cpu_blocks:
                    fetch += p.cpu_latency_s + m.cpu_blocks * bs * cpu_s
                if m.disk_blocks:
                    fetch += p.disk_latency_s + m.disk_blocks * bs * disk_s
            if own is not None and top:
                kvm, layout = store_parts(own)
                peer = 0
                for blocks, k in top.get(layout, ()):
                    if k != kvm:
                        peer = blocks
                        break
                gain = peer - have
                if gain >= p.peer_min_gain_blocks:
                    fetch += p.peer_latency_s + gain * bs * peer_s
                    have += gain
            uncached = prompt - have * bs
            if uncached < 0:
                uncached = 0
            cost = queue + fetch + uncached * rate
            flight = displace = 0.0
            if p.in_flight:
                flight = in_flight_s(
                    max(t.requests, outstanding(v)),
                    t.prompt_tokens,
                    t.prefill_tokens + uncached,
                    seq_s,
                    ctx_s,
                    p.step_tokens,
                    decode_steps,
                )
                cost += flight
            if p.displacement:
                usage = load.kv_cache_usage
                if usage > 0.0:
                    brought = prompt - (m.gpu_blocks * bs if m is not None else 0)
                    refill = cpu_s if own is not None else rate
                    displace = (usage if usage < 1.0 else 1.0) * max(brought, 0) * refill
                    cost += displace
            if terms is not None:
                terms.append(TtftTerms(queue, fetch, uncached * rate, displace, flight))
            out.append(cost)
        return out

    def ttft_estimates(
        self, ctx: CycleContext, candidates: Sequence[WorkerView]
    ) -> Mapping[WorkerId, float]:
        """``estimate`` per worker, memoised on ``ctx`` for the cycle: a ``volume-bound``
        filter's call (over the candidates before it) serves the score of those it keeps. A
        peer's prefix is then read over those candidates' stores, the dropped ones' included,
        which still hold their blocks."""
        memo = ctx.costs
        if memo is not None and memo[0] is self:
            known = memo[1]
            if all(v.record.worker_id in known for v in candidates):
                return known
        est = self.estimate(ctx, candidates)
        got = {v.record.worker_id: c for v, c in zip(candidates, est, strict=True)}
        ctx.costs = (self, got)
        return got

    def score(self, ctx: CycleContext, candidates: Sequence[WorkerView]) -> Sequence[float]:
        est = self.ttft_estimates(ctx, candidates)
        return relative_scores([est[v.record.worker_id] for v in candidates], self._p.floor_s)

    def on_finished(self, request: RouteRequest, worker_id: WorkerId) -> None:
        self.steps.finished()
