"""The scheduler: one profile (filters -> weighted scorers -> picker) behind the interface the
servicer already calls, ``pick(request, candidates) -> RouteDecision``, plus feedback hooks.

The framework clamps each score to [0, 1], multiplies it by the scorer's weight and sums; it
times every stage (``perf_counter_ns``), and explains the decision without formatting anything:
the weighted scores of the winner and the runner-up, and the scorer whose margin between them
was the largest (the decision's ``reason``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, cast

from kvmesh.discovery.keys import WorkerId
from kvmesh.errors import InvalidArgument, Unavailable

from ..types import Explanation, RouteDecision, RouteRequest
from ..workers import WorkerView
from .ledger import InFlightLedger
from .plugins import (
    BandFilter,
    Choice,
    CostSource,
    CycleContext,
    Filter,
    Picker,
    PrefixSource,
    Scorer,
    VolumeSource,
)

_now = time.perf_counter_ns

# ``Scheduler.on_cycle``: (the cycle, the candidates offered before the filters, the decision)
CycleHook = Callable[[CycleContext, Sequence[WorkerView], RouteDecision], None]


@dataclass(frozen=True, slots=True)
class Weighted:
    scorer: Scorer
    weight: float  # >= 0; 0: not scored (kept only as a prefix source for other plugins)


@dataclass(slots=True)
class StageTiming:
    calls: int = 0
    total_ns: int = 0
    max_ns: int = 0


class Scheduler:
    """A built profile. ``name`` is the profile's name (``RouteDecision.policy``)."""

    def __init__(
        self,
        name: str,
        filters: Sequence[Filter],
        scorers: Sequence[Weighted],
        picker: Picker,
    ) -> None:
        self.name = name
        self._filters = tuple(filters)
        self._scorers = tuple(w for w in scorers if w.weight > 0)
        self._weights = tuple(w.weight for w in self._scorers)
        self._picker = picker
        self.scorer_names = tuple(w.scorer.name for w in self._scorers)
        self.stages = (
            *(f.name for f in self._filters),
            *self.scorer_names,
            picker.name,
        )
        names = [f.name for f in self._filters] + [w.scorer.name for w in scorers] + [picker.name]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise InvalidArgument(
                f"profile {name!r}: plugin names {dup} are used more than once; give each "
                "entry a distinct 'name'"
            )
        for w in scorers:
            if not w.weight >= 0:  # also rejects NaN
                raise InvalidArgument(
                    f"profile {name!r}: scorer {w.scorer.name!r} has weight {w.weight}; use >= 0"
                )
        # A profile's sources, each the first scorer (weight 0 included) offering it: the prefix
        # match (prefix scorers), the routed-volume count (``routed-volume``'s, which
        # ``volume-bound`` bounds) and the estimated time to first token (``ttft-cost``'s, which
        # ``volume-bound``'s move_slack_s weighs a move by). A plugin that needs one the profile
        # lacks is refused here, saying what to add.
        members = [w.scorer for w in scorers]
        self.prefix_source = cast("PrefixSource | None", _first_with(members, "prefix_match"))
        volumes = (getattr(m, "volume", None) for m in members)
        self.volume_source = cast("VolumeSource | None", _first_with(volumes, "routed_volume"))
        self.cost_source = cast("CostSource | None", _first_with(members, "ttft_estimates"))
        needs: tuple[tuple[str, Sequence[Any], str, object, str], ...] = (
            ("scorer", members, "needs_prefix_source", self.prefix_source,
             "needs a prefix scorer (precise-prefix or approximate-prefix) in the same profile; "
             "add one (weight 0 makes it a source only)"),
            ("filter", self._filters, "needs_volume_source", self.volume_source,
             "bounds the routed-volume count; add a routed-volume scorer to the same profile "
             "(weight 0 keeps it a count only)"),
            ("filter", self._filters, "needs_cost_source", self.cost_source,
             "weighs moves by the estimated time to first token; add a ttft-cost scorer to the "
             "same profile (weight 0 keeps it an estimate only), or drop the filter's "
             "move_slack_s"),
        )  # fmt: skip
        for kind, needers, flag, source, remedy in needs:
            for p in needers:
                if getattr(p, flag, False) and source is None:
                    raise InvalidArgument(f"profile {name!r}: {kind} {p.name!r} {remedy}")
        plugins: list[Any] = [*self._filters, *(w.scorer for w in scorers), picker]
        # Each hook is optional: a plugin implements the ones it needs (see ``Feedback``).
        self._on_routed = tuple(p.on_routed for p in plugins if hasattr(p, "on_routed"))
        self._on_first_token = tuple(
            p.on_first_token for p in plugins if hasattr(p, "on_first_token")
        )
        self._on_finished = tuple(p.on_finished for p in plugins if hasattr(p, "on_finished"))
        # Filters that narrow the candidates by the request's priority alone (``reserve``):
        # flow control asks them which workers a band may use (``band_views``).
        self._by_band = tuple(
            cast(BandFilter, f) for f in self._filters if callable(getattr(f, "views_for", None))
        )
        self.ledger = InFlightLedger()
        self._timing = [StageTiming() for _ in self.stages]
        # Called at the end of each pick with the cycle (its memoised prefix match and cost
        # estimates), the candidates offered before the filters, and the decision; None (the
        # default): nothing. For tracing decisions (the replay's --trace-decisions), not for
        # routing: it runs before ``on_routed``, so the counts it reads are the decision's.
        self.on_cycle: CycleHook | None = None

    # ---- the hot path --------------------------------------------------------------------------
    def pick(self, request: RouteRequest, candidates: Sequence[WorkerView]) -> RouteDecision:
        if not candidates:
            raise Unavailable(
                f"no serving worker for model {request.model!r}; start a worker or wait for one "
                "to register"
            )
        ctx = CycleContext(
            request,
            candidates,
            self.ledger,
            self.prefix_source,
            self.volume_source,
            self.cost_source,
        )
        ns: list[int] = []
        cands = candidates
        for f in self._filters:
            t = _now()
            before = len(cands)
            cands = f.filter(ctx, cands)
            ns.append(_now() - t)
            if not cands:
                raise Unavailable(
                    f"no worker for model {request.model!r} passed filter {f.name!r} "
                    f"({before} candidate(s) before it); check the workers' state, model and "
                    "role, or the profile's filters"
                )
        ctx.candidates = cands
        n = len(cands)
        totals = [0.0] * n
        columns: list[list[float]] = []
        for ws, weight in zip(self._scorers, self._weights, strict=True):
            t = _now()
            raw = ws.scorer.score(ctx, cands)
            if len(raw) != n:
                raise RuntimeError(
                    f"scorer {ws.scorer.name!r} returned {len(raw)} scores for {n} candidates"
                )
            # Clamp to [0, 1]; NaN fails both comparisons and counts as 0.
            col = [weight * x if 0.0 <= x <= 1.0 else (weight if x > 1.0 else 0.0) for x in raw]
            totals = [a + b for a, b in zip(totals, col, strict=True)]
            columns.append(col)
            ns.append(_now() - t)
        t = _now()
        choice = self._picker.pick(ctx, cands, totals)
        ns.append(_now() - t)
        self._account(ns)
        decision = self._decide(ctx, len(candidates), cands, columns, choice, ns)
        if self.on_cycle is not None:
            self.on_cycle(ctx, candidates, decision)
        return decision

    def _decide(
        self,
        ctx: CycleContext,
        offered: int,
        cands: Sequence[WorkerView],
        columns: list[list[float]],
        choice: Choice,
        ns: list[int],
    ) -> RouteDecision:
        win, ru = choice.index, choice.runner_up
        if not choice.uses_scores:
            deciding = self._picker.name
            ru = -1
        elif ru < 0:
            deciding = "only-candidate" if len(cands) == 1 else "tie-break"
        else:
            deciding = "tie-break"
            best = 0.0
            for k, col in enumerate(columns):
                d = col[win] - col[ru]
                if d > best:
                    best, deciding = d, self.scorer_names[k]
        winner = cands[win]
        wid = winner.record.worker_id
        cached_blocks = cached_tokens = cached_gpu = -1
        total_blocks = len(ctx.request.block_hashes)
        if self.prefix_source is not None:
            m = ctx.prefix().get(wid)
            cached_blocks = m.blocks if m is not None else 0
            cached_gpu = m.gpu_blocks if m is not None else 0
            bs = winner.record.block_size or (
                ctx.request.prompt_tokens // total_blocks if total_blocks else 0
            )
            cached_tokens = min(cached_blocks * bs, ctx.request.prompt_tokens)
        explanation = Explanation(
            profile=self.name,
            deciding=deciding,
            candidates=offered,
            eligible=len(cands),
            scorers=self.scorer_names,
            winner_scores=tuple(col[win] for col in columns),
            runner_up=cands[ru].record.worker_id if ru >= 0 else None,
            runner_up_scores=tuple(col[ru] for col in columns) if ru >= 0 else (),
            tied=choice.tied,
            cached_blocks=cached_blocks,
            cached_tokens=cached_tokens,
            cached_gpu_blocks=cached_gpu,
            total_blocks=total_blocks,
            stages=self.stages,
            stage_ns=tuple(ns),
            worker_ids=tuple([v.record.worker_id for v in cands]),
            columns=tuple(columns),
        )
        return RouteDecision(wid, self.name, deciding, explanation)

    def _account(self, ns: list[int]) -> None:
        for st, x in zip(self._timing, ns, strict=True):
            st.calls += 1
            st.total_ns += x
            if x > st.max_ns:
                st.max_ns = x

    # ---- feedback ------------------------------------------------------------------------------
    def on_routed(self, request: RouteRequest, decision: RouteDecision) -> None:
        """The request was sent to ``decision.worker_id`` (call after a successful pick and
        before the worker call, once per attempt)."""
        e = decision.explanation
        cached = e.cached_tokens if e is not None and e.cached_tokens > 0 else 0
        self.ledger.routed(
            request.request_id,
            decision.worker_id,
            request.prompt_tokens,
            request.prompt_tokens - cached,
            request.priority,
        )
        for hook in self._on_routed:
            hook(request, decision)

    def on_first_token(self, request: RouteRequest, worker_id: WorkerId) -> None:
        """The worker sent the request's first token: its prefill is done."""
        self.ledger.first_token(request.request_id)
        for hook in self._on_first_token:
            hook(request, worker_id)

    def on_finished(self, request: RouteRequest, worker_id: WorkerId) -> None:
        """The attempt on ``worker_id`` ended (finished, failed or cancelled)."""
        self.ledger.finished(request.request_id, worker_id)
        for hook in self._on_finished:
            hook(request, worker_id)

    # ---- introspection -------------------------------------------------------------------------
    def cached_tokens(self, request: RouteRequest, candidates: Sequence[WorkerView]) -> int:
        """The longest prefix of the request any candidate holds (any tier), in tokens, per the
        profile's prefix source: what flow control does not charge (0: no prefix source).
        One index walk, as ``pick``'s."""
        if self.prefix_source is None or not request.block_hashes or not candidates:
            return 0
        ctx = CycleContext(request, candidates, self.ledger, self.prefix_source)
        matches = ctx.prefix()
        fallback = request.prompt_tokens // len(request.block_hashes)
        best = 0
        for v in candidates:
            m = matches.get(v.record.worker_id)
            if m is not None and m.blocks > 0:
                best = max(best, m.blocks * (v.record.block_size or fallback))
        return min(best, request.prompt_tokens)

    @property
    def reserves_workers(self) -> bool:
        """The profile keeps some workers for some bands (a ``reserve`` filter)."""
        return bool(self._by_band)

    def band_views(self, candidates: Sequence[WorkerView], priority: int) -> Sequence[WorkerView]:
        """The candidates a request of ``priority`` may be placed on, per the profile's
        band filters (all of them when it has none); flow control's view of a band's room."""
        for f in self._by_band:
            candidates = f.views_for(candidates, priority)
        return candidates

    def weighted_scorers(self) -> tuple[Weighted, ...]:
        """The profile's scorers that score (weight > 0), in order."""
        return self._scorers

    def timings(self) -> dict[str, StageTiming]:
        """Cumulative time per stage (filters, scorers, picker), for metrics."""
        return dict(zip(self.stages, self._timing, strict=True))


def _first_with(candidates: Iterable[object], method: str) -> Any | None:
    """The first of ``candidates`` with a callable ``method``, or None."""
    return next((c for c in candidates if callable(getattr(c, method, None))), None)
