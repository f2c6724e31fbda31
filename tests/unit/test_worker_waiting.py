"""``workers.waiting``: a worker's queue as the router sees it now, not as of its last report."""

from __future__ import annotations

import dataclasses
from collections import Counter

import pytest

from kvmesh.discovery.keys import WorkerId, WorkerRecord
from services.router.core.routing import make_policy
from services.router.core.types import LoadSnapshot
from services.router.core.workers import WorkerSet, WorkerView, outstanding, waiting
from tests.unit.scheduler_fakes import gpu, request, view


class PromptIndex:
    """Which worker holds each prompt (keyed by its first block's hash)."""

    def __init__(self) -> None:
        self.holder: dict[object, WorkerId] = {}

    def match(self, hashes, workers=None):
        w = self.holder.get(hashes[0]) if hashes else None
        return {} if w is None or (workers is not None and w not in set(workers)) else {w: gpu(2)}


def capped(v: WorkerView, cap: int) -> WorkerView:
    v.record = dataclasses.replace(v.record, max_running_requests=cap)
    return v


@pytest.mark.parametrize(
    ("reported", "sent_since", "router_in_flight", "cap", "expected"),
    [
        pytest.param(0, 0, 0, 0, 0, id="idle"),
        pytest.param(3, 0, 0, 0, 3, id="report-only"),
        # a worker that was queueing queues what it was sent since
        pytest.param(3, 2, 2, 0, 5, id="queueing-plus-sent"),
        # one that was not may have had free slots: the sends do not count as waiting
        pytest.param(0, 5, 5, 0, 0, id="free-plus-sent"),
        # ... unless it said how many it runs: what is outstanding beyond that waits
        pytest.param(0, 5, 12, 10, 2, id="beyond-cap"),
        pytest.param(4, 0, 12, 10, 4, id="report-larger-than-beyond-cap"),
        pytest.param(-1, 0, 0, 0, 0, id="negative-report"),
    ],
)
def test_waiting(reported, sent_since, router_in_flight, cap, expected):
    v = capped(view("w", waiting=reported, router_in_flight=router_in_flight), cap)
    v.sent_since_report = sent_since
    assert waiting(v) == expected


def test_worker_set_counts_sends_until_the_next_report():
    ws = WorkerSet()
    rec = WorkerRecord(worker_id=WorkerId("w1"), address="a:1", model="m", model_path="/m")
    ws.apply_put(rec)
    wid = WorkerId("w1")
    ws.set_load(wid, LoadSnapshot(waiting_requests=2))
    ws.started(wid)
    ws.started(wid)
    v = ws.get(wid)
    assert v is not None and v.sent_since_report == 2 and waiting(v) == 4
    ws.finished(wid)  # a finish does not undo a send the report has not seen
    assert v.sent_since_report == 2
    ws.set_load(wid, LoadSnapshot(waiting_requests=3))
    assert v.sent_since_report == 0 and waiting(v) == 3


def test_a_burst_on_a_hot_prefix_spills_at_capacity():
    """8 workers that each run 10 at once, all last reported idle; 80 arrivals before any new
    report: 40 distinct prompts, then 40 repeats of the first one (sub-agents sharing one
    context), fully cached where the first went, so neither the prefill ledger nor the cost of
    recomputing pushes them away. Placed by the default profile, the holder takes what it runs
    at once and the rest spill to the others (the burst of issue 11's `kvmesh bench streams`);
    without ``max_running_requests`` all 40 would pile onto the holder."""
    index = PromptIndex()
    policy = make_policy("precise-sticky", index=index)
    ws = [capped(view(f"w{i}"), 10) for i in range(8)]
    placed: Counter[str] = Counter()
    for i in range(80):
        p = i if i < 40 else 0
        req = request(rid=f"r{i}", hashes=(p + 1, p + 1000), prompt_tokens=32)
        d = policy.pick(req, ws)
        policy.on_routed(req, d)
        v = next(w for w in ws if w.record.worker_id == d.worker_id)
        v.router_in_flight += 1
        v.sent_since_report += 1
        placed[d.worker_id] += 1
        if i < 40:  # cached where it went as soon as it is sent
            index.holder[req.block_hashes[0]] = d.worker_id
    assert max(placed.values()) <= 11, placed
    assert sorted(placed.values())[0] >= 9, placed


# ---- a worker that left etcd while alive (an etcd outage that outlived its lease) ------------
class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


W1 = WorkerId("w1")


def one_worker(linger_s: float, clock: Clock) -> WorkerSet:
    ws = WorkerSet(linger_s=linger_s, clock=clock)
    rec = WorkerRecord(worker_id=WorkerId("w1"), address="a:1", model="m", model_path="/m")
    ws.apply_put(rec)
    return ws


def test_a_live_worker_outlives_its_record_until_it_registers_again():
    clock = Clock()
    ws = one_worker(30.0, clock)
    ws.set_load(WorkerId("w1"), LoadSnapshot())  # its load stream answers
    assert ws.apply_delete(W1).removed == ()  # the lease expired; the worker did not
    assert [v.record.worker_id for v in ws.candidates("m")] == ["w1"]  # still routed to
    clock.now += 5
    assert ws.expire_unregistered().removed == ()
    rec = WorkerRecord(worker_id=WorkerId("w1"), address="a:1", model="m", model_path="/m")
    ws.apply_put(rec)  # registered again
    clock.now += 60
    assert ws.expire_unregistered().removed == ()
    view = ws.get(WorkerId("w1"))
    assert view is not None and view.unregistered_at is None


def test_a_lingering_worker_goes_when_its_stream_ends_or_its_time_runs_out():
    clock = Clock()
    ws = one_worker(30.0, clock)
    ws.set_load(WorkerId("w1"), LoadSnapshot())
    ws.apply_delete(W1)
    clock.now += 30
    assert ws.expire_unregistered().removed == ("w1",)
    ws = one_worker(30.0, clock)
    ws.set_load(WorkerId("w1"), LoadSnapshot())
    ws.apply_snapshot([])  # a resync that no longer lists it: the same
    assert len(ws) == 1
    ws.load_stream_ended(WorkerId("w1"))
    assert ws.expire_unregistered().removed == ("w1",)


@pytest.mark.parametrize("linger_s", [0.0, 30.0])
def test_a_dead_or_unlingering_worker_goes_with_its_record(linger_s):
    clock = Clock()
    ws = one_worker(linger_s, clock)
    if linger_s:  # lingering on, but its load stream broke (SIGKILL): gone at once
        ws.set_load(WorkerId("w1"), LoadSnapshot())
        ws.load_stream_ended(WorkerId("w1"))
    assert ws.apply_delete(W1).removed == ("w1",)


def test_outstanding_counts_what_was_sent_since_the_report():
    """Another router's 5 requests are in the worker's report; this router sent 2 since it:
    7 outstanding (without the correction both routers would read 5 and pile on)."""
    v = view("w", in_flight=5, router_in_flight=2)
    v.sent_since_report = 2
    assert outstanding(v) == 7
    v.sent_since_report = 0  # a new report: it counts them now
    assert outstanding(v) == 5
    assert outstanding(view("w", in_flight=1, router_in_flight=4)) == 4
