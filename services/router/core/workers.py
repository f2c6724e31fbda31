"""The live worker set, fed by etcd (records) and by the workers' load streams.

The discovery adapter parses etcd's keys and values (``kvmesh/discovery/keys.py``: a malformed
record is logged and skipped there) and calls ``apply_snapshot`` / ``apply_put`` /
``apply_delete`` with records and worker ids.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace

from kvmesh import errors
from kvmesh.discovery.keys import (
    WorkerId,
    WorkerRecord,
    WorkerState,
    routing_targets,
    split_target,
)

from .types import LoadSnapshot

log = logging.getLogger(__name__)


@dataclass(slots=True)
class WorkerView:
    record: WorkerRecord
    load: LoadSnapshot = field(default_factory=LoadSnapshot)
    # Requests this router has sent to the worker and not seen finish.
    router_in_flight: int = 0
    # Requests this router sent the worker since its last load report (which cannot count them).
    sent_since_report: int = 0
    # Its load stream is open and has answered: the worker is alive, whatever etcd says.
    load_live: bool = False
    # When its etcd record vanished while its load stream was live (None: registered).
    unregistered_at: float | None = None

    @property
    def serving(self) -> bool:
        return self.record.state is WorkerState.SERVING


def outstanding(view: WorkerView) -> int:
    """Requests a worker is busy with: the larger of what this router sent it and what the
    worker reports (other routers' requests show up only in the worker's report) plus what
    this router sent since that report, which the report cannot count yet."""
    reported = view.load.in_flight_requests + view.sent_since_report
    return max(view.router_in_flight, reported)


def waiting(view: WorkerView) -> int:
    """Requests waiting in a worker's queue, now. The worker's report is up to one load interval
    old, so a burst of arrivals would pile onto the worker that last said it was least busy.
    Two corrections from what this router knows first-hand: a worker that reported a queue
    queues what was sent to it since (until its next report); and one that published how many
    requests it runs at once (``max_running_requests``) queues what is outstanding beyond that."""
    reported = view.load.waiting_requests
    if reported > 0:
        reported += view.sent_since_report
    else:
        reported = 0
    cap = view.record.max_running_requests
    if cap <= 0:
        return reported
    beyond = outstanding(view) - cap
    return beyond if beyond > reported else reported


@dataclass(frozen=True, slots=True)
class ModelSummary:
    name: str
    max_model_len: int
    block_size: int
    vocab_size: int
    model_path: str
    workers: int


@dataclass(frozen=True, slots=True)
class Change:
    """What an etcd update did to the set, so the adapter can open or close worker channels."""

    added: tuple[WorkerRecord, ...] = ()
    removed: tuple[WorkerId, ...] = ()
    updated: tuple[WorkerRecord, ...] = ()


class WorkerSet:
    """Routing targets by id. A registered worker is one target, or, with several data-parallel
    ranks (``WorkerRecord.data_parallel_size``), one per rank (``keys.routing_targets``: ids
    ``<worker>#r<rank>``); a ``Change`` names targets, so channels, load and KV event streams
    are per rank, and etcd's delete of the worker removes all of its ranks."""

    def __init__(self, linger_s: float = 0.0, clock: Callable[[], float] = time.monotonic) -> None:
        """``linger_s``: how long a worker whose etcd record vanished stays while its load
        stream is live (etcd unreachable long enough for its lease to expire, then back: the
        worker registers again within seconds). 0: gone with its record."""
        self._workers: dict[WorkerId, WorkerView] = {}
        self._linger_s = linger_s
        self._clock = clock

    # ---- discovery side -------------------------------------------------------------------
    def apply_snapshot(self, records: Iterable[WorkerRecord]) -> Change:
        """All registered workers, as a (re)started watch lists them; the last record of an id
        wins."""
        by_id = {t.worker_id: t for r in records for t in routing_targets(r)}
        removed = tuple(w for w in self._workers if w not in by_id and not self._linger(w))
        for wid in removed:
            del self._workers[wid]
        added: list[WorkerRecord] = []
        updated: list[WorkerRecord] = []
        for wid, rec in by_id.items():
            (updated if wid in self._workers else added).append(rec)
            self._upsert(rec)
        return Change(added=tuple(added), removed=removed, updated=tuple(updated))

    def apply_put(self, record: WorkerRecord) -> Change:
        targets = routing_targets(record)
        keep = {t.worker_id for t in targets}
        stale = tuple(t for t in self._targets_of(record.worker_id) if t not in keep)
        for tid in stale:  # its rank count changed
            del self._workers[tid]
        added: list[WorkerRecord] = []
        updated: list[WorkerRecord] = []
        for t in targets:
            (updated if t.worker_id in self._workers else added).append(t)
            self._upsert(t)
        return Change(added=tuple(added), removed=stale, updated=tuple(updated))

    def apply_delete(self, worker_id: WorkerId) -> Change:
        """The worker's etcd record is gone: the worker, or all of its ranks."""
        removed = []
        for tid in self._targets_of(worker_id):
            if not self._linger(tid):
                del self._workers[tid]
                removed.append(tid)
        return Change(removed=tuple(removed)) if removed else Change()

    def _targets_of(self, worker_id: WorkerId) -> list[WorkerId]:
        """The target ids of a registered worker: its own, or its ranks'."""
        return [t for t in self._workers if t == worker_id or split_target(t)[0] == worker_id]

    def _linger(self, worker_id: WorkerId) -> bool:
        """Keeps a serving worker whose record vanished while its load stream is live."""
        view = self._workers[worker_id]
        if self._linger_s <= 0 or not view.serving or not view.load_live:
            return False
        if view.unregistered_at is None:
            view.unregistered_at = self._clock()
            log.warning(
                "worker %s left etcd but its load stream is live: kept for up to %g s for it "
                "to register again (an etcd outage outlived its lease?)",
                worker_id,
                self._linger_s,
            )
        return True

    def expire_unregistered(self) -> Change:
        """Drops the lingering workers whose load stream ended or whose linger ran out."""
        now = self._clock()
        gone = tuple(
            wid
            for wid, v in self._workers.items()
            if v.unregistered_at is not None
            and (not v.load_live or now - v.unregistered_at >= self._linger_s)
        )
        for wid in gone:
            del self._workers[wid]
        return Change(removed=gone) if gone else Change()

    def _upsert(self, rec: WorkerRecord) -> None:
        view = self._workers.get(rec.worker_id)
        if view is None:
            self._workers[rec.worker_id] = WorkerView(record=rec)
        else:
            view.record = rec
            view.unregistered_at = None  # registered again

    # ---- load side ------------------------------------------------------------------------
    def set_load(self, worker_id: WorkerId, load: LoadSnapshot) -> None:
        view = self._workers.get(worker_id)
        if view is not None:
            view.load = load
            view.sent_since_report = 0
            view.load_live = True

    def load_stream_ended(self, worker_id: WorkerId) -> None:
        view = self._workers.get(worker_id)
        if view is not None:
            view.load_live = False

    def started(self, worker_id: WorkerId) -> None:
        view = self._workers.get(worker_id)
        if view is not None:
            view.router_in_flight += 1
            view.sent_since_report += 1

    def finished(self, worker_id: WorkerId) -> None:
        view = self._workers.get(worker_id)
        if view is not None and view.router_in_flight > 0:
            view.router_in_flight -= 1

    def mark_draining(self, worker_id: WorkerId) -> None:
        """Stop routing to a worker that said it is draining before etcd tells us."""
        view = self._workers.get(worker_id)
        if view is not None:
            view.record = replace(view.record, state=WorkerState.DRAINING)

    # ---- queries --------------------------------------------------------------------------
    def get(self, worker_id: WorkerId) -> WorkerView | None:
        return self._workers.get(worker_id)

    def __len__(self) -> int:
        return len(self._workers)

    def all(self) -> Iterable[WorkerView]:
        return self._workers.values()

    def candidates(self, model: str) -> list[WorkerView]:
        """Serving workers of a model, in a stable order."""
        return sorted(
            (v for v in self._workers.values() if v.serving and v.record.model == model),
            key=lambda v: v.record.worker_id,
        )

    def models(self) -> list[ModelSummary]:
        """Models offered by serving workers (facts taken from the first worker by id)."""
        by_model: dict[str, list[WorkerView]] = {}
        for v in self._workers.values():
            if v.serving:
                by_model.setdefault(v.record.model, []).append(v)
        out = []
        for name, views in sorted(by_model.items()):
            first = min(views, key=lambda v: v.record.worker_id).record
            out.append(
                ModelSummary(
                    name=name,
                    max_model_len=first.max_model_len,
                    block_size=first.block_size,
                    vocab_size=first.vocab_size,
                    model_path=first.model_path,
                    workers=len({split_target(v.record.worker_id)[0] for v in views}),
                )
            )
        return out

    def model(self, name: str) -> ModelSummary:
        """The served model a request names; an empty name: the only one served. Unavailable
        when nothing is served, InvalidArgument when several are and none is named, NotFound
        when the name is not served."""
        models = self.models()
        if not models:
            raise errors.Unavailable(
                "no worker is registered and serving; start one (kvmesh up / kvmesh worker)"
            )
        if not name:
            if len(models) == 1:
                return models[0]
            raise errors.InvalidArgument(
                f"several models are served ({', '.join(m.name for m in models)}); set model",
                "model",
            )
        for m in models:
            if m.name == name:
                return m
        raise errors.NotFound(
            f"model {name!r} is not served; served models: {', '.join(m.name for m in models)}"
        )
