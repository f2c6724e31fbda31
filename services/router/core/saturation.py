"""How many more requests a model's workers can take now, from their real state: what waits in
each engine's queue, its KV cache usage, and the wait before a new request's prefill would
start there (the prompt tokens this router sent it that are not prefilled yet, at the rate the
engine measured: the queueing term of the cost model's time to first token). Not a fixed
concurrency: the same fleet takes more short requests than long ones. Pure.

A worker is saturated when any signal reaches its limit; an unsaturated worker has
``max_waiting - waiting`` free slots (one when the queue is not a signal). Flow control
(``admission.py``) lets a request through while the fleet has a free slot.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvmesh.discovery.keys import Role, WorkerId

from .admission import AdmissionConfig
from .workers import WorkerView, waiting

SERVING_ROLES = frozenset({Role.BOTH, Role.DECODE})  # those that run a whole request


@dataclass(frozen=True, slots=True)
class Capacity:
    workers: int  # serving workers that can run the model's requests
    free_slots: int  # requests they can take now before they are saturated
    saturated_by: str = ""  # the signal that saturated the last saturated worker (for logs)


def capacity(
    views: Sequence[WorkerView],
    config: AdmissionConfig,
    backlog_s: Callable[[WorkerId], float] | None = None,
    share: float = 1.0,
    queue_signal: bool = True,
) -> Capacity:
    """``views``: the model's candidates; ``backlog_s(worker)``: the seconds of prefill this
    router has queued on it (None: not a signal); ``share``: of each limit (below 1: a band
    that may not use the reserve, ``AdmissionConfig.reserve``); ``queue_signal`` False: the
    engines' waiting queues are not looked at (a band that jumps them: one free slot per worker
    the other signals leave unsaturated)."""
    workers = free = 0
    why = ""
    max_waiting = config.max_waiting if queue_signal else 0
    if max_waiting > 0 and share < 1.0:
        max_waiting = max(int(max_waiting * share), 1)
    max_kv = config.max_kv_usage * share if config.max_kv_usage < 1.0 else 1.0
    max_backlog = config.max_prefill_backlog_s * share if backlog_s is not None else 0.0
    for v in views:
        if not v.serving or v.record.role not in SERVING_ROLES:
            continue
        workers += 1
        if max_kv < 1.0 and v.load.kv_cache_usage >= max_kv:
            why = "kv-usage"
            continue
        if (
            max_backlog > 0.0
            and backlog_s is not None
            and backlog_s(v.record.worker_id) >= max_backlog
        ):
            why = "prefill-backlog"
            continue
        if max_waiting > 0:
            room = max_waiting - waiting(v)
            if room <= 0:
                why = "waiting"
                continue
            free += room
        else:
            free += 1
    return Capacity(workers, free, why)
