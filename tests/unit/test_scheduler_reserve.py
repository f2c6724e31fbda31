"""The ``reserve`` filter (workers kept for the higher bands) and flow control's view of it."""

from __future__ import annotations

import dataclasses

import pytest
from prometheus_client import CollectorRegistry

from kvmesh.discovery.keys import WorkerId
from kvmesh.errors import InvalidArgument
from services.router.admission import AdmissionGate
from services.router.core.admission import AdmissionConfig
from services.router.core.scheduler import build_scheduler, parse_yaml
from services.router.core.scheduler.params import parse_params
from services.router.core.scheduler.reserve import BandReserve, ReserveFilter, ReserveParams
from services.router.core.types import LoadSnapshot
from services.router.core.workers import WorkerSet
from services.router.metrics import AdmissionMetrics
from tests.unit.scheduler_fakes import ctx_for, request, views


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def ids(cands) -> list[str]:
    return [v.record.worker_id for v in cands]


def make(clock: Clock, *bands: BandReserve, lend_s: float = 10.0, exclusive: bool = True):
    return ReserveFilter("reserve", ReserveParams(bands, lend_s, exclusive), clock)


def ask(f: ReserveFilter, cands, priority: int) -> list[str]:
    req = dataclasses.replace(request(1), priority=priority)
    return ids(f.filter(ctx_for(req, cands), cands))


class TestPlan:
    def test_count_or_fraction_by_worker_id_highest_band_first(self):
        f = make(Clock(), BandReserve(5, workers=1), BandReserve(10, fraction=0.15))
        # 11 workers given out of order: 10's share is ceil(0.15 * 11) = 2, then 5's one.
        cands = list(reversed(views(11)))
        assert f.reserved(cands) == {"w00": 10, "w01": 10, "w02": 5}

    def test_one_worker_is_never_reserved(self):
        f = make(Clock(), BandReserve(10, workers=5))
        assert f.reserved(views(3)) == {"w00": 10, "w01": 10}
        assert f.reserved(views(1)) == {}

    def test_a_worker_gone_is_replaced_by_the_next(self):
        f = make(Clock(), BandReserve(10, workers=1))
        assert f.reserved(views(3)[1:]) == {"w01": 10}


class TestFilter:
    def test_lower_band_kept_off_while_the_high_band_is_active(self):
        clock = Clock()
        f = make(clock, BandReserve(10, workers=2), lend_s=5.0)
        cands = views(6)
        assert ask(f, cands, 0) == ids(cands)  # the band never asked: lent
        assert ask(f, cands, 10) == ["w00", "w01"]  # exclusive: its own workers only
        clock.t += 4.9
        assert ask(f, cands, 0) == ["w02", "w03", "w04", "w05"]
        assert ask(f, cands, 9) == ["w02", "w03", "w04", "w05"]
        clock.t += 0.2  # idle 5.1 s: lent back
        assert ask(f, cands, 0) == ids(cands)
        assert ask(f, cands, 12) == ["w00", "w01"]  # above the band: still the band's
        assert ask(f, cands, 0) == ["w02", "w03", "w04", "w05"]

    def test_never_lent(self):
        f = make(Clock(), BandReserve(10, workers=1), lend_s=0.0)
        assert ask(f, views(3), 0) == ["w01", "w02"]

    def test_not_exclusive_the_band_goes_anywhere(self):
        clock = Clock()
        f = make(clock, BandReserve(10, workers=1), exclusive=False)
        assert ask(f, views(3), 10) == ["w00", "w01", "w02"]
        assert ask(f, views(3), 0) == ["w01", "w02"]

    def test_two_bands(self):
        f = make(Clock(), BandReserve(10, workers=1), BandReserve(5, workers=1))
        cands = views(4)
        assert ask(f, cands, 10) == ["w00"]
        assert ask(f, cands, 5) == ["w01"]  # band 10 active: w00 not its
        assert ask(f, cands, 0) == ["w02", "w03"]

    def test_exclusive_band_with_no_worker_left_goes_where_it_may(self):
        f = make(Clock(), BandReserve(10, workers=1))
        assert ask(f, views(1), 10) == ["w00"]  # nothing reserved on a fleet of one

    def test_views_for_without_note_does_not_activate(self):
        f = make(Clock(), BandReserve(10, workers=1))
        assert ids(f.views_for(views(3), 10, note=False)) == ["w00"]
        assert ask(f, views(3), 0) == ["w00", "w01", "w02"]


class TestParams:
    def test_from_a_profile(self):
        spec = parse_yaml(
            """
name: reserved
filters:
  - serving
  - model
  - role
  - type: reserve
    params:
      bands: [{priority: 10, fraction: 0.1}]
      lend_after_idle_s: 3
"""
        )
        s = build_scheduler(spec)
        assert s.reserves_workers
        d = s.pick(dataclasses.replace(request(1), priority=10), views(11))
        assert d.worker_id in ("w00", "w01")  # ceil(0.1 * 11) = 2

    @pytest.mark.parametrize(
        ("raw", "match"),
        [
            ({}, "bands is empty"),
            ({"bands": [{"priority": 1, "fraction": 1.0}]}, "fraction is 1.0"),
            ({"bands": [{"priority": 1, "workers": -1}]}, "workers is -1"),
            ({"bands": [{"priority": 1}, {"priority": 1}]}, r"priority \[1\] more than once"),
            ({"bands": [{"priority": 1}], "lend_after_idle_s": -1}, "lend_after_idle_s"),
            ({"bands": [{"priorty": 1}]}, "did you mean 'priority'"),
        ],
    )
    def test_errors(self, raw, match):
        with pytest.raises(InvalidArgument, match=match):
            parse_params(ReserveParams, raw, "reserve params")


class TestFlowControlSeesTheReserve:
    def gate(self, n: int) -> tuple[AdmissionGate, WorkerSet]:
        ws = WorkerSet()
        for v in views(n):
            ws.apply_put(v.record)
        profile = parse_yaml(
            """
name: reserved
filters: [serving, model, role, {type: reserve, params: {bands: [{priority: 10, workers: 1}]}}]
scorers: [{type: in-flight}]
"""
        )
        cfg = AdmissionConfig(max_waiting=2)
        gate = AdmissionGate(
            cfg, ws, build_scheduler(profile), AdmissionMetrics(CollectorRegistry())
        )
        return gate, ws

    def test_each_band_counts_only_the_workers_it_may_use(self):
        gate, ws = self.gate(3)
        full, free = gate.free_slots("tiny")
        assert full.free_slots == 6
        assert callable(free)
        assert free(10) == 2  # its own worker, 2 free slots
        assert free(0) == 4  # the band is active now: the other two
        # The reserved worker saturated: the high band has no room, the low band still has.
        ws.set_load(WorkerId("w00"), LoadSnapshot(waiting_requests=2))
        _, free = gate.free_slots("tiny")
        assert free(10) == 0 and free(0) == 4
