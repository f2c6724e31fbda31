"""How many more requests a model's workers can take (services/router/core/saturation.py),
from their engine queues, KV usage and this router's prefill backlog on them; and per-tenant
rate limits (core/ratelimit.py)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kvmesh.discovery.keys import Role, WorkerId, WorkerState
from services.router.core.admission import AdmissionConfig
from services.router.core.ratelimit import Limits, RateLimiter
from services.router.core.saturation import capacity

from .scheduler_fakes import view

CFG = AdmissionConfig(enabled=True, max_waiting=2, max_kv_usage=0.9)


@pytest.mark.parametrize(
    ("views", "free", "why"),
    [
        ([view("a"), view("b")], 4, ""),
        ([view("a", waiting=1), view("b", waiting=2)], 1, "waiting"),
        ([view("a", waiting=3), view("b", kv=0.95)], 0, "kv-usage"),
        ([view("a", role=Role.PREFILL), view("b", state=WorkerState.DRAINING)], 0, ""),
    ],
    ids=["idle", "queues", "saturated", "none-serving"],
)
def test_free_slots_from_the_workers_state(views, free: int, why: str) -> None:
    c = capacity(views, CFG)
    assert c.free_slots == free and c.saturated_by == why


def test_what_this_router_sent_beyond_a_workers_max_running_counts_as_waiting() -> None:
    v = view("a", router_in_flight=9)
    v.record = replace(v.record, max_running_requests=8)
    assert capacity([v], CFG).free_slots == 1  # 1 waits beyond 8 running: room for 1 more
    v.router_in_flight = 10
    assert capacity([v], CFG).free_slots == 0


def test_the_prefill_backlog_saturates_a_worker() -> None:
    cfg = AdmissionConfig(enabled=True, max_waiting=0, max_prefill_backlog_s=0.5)
    backlog = {WorkerId("a"): 0.7, WorkerId("b"): 0.1}
    c = capacity([view("a"), view("b")], cfg, backlog.__getitem__)
    assert c.workers == 2 and c.free_slots == 1 and c.saturated_by == "prefill-backlog"


def test_a_share_of_the_limits_for_bands_without_the_reserve() -> None:
    cfg = AdmissionConfig(enabled=True, max_waiting=4, max_kv_usage=0.8, reserve=0.5)
    views = [view("a", waiting=2), view("b", kv=0.5)]
    assert capacity(views, cfg).free_slots == 2 + 4
    # Half of each limit: a saturated at 2 waiting, b at 0.4 of its KV cache.
    low = capacity(views, cfg, share=0.5)
    assert low.free_slots == 0 and low.saturated_by == "kv-usage"


class Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


def test_requests_per_minute() -> None:
    clock = Clock()
    rl = RateLimiter(clock)
    lim = Limits(requests_per_minute=2)
    assert rl.check("t", lim) == 0.0
    assert rl.check("t", lim) == 0.0
    assert rl.check("t", lim) == pytest.approx(30.0)  # one request token every 30 s
    assert rl.check("other", lim) == 0.0  # per tenant
    clock.now = 15.0
    assert rl.check("t", lim) == pytest.approx(15.0)
    clock.now = 30.0
    assert rl.check("t", lim) == 0.0


def test_tokens_per_minute_charge_prompts_first_and_outputs_after() -> None:
    clock = Clock()
    rl = RateLimiter(clock)
    lim = Limits(tokens_per_minute=600)  # 10 tokens a second
    assert rl.check("t", lim, prompt_tokens=500) == 0.0
    rl.charge("t", lim, output_tokens=300)  # 100 -> -200: in debt
    assert rl.check("t", lim, prompt_tokens=100) == pytest.approx(30.0)  # 300 tokens at 10/s
    clock.now = 30.0
    assert rl.check("t", lim, prompt_tokens=100) == 0.0
    # A prompt over a minute's allowance waits for a full bucket, never forever.
    clock.now = 1000.0
    assert rl.check("t", lim, prompt_tokens=10_000) == 0.0


def test_a_refund_gives_back_what_a_check_took() -> None:
    rl = RateLimiter(Clock())
    lim = Limits(requests_per_minute=1, tokens_per_minute=100)
    assert rl.check("t", lim, 80) == 0.0
    rl.refund("t", lim, 80)  # refused by flow control after the check
    assert rl.check("t", lim, 100) == 0.0


def test_no_limits_no_state() -> None:
    rl = RateLimiter(Clock())
    for _ in range(1000):
        assert rl.check("t", Limits(), 10**6) == 0.0
