"""The real router core as a replay policy: the scheduler profile (``make_policy``) and the KV
index, fed by the simulated workers' KV events exactly as the router's KV event streams feed it.

Only the transport is missing: events go straight from the simulated worker to the index (one
numbered batch per worker step, after an empty snapshot that makes each view exact), node store
tier events likewise (``on_tier_events``, with each worker linked to its node's store), loads
come from the simulated workers' own reports (their measured prefill work included), and the
scheduler's feedback hooks are called as the driver shows them happen: ``on_first_token`` once
the request's prefill is done, ``on_finished`` once it is no longer active.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Sequence

from kvmesh.discovery.keys import WorkerId, WorkerRecord
from kvmesh.kv.events import KvEvent, KvEventBatch
from services.router.core.index import KvIndex
from services.router.core.index_types import IndexConfig, StoreId, store_id
from services.router.core.routing import make_policy
from services.router.core.scheduler.framework import Scheduler
from services.router.core.scheduler.plugins import CycleContext
from services.router.core.scheduler.ttft import TtftCostScorer
from services.router.core.types import LoadSnapshot, RouteDecision, RouteRequest
from services.router.core.workers import WorkerSet, WorkerView

from .decisions import DecisionTrace, cycle_record
from .driver import ClusterView
from .traces import ReplayRequest

EPOCH = "replay"
MODEL = "sim"
LAYOUT = "0123456789abcdef"  # one KV layout for every simulated worker (a 16-hex layout key)


class RouterPolicy:
    """A scheduler profile over the real KvIndex, as a ``RoutePolicy`` for the replay driver."""

    def __init__(
        self,
        profile: str,
        workers: int,
        seed: int = 0,
        index_max_blocks: int = 8_000_000,
        workers_per_node: int = 0,
        trace: DecisionTrace | None = None,
    ) -> None:
        """``workers_per_node``: > 0 when the replay's nodes have kvmanager tiers: the index
        follows each node store (``on_tier_events``) and links its workers to it. ``trace``:
        records what each decision saw (``decisions.cycle_record``); None: nothing."""
        self.name = profile
        self.index = KvIndex(IndexConfig(max_blocks=index_max_blocks))
        self.scheduler = make_policy(profile, index=self.index, rng=random.Random(seed))
        self.workers = WorkerSet()
        self._ids = [WorkerId(f"sim-{i:03d}") for i in range(workers)]
        self._slot = {wid: i for i, wid in enumerate(self._ids)}
        self._seq = [0] * workers
        for wid in self._ids:
            rec = WorkerRecord(worker_id=wid, address="sim", model=MODEL, model_path="")
            self.workers.apply_put(rec)
            self.index.apply(KvEventBatch(wid, EPOCH, 0, (), snapshot=True))
        self._stores: list[StoreId] = []
        if workers_per_node > 0:
            nodes = -(-workers // workers_per_node)
            self._stores = [store_id(f"kvm-{j:03d}", LAYOUT) for j in range(nodes)]
            for sid in self._stores:
                self.index.apply_store(sid, KvEventBatch(sid, EPOCH, 0, (), snapshot=True))
            for i, wid in enumerate(self._ids):
                self.index.link(wid, self._stores[i // workers_per_node])
        self._store_seq = [0] * len(self._stores)
        self._active: dict[str, tuple[RouteRequest, int]] = {}
        self._prefilled: set[str] = set()  # active, first token seen
        self._n = 0
        self.decision_s: list[float] = []  # wall time of each scheduling decision
        self.reasons: dict[str, int] = {}
        self._steps = self._step_scorer()
        self._rates: list[tuple[float, float, float]] = []  # step rates each decision used
        self._trace = trace
        if trace is not None and isinstance(self.scheduler, Scheduler):
            self.scheduler.on_cycle = self._record_cycle

    def _record_cycle(
        self, ctx: CycleContext, offered: Sequence[WorkerView], decision: RouteDecision
    ) -> None:
        if self._trace is not None:
            self._trace.decided(self._n, cycle_record(ctx, offered, decision, self._slot))

    def _step_scorer(self) -> TtftCostScorer | None:
        if not isinstance(self.scheduler, Scheduler):
            return None
        for w in self.scheduler.weighted_scorers():
            sc = w.scorer
            if isinstance(sc, TtftCostScorer) and sc.params.in_flight:
                return sc
        return None

    def step_rates(self) -> dict[str, float | int] | None:
        """The in-flight term's step rates (ttft-cost with ``in_flight: true``) as its
        decisions used them: the median over the decisions of each rate, and how many of them
        used the fleet's fit rather than the configured rates; None without such a term."""
        sc = self._step_scorer()
        if sc is None or not self._rates:
            return None
        default = (sc.params.seq_step_s, sc.params.context_step_s_per_token)
        fitted = [r for r in self._rates if r[:2] != default]
        use = fitted or self._rates
        return {
            "seq_step_s": statistics.median(r[0] for r in use),
            "context_step_s_per_token": statistics.median(r[1] for r in use),
            "decode_steps": statistics.median(r[2] for r in use),
            "fitted_decisions": len(fitted),
            "decisions": len(self._rates),
            "samples": sc.steps.samples,
            "timed_samples": sc.steps.timed_samples,
        }

    def on_kv_events(self, worker: int, events: Sequence[KvEvent]) -> None:
        self._seq[worker] += 1
        self.index.apply(KvEventBatch(self._ids[worker], EPOCH, self._seq[worker], tuple(events)))

    def on_tier_events(self, node: int, events: Sequence[KvEvent]) -> None:
        self._store_seq[node] += 1
        sid = self._stores[node]
        self.index.apply_store(sid, KvEventBatch(sid, EPOCH, self._store_seq[node], tuple(events)))

    def __call__(self, request: ReplayRequest, view: ClusterView) -> int:
        self._retire_finished(view)
        now = max(view.now_s, 1e-9)  # a report time of 0 reads as "unknown"
        for i, sim in enumerate(view.workers):
            load = sim.load()
            self.workers.set_load(
                self._ids[i],
                LoadSnapshot(
                    running_requests=load.running,
                    waiting_requests=load.waiting,
                    in_flight_requests=load.running + load.waiting,
                    kv_cache_usage=load.kv_usage,
                    prefill_computed_tokens=load.prefill_computed_tokens,
                    prefill_s=load.prefill_s,
                    generation_tokens=load.generation_tokens,
                    decode_tokens=load.decode_tokens,
                    decode_s=load.decode_s,
                    reported_s=now,
                ),
            )
        route = RouteRequest(
            request_id=str(self._n),  # the driver names its n-th request str(n) too
            model=MODEL,
            session_id=request.session_id,
            block_hashes=request.block_hashes,
            prompt_tokens=request.input_tokens,
        )
        start = time.perf_counter()
        decision = self.scheduler.pick(route, self.workers.candidates(MODEL))
        self.decision_s.append(time.perf_counter() - start)
        self.reasons[decision.reason] = self.reasons.get(decision.reason, 0) + 1
        self.scheduler.on_routed(route, decision)
        if self._steps is not None:
            self._rates.append((*self._steps.steps.rates(), self._steps.steps.decode_steps()))
        self._n += 1
        slot = self._slot[decision.worker_id]
        self._active[route.request_id] = (route, slot)
        return slot

    def _retire_finished(self, view: ClusterView) -> None:
        fetching = view.in_fetch
        done = []
        for rid, (route, slot) in self._active.items():
            if rid in fetching:
                continue
            sim = view.workers[slot]
            if not sim.is_active(rid):
                done.append(rid)
            elif rid not in self._prefilled and sim.has_first_token(rid):
                self._prefilled.add(rid)  # the router sees the first token come back
                self.scheduler.on_first_token(route, self._ids[slot])
        for rid in done:
            route, slot = self._active.pop(rid)
            if rid not in self._prefilled:
                self.scheduler.on_first_token(route, self._ids[slot])
            self._prefilled.discard(rid)
            self.scheduler.on_finished(route, self._ids[slot])
