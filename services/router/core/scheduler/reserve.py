"""Workers reserved for the higher priority bands: the filter ``reserve``.

Under a burst of lower-band work, an interactive request's time to first token on a shared
engine includes the engine's step in progress and the lower band's chunks in its own step: on
any engine that is busy with other work that costs about 1.4x its idle value at best
(BENCHMARKS.md, ``kvmesh bench priority --floor``). Only an engine holding no lower-band work
when the request arrives gets it to its idle value. This filter keeps such engines: per band, a
count or a fraction of the model's workers on which no request of a lower band is placed while
the band is active, and which are lent back to the lower bands once it has asked for no worker
for ``lend_after_idle_s``.

Which workers: the candidates sorted by worker id, the highest band's share first, then the
next band's (so every router of a mesh reserves the same workers without talking, and a
reserved worker that goes away is replaced by the next one in the order). At least one worker
is never reserved (a fleet of one reserves nothing), so the lowest band always has somewhere
to go. A band is *active* while one of its requests asked for a worker (this filter, or flow
control asking how many may go: ``views_for``) within ``lend_after_idle_s``; each router knows
its own traffic.

A request belongs to the highest band whose priority it reaches. With ``exclusive`` (the
default) it is placed only on its band's reserved workers while any of them is a candidate
(and flow control counts only them as its capacity: it waits in the router rather than share
an engine with the burst); otherwise anywhere, the scorers choosing. Pure.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvmesh.discovery.keys import WorkerId

from ..workers import WorkerView
from .params import check
from .plugins import CycleContext


@dataclass(frozen=True, slots=True)
class BandReserve:
    # Requests of at least this priority own the reserved workers.
    priority: int = 1
    # How many of the model's workers are reserved; the larger of this and ``fraction``.
    workers: int = 0
    # The share of the model's workers reserved, rounded up.
    fraction: float = 0.0

    def __post_init__(self) -> None:
        check(self.workers >= 0, f"workers is {self.workers}; use a count >= 0")
        check(
            0.0 <= self.fraction < 1.0,
            f"fraction is {self.fraction}; use a share in [0, 1) (one worker is never reserved)",
        )


@dataclass(frozen=True, slots=True)
class ReserveParams:
    # One entry per band that gets workers of its own; at most one per priority.
    bands: tuple[BandReserve, ...] = ()
    # A band that asked for no worker this long lends its workers to the lower bands; 0: never.
    lend_after_idle_s: float = 10.0
    # A band's requests go only to its reserved workers while any is a candidate.
    exclusive: bool = True

    def __post_init__(self) -> None:
        check(bool(self.bands), "bands is empty; list at least one {priority, workers|fraction}")
        prios = [b.priority for b in self.bands]
        dup = sorted({p for p in prios if prios.count(p) > 1})
        check(not dup, f"bands list priority {dup} more than once; one entry per band")
        check(
            self.lend_after_idle_s >= 0.0,
            f"lend_after_idle_s is {self.lend_after_idle_s}; use seconds >= 0 (0: never lend)",
        )


class ReserveFilter:
    """Keeps lower bands off the workers reserved for an active higher band, and (exclusive)
    a band's requests on its own."""

    def __init__(
        self, name: str, params: ReserveParams, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.name = name
        self.params = params
        self._bands = sorted(params.bands, key=lambda b: -b.priority)  # highest first
        self._clock = clock
        self._asked: dict[int, float] = {}  # band priority -> when one of its requests asked

    # ---- the plan -----------------------------------------------------------------------------
    def reserved(self, candidates: Sequence[WorkerView]) -> dict[WorkerId, int]:
        """Reserved worker -> the priority of the band owning it."""
        ids = sorted({v.record.worker_id for v in candidates})
        n = len(ids)
        left = n - 1  # one worker is never reserved
        out: dict[WorkerId, int] = {}
        i = 0
        for b in self._bands:
            k = min(max(b.workers, math.ceil(b.fraction * n - 1e-9)), left)
            for wid in ids[i : i + k]:
                out[wid] = b.priority
            i += k
            left -= k
        return out

    def band_of(self, priority: int) -> int | None:
        """The reserving band a request of ``priority`` belongs to (None: below them all)."""
        for b in self._bands:
            if priority >= b.priority:
                return b.priority
        return None

    def active(self, band: int, now: float) -> bool:
        lend = self.params.lend_after_idle_s
        if lend <= 0.0:
            return True
        asked = self._asked.get(band)
        return asked is not None and now - asked < lend

    # ---- the filter ---------------------------------------------------------------------------
    def views_for(
        self, candidates: Sequence[WorkerView], priority: int, note: bool = True
    ) -> Sequence[WorkerView]:
        """The candidates a request of ``priority`` may be placed on now; ``note``: count the
        question as its band's activity (a request asking for a worker)."""
        now = self._clock()
        own = self.band_of(priority)
        if note and own is not None:
            self._asked[own] = now
        owner = self.reserved(candidates)
        if not owner:
            return candidates
        if own is not None and self.params.exclusive:
            mine = [v for v in candidates if owner.get(v.record.worker_id) == own]
            if mine:
                return mine
        blocked = {
            b.priority
            for b in self._bands
            if b.priority > priority and self.active(b.priority, now)
        }
        if not blocked:
            return candidates
        return [v for v in candidates if owner.get(v.record.worker_id) not in blocked]

    def filter(self, ctx: CycleContext, candidates: Sequence[WorkerView]) -> Sequence[WorkerView]:
        return self.views_for(candidates, ctx.request.priority)
