"""Flow control's core (services/router/core/admission.py): priority bands served strictly,
tenants within a band sharing by uncached tokens, FCFS within a tenant, bounded queues with a
TTL, Retry-After from the measured drain rate, pre-emption of requests that have not started.
Deterministic: an injected clock, free slots given by the test."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from kvmesh.errors import InvalidArgument
from services.router.core.admission import (
    AdmissionConfig,
    FlowControl,
    Reason,
    State,
    Ticket,
)

M = "m"


@dataclass
class Clock:
    now: float = 100.0

    def __call__(self) -> float:
        return self.now


def jain(xs: list[float]) -> float:
    return sum(xs) ** 2 / (len(xs) * sum(x * x for x in xs))


class Fleet:
    """A fleet of ``slots`` concurrent requests in front of a ``FlowControl``: arrivals go
    through ``arrive``; ``finish`` ends the oldest running request and pumps."""

    def __init__(self, slots: int, **cfg: object) -> None:
        self.clock = Clock()
        self.fc = FlowControl(AdmissionConfig(enabled=True, **cfg), self.clock)  # type: ignore[arg-type]
        self.slots = slots
        self.running: list[Ticket] = []
        self.n = 0

    def free(self) -> int:
        return self.slots - len(self.running)

    def arrive(
        self, tenant: str, priority: int = 0, uncached: int = 100, out: int = 0, **kw: object
    ) -> Ticket:
        self.n += 1
        t, changed = self.fc.arrive(
            M,
            f"r{self.n}",
            tenant,
            priority,
            uncached,
            out,
            self.free(),
            **kw,  # type: ignore[arg-type]
        )
        if t.state is State.RUNNING:
            self.running.append(t)
        self._take(changed)
        return t

    def _take(self, changed: list[Ticket]) -> None:
        for c in changed:
            if c.state is State.GRANTED and self.fc.started(c):
                self.running.append(c)

    def pump(self) -> None:
        self._take(self.fc.pump(M, self.free()))

    def finish(self, t: Ticket | None = None, out: int | None = None) -> Ticket:
        t = t or self.running[0]
        self.running.remove(t)
        self.fc.leave(t, out)
        self.pump()
        return t

    def order(self) -> Iterator[Ticket]:
        """Finishes running requests one at a time, yielding each as it finishes."""
        while self.running:
            yield self.finish()


# ---- the fast path ------------------------------------------------------------------------
def test_a_request_goes_at_once_while_the_fleet_has_room() -> None:
    f = Fleet(slots=2)
    a, b = f.arrive("a"), f.arrive("b")
    assert (a.state, b.state) == (State.RUNNING, State.RUNNING)
    assert not a.waited and a.wait_s == 0.0
    c = f.arrive("c")
    assert c.state is State.QUEUED and c.waited


def test_room_does_not_let_a_request_pass_those_waiting_in_its_band_or_above() -> None:
    f = Fleet(slots=1)
    f.arrive("a")
    q = f.arrive("b", priority=5)
    assert q.state is State.QUEUED
    # A slot appears (another router's request ended) but no pump ran yet: a newcomer of the
    # same band queues behind, one of a higher band may pass, one of a lower band may not.
    t, _ = f.fc.arrive(M, "x", "c", 5, 100, 0, free_slots=1)
    assert t.state is State.QUEUED
    assert q.state is State.GRANTED  # its arrival pumped: the earlier one went first


# ---- bands ----------------------------------------------------------------------------------
def test_a_higher_band_goes_first_strictly() -> None:
    f = Fleet(slots=1)
    f.arrive("batch")
    lows = [f.arrive("batch", priority=0) for _ in range(3)]
    highs = [f.arrive("search", priority=10) for _ in range(2)]
    served = list(f.order())[1:]
    assert served == [*highs, *lows]


def test_a_lower_band_request_granted_but_not_started_goes_back_for_a_higher_one() -> None:
    f = Fleet(slots=1)
    first = f.arrive("batch")
    low1, low2 = f.arrive("batch"), f.arrive("batch")
    f.running.remove(first)
    f.fc.leave(first, 0)
    granted = f.fc.pump(M, 1)  # low1 granted; its task has not run yet
    assert granted == [low1] and low1.state is State.GRANTED
    high, changed = f.fc.arrive(M, "h", "search", 10, 100, 0, free_slots=1)
    # The fleet's one slot is low1's grant: the higher band takes it, low1 goes back first
    # in line of its band (before low2).
    assert high.state is State.GRANTED and low1.state is State.QUEUED
    assert changed == [low1] and low1.preemptions == 1
    assert not f.fc.started(low1)  # its task wakes, finds itself queued: it waits again
    assert f.fc.started(high)
    f.running.append(high)
    assert list(f.order())[1:] == [low1, low2]


def test_when_every_queue_is_full_a_higher_band_preempts_the_newest_lowest_waiting() -> None:
    f = Fleet(slots=1, queue_max_total=3, queue_max_requests=3)
    f.arrive("a")
    mid = f.arrive("b", priority=1)
    low1, low2 = f.arrive("c", priority=0), f.arrive("c", priority=0)
    high = f.arrive("d", priority=9)
    assert high.state is State.QUEUED
    assert low2.state is State.REJECTED and low2.rejection is not None
    assert low2.rejection.reason is Reason.PREEMPTED and low2.rejection.retry_after_s
    assert low1.state is State.QUEUED and mid.state is State.QUEUED
    # A request of the lowest band finds no one below it to pre-empt: refused itself.
    low3 = f.arrive("c", priority=0)
    assert low3.rejection is not None and low3.rejection.reason is Reason.QUEUE_FULL


def test_a_reserve_lets_a_higher_band_through_while_lower_ones_wait() -> None:
    """Free slots per band: the fleet has 1 slot for bands below 10 (its reserve held back)
    and 2 for band 10. A low request takes the first; the next low one waits; a high one goes
    at once into the reserve instead of waiting for the low one to finish."""
    clock = Clock()
    fc = FlowControl(AdmissionConfig(enabled=True), clock)
    running = 0

    def free(band: int) -> int:
        return (2 if band >= 10 else 1) - running

    low, _ = fc.arrive(M, "l1", "batch", 0, 100, 0, free)
    assert low.state is State.RUNNING
    running = 1
    low2, _ = fc.arrive(M, "l2", "batch", 0, 100, 0, free)
    assert low2.state is State.QUEUED
    high, _ = fc.arrive(M, "h", "search", 10, 100, 0, free)
    assert high.state is State.RUNNING  # the waiting low one is in a lower band
    running = 2
    assert fc.pump(M, free) == []  # low2 still waits: the reserve is not its
    running = 1  # the high one ended; still none for the low band
    assert fc.pump(M, free) == []
    running = 0
    assert fc.pump(M, free) == [low2]


# ---- fairness within a band -----------------------------------------------------------------
def test_two_equal_tenants_alternate() -> None:
    f = Fleet(slots=1)
    f.arrive("x")
    for _ in range(4):
        f.arrive("a")
    for _ in range(4):
        f.arrive("b")  # all of b's arrive after all of a's
    served = [t.tenant for t in list(f.order())[1:]]
    assert served == ["a", "b"] * 4


def test_fairness_is_charged_by_uncached_tokens_not_requests() -> None:
    """A tenant resending a cached context (100 uncached tokens) and one flooding cold prompts
    (1,000): while both are backlogged, each gets the same uncached tokens, so the cached one
    runs ten requests per cold one."""
    f = Fleet(slots=1)
    f.arrive("x")
    for _ in range(50):
        f.arrive("warm", uncached=100)
        f.arrive("cold", uncached=1000)
    served = list(f.order())[1:]
    both = served[:40]  # while both still wait
    tokens = {"warm": 0.0, "cold": 0.0}
    for t in both:
        tokens[t.tenant] += t.prefill_cost
    counts = {k: sum(1 for t in both if t.tenant == k) for k in tokens}
    assert counts["warm"] >= 9 * counts["cold"]
    assert jain(list(tokens.values())) >= 0.95


def test_expected_output_counts_and_is_corrected_to_what_was_generated() -> None:
    f = Fleet(slots=1, decode_token_weight=2.0)
    f.arrive("x")
    a = f.arrive("a", uncached=10, out=100)
    assert a.decode_cost == 200.0 and a.cost == 210.0
    f.arrive("b", uncached=10, out=100)
    f.arrive("a", uncached=10, out=100)  # a stays backlogged: its counter is kept
    first = f.finish()  # x ends: a (earlier) goes
    assert a.state is State.RUNNING and first.tenant == "x"
    before = f.fc.counter(M, 0, "a")
    assert before is not None
    f.running.remove(a)
    f.fc.leave(a, 5)  # it generated 5 of 100: charged 10 + 2 * 5
    after = f.fc.counter(M, 0, "a")
    assert after == pytest.approx(before - 200.0 + 10.0)


def test_within_a_tenant_first_come_first_served() -> None:
    f = Fleet(slots=1)
    f.arrive("x")
    mine = [f.arrive("a", uncached=u) for u in (900, 10, 500)]
    assert list(f.order())[1:] == mine


def test_an_idle_tenant_earns_no_credit() -> None:
    """b was away while a ran alone; when b comes back it starts level with a, not with the
    credit of all the time it did not use (it does not get every next turn)."""
    f = Fleet(slots=1)
    for _ in range(20):
        f.arrive("a")
        f.finish()
    f.arrive("a")  # running
    for _ in range(3):
        f.arrive("a")
    for _ in range(3):
        f.arrive("b")
    served = [t.tenant for t in list(f.order())[1:]]
    assert served == ["a", "b"] * 3


def test_tenants_that_come_and_go_leave_nothing_behind() -> None:
    f = Fleet(slots=2)
    for i in range(200):
        t = f.arrive(f"t{i}")
        f.finish(t, out=0)
    assert f.fc.queued() == 0
    assert f.fc._flows[M].bands == {}  # the memory bound is the point


# ---- bounds, TTL and Retry-After ------------------------------------------------------------
def test_a_full_band_refuses_with_a_retry_after_from_the_drain_rate() -> None:
    f = Fleet(slots=2, queue_max_requests=4, retry_after_min_s=0.0)
    f.arrive("a")
    f.arrive("a")
    for _ in range(8):  # a measured rate: a completion every 0.5 s
        f.clock.now += 0.5
        f.finish()
        f.arrive("a")
    assert f.fc.drain_rate(M) == pytest.approx(2.0)
    for _ in range(4):
        f.arrive("a")
    over = f.arrive("a")
    assert over.state is State.REJECTED and over.rejection is not None
    assert over.rejection.reason is Reason.QUEUE_FULL
    # 4 ahead + itself at 2 per second
    assert over.rejection.retry_after_s == pytest.approx(2.5)
    assert "queue of priority 0 is full" in over.rejection.message
    # Another band has its own queue.
    assert f.arrive("b", priority=1).state is State.QUEUED


def test_a_full_band_shares_its_room_between_tenants() -> None:
    """A flooding tenant fills its band's queue; another tenant's arrival takes the flooder's
    newest place (longest queue drop), so both keep waiting requests and share the fleet."""
    f = Fleet(slots=1, queue_max_requests=4)
    f.arrive("flood")
    flood = [f.arrive("flood") for _ in range(4)]
    other = f.arrive("other")
    assert other.state is State.QUEUED
    assert flood[-1].state is State.REJECTED and flood[-1].rejection is not None
    assert flood[-1].rejection.reason is Reason.QUEUE_FULL
    assert "tenant 'flood' held the most of it" in flood[-1].rejection.message
    assert f.arrive("other").state is State.QUEUED  # flood 2, other 2 now
    assert f.arrive("other").state is State.REJECTED  # other would hold more than flood
    assert f.arrive("flood").state is State.REJECTED  # equal shares: refused outright


def test_retry_after_without_a_measured_rate_is_the_ttl_clamped() -> None:
    f = Fleet(slots=1, queue_max_requests=1, queue_ttl_s=200.0, retry_after_max_s=60.0)
    f.arrive("a")
    f.arrive("a")
    over = f.arrive("a")
    assert over.rejection is not None and over.rejection.retry_after_s == 60.0


def test_a_request_queued_past_its_ttl_is_refused_with_a_retry_after() -> None:
    f = Fleet(slots=1, queue_ttl_s=5.0)
    f.arrive("a")
    q = f.arrive("a")
    assert f.fc.next_expiry_s() == pytest.approx(105.0)
    f.clock.now += 4.9
    assert f.fc.expire() == []
    f.clock.now += 0.2
    assert f.fc.expire() == [q]
    assert q.state is State.REJECTED and q.rejection is not None
    assert q.rejection.reason is Reason.QUEUE_TTL and q.rejection.retry_after_s
    assert f.fc.next_expiry_s() is None and f.fc.queued() == 0


def test_a_deadline_before_the_ttl_refuses_without_a_retry_after() -> None:
    f = Fleet(slots=1, queue_ttl_s=30.0)
    f.arrive("a")
    q = f.arrive("a", deadline_s=102.0)
    f.clock.now = 102.0
    assert f.fc.expire() == [q]
    assert q.rejection is not None and q.rejection.reason is Reason.DEADLINE
    assert q.rejection.retry_after_s is None


def test_a_request_that_would_wait_past_its_ttl_is_refused_at_once() -> None:
    f = Fleet(slots=1, queue_ttl_s=2.0)
    f.arrive("a")
    for _ in range(6):  # 1 completion per second
        f.clock.now += 1.0
        f.finish()
        f.arrive("a")
    assert f.fc.drain_rate(M) == pytest.approx(1.0)
    assert f.arrive("a").state is State.QUEUED  # nobody ahead: 1 s at 1/s
    assert f.arrive("a").state is State.QUEUED  # 1 ahead: 2 s, within the TTL
    late = f.arrive("a")  # 2 ahead: 3 s > 2 s
    assert late.rejection is not None and late.rejection.reason is Reason.PREDICTED_WAIT
    assert late.rejection.retry_after_s == pytest.approx(3.0, rel=0.05)
    # The same refusal before any work on the prompt (it needs no cost).
    early = f.fc.precheck(M, "a", 0, f.free())
    assert early is not None and early.reason is Reason.PREDICTED_WAIT
    assert f.fc.precheck(M, "b", 3, f.free()) is None
    assert f.arrive("b", priority=3).state is State.QUEUED  # nobody ahead in its band


def test_the_predicted_wait_counts_the_tenants_turn_not_the_whole_band() -> None:
    """A heavy tenant's long queue predicts a long wait for its own next request, not for a
    light tenant's, which the fair order serves in turn: the light one is queued, not refused
    for the heavy one's backlog."""
    f = Fleet(slots=1, queue_ttl_s=3.5)
    f.arrive("heavy")
    for _ in range(6):  # 1 completion per second
        f.clock.now += 1.0
        f.finish()
        f.arrive("heavy")
    for _ in range(3):
        f.arrive("heavy")  # 3 of heavy's wait now (and one runs)
    late = f.arrive("heavy")  # 3 ahead: 4 s at 1/s > 3.5 s
    assert late.rejection is not None and late.rejection.reason is Reason.PREDICTED_WAIT
    light = f.arrive("light")  # 1 of heavy's goes before it (its counter is level): ~2 s
    assert light.state is State.QUEUED
    assert next(t for t in f.order() if t.tenant == "light") is light
    assert light.wait_s <= 3.0


def test_the_predicted_wait_counts_turns_by_cost() -> None:
    """A light tenant's second costly request waits for as many of the heavy tenant's cheap
    ones as the fair order grants first: its counter then is 300 ahead, so 4 of the heavy
    tenant's 100-token requests go before it."""
    f = Fleet(slots=1, queue_ttl_s=4.5)
    f.arrive("heavy")
    for _ in range(6):  # 1 completion per second
        f.clock.now += 1.0
        f.finish()
        f.arrive("heavy")
    for _ in range(5):
        f.arrive("heavy")  # 6 wait (each costs 100)
    assert f.arrive("light", uncached=300).state is State.QUEUED  # 1 heavy ahead: 2 s
    late = f.arrive("light", uncached=300)  # its own + 4 of heavy's: 6 s at 1/s
    assert late.rejection is not None and late.rejection.reason is Reason.PREDICTED_WAIT
    assert "5 request(s) wait ahead" in late.rejection.message


def test_the_precheck_refuses_a_full_band_before_any_work() -> None:
    f = Fleet(slots=1, queue_max_requests=2)
    assert f.fc.precheck(M, "a", 0, 0) is None
    f.arrive("a")
    f.arrive("a")
    assert f.fc.precheck(M, "a", 0, 0) is None
    f.arrive("a")
    r = f.fc.precheck(M, "a", 0, 0)
    assert r is not None and r.reason is Reason.QUEUE_FULL
    assert f.fc.precheck(M, "a", 1, 0) is None  # another band
    assert f.fc.precheck(M, "b", 0, 0) is None  # another tenant may take a's newest place


# ---- leaving ----------------------------------------------------------------------------------
def test_a_client_gone_while_queued_leaves_its_place() -> None:
    f = Fleet(slots=1)
    f.arrive("a")
    q1, q2 = f.arrive("a"), f.arrive("a")
    f.fc.leave(q1)
    assert q1.state is State.DONE and f.fc.queued() == 1
    f.finish()
    assert q2.state is State.RUNNING


def test_a_grant_that_never_started_gives_its_charge_back() -> None:
    f = Fleet(slots=1)
    x = f.arrive("a", uncached=7)
    after_x = f.fc.counter(M, 0, "a")
    q = f.arrive("a", uncached=50)
    f.running.remove(x)
    f.fc.leave(x, 0)
    assert f.fc.pump(M, 1) == [q]
    f.fc.leave(q)  # cancelled before its task ran
    assert f.fc.counter(M, 0, "a") in (None, after_x)


def test_reject_all_refuses_every_waiting_request() -> None:
    f = Fleet(slots=1)
    r = f.arrive("a")
    q = [f.arrive("a"), f.arrive("b", priority=2)]
    out = f.fc.reject_all(None, Reason.NO_WORKER, "no worker")
    assert set(out) == set(q)
    assert all(t.rejection is not None and t.rejection.reason is Reason.NO_WORKER for t in q)
    assert r.state is State.RUNNING and f.fc.queued() == 0


# ---- config -------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("kw", "words"),
    [
        ({"max_kv_usage": 0.0}, "--admission-max-kv-usage"),
        ({"queue_ttl_s": 0.0}, "--admission-queue-ttl-s"),
        ({"max_waiting": -1}, "--admission-max-waiting"),
        ({"retry_after_min_s": 5.0, "retry_after_max_s": 2.0}, "--admission-retry-after-max-s"),
        ({"reserve": 1.0}, "--admission-reserve"),
    ],
    ids=["kv", "ttl", "waiting", "retry", "reserve"],
)
def test_config_mistakes_name_the_flag(kw: dict[str, float], words: str) -> None:
    with pytest.raises(InvalidArgument, match=words):
        AdmissionConfig(**kw)  # type: ignore[arg-type]
