"""Each built-in scheduler plugin on its own: filters, scorers, pickers, the ledger; and the
property every scorer must keep (one score per candidate, each in [0, 1])."""

from __future__ import annotations

import logging
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvmesh.discovery.keys import Role, WorkerId, WorkerState
from kvmesh.errors import InvalidArgument
from services.router.core.scheduler import (
    InFlightLedger,
    Kind,
    Matched,
    PluginEnv,
    default_registry,
)
from services.router.core.scheduler.affinity import SessionAffinityScorer, SessionParams
from services.router.core.scheduler.cost import CostModelScorer, CostParams
from services.router.core.scheduler.filters import (
    ModelFilter,
    RoleFilter,
    RoleParams,
    ServingFilter,
)
from services.router.core.scheduler.load import (
    InFlightParams,
    InFlightScorer,
    InFlightTokensParams,
    InFlightTokensScorer,
    KvUsageScorer,
    QueueParams,
    QueueScorer,
)
from services.router.core.scheduler.params import NoParams
from services.router.core.scheduler.pickers import (
    MaxScoreParams,
    MaxScorePicker,
    RandomPicker,
    RoundRobinPicker,
    SeedParams,
)
from services.router.core.scheduler.prefix import (
    ApproxParams,
    ApproxPrefixScorer,
    PreciseParams,
    PrecisePrefixScorer,
    TierWeights,
)
from services.router.core.types import RouteDecision
from tests.unit.scheduler_fakes import BLOCK, FakeIndex, chain, ctx_for, gpu, request, view, views


def ids(cands) -> list[str]:
    return [v.record.worker_id for v in cands]


# ---- filters ----------------------------------------------------------------------------------
class TestFilters:
    def test_serving_and_model(self):
        cands = [
            view("a"),
            view("b", state=WorkerState.DRAINING),
            view("c", model="other"),
        ]
        ctx = ctx_for(request(1), cands)
        assert ids(ServingFilter("serving", NoParams()).filter(ctx, cands)) == ["a", "c"]
        assert ids(ModelFilter("model", NoParams()).filter(ctx, cands)) == ["a", "b"]

    @pytest.mark.parametrize(
        ("req_role", "accept", "want"),
        [
            pytest.param(Role.BOTH, (), ["both"], id="plain-request"),
            pytest.param(Role.PREFILL, (), ["both", "prefill"], id="prefill-stage"),
            pytest.param(Role.DECODE, (), ["both", "decode"], id="decode-stage"),
            pytest.param(
                Role.BOTH, (Role.PREFILL, Role.DECODE), ["prefill", "decode"], id="accept"
            ),
        ],
    )
    def test_role(self, req_role, accept, want):
        cands = [view("both"), view("prefill", role=Role.PREFILL), view("decode", role=Role.DECODE)]
        f = RoleFilter("role", RoleParams(accept))
        assert ids(f.filter(ctx_for(request(1, role=req_role), cands), cands)) == want


# ---- precise prefix ----------------------------------------------------------------------------
class TestPrecisePrefix:
    @pytest.mark.parametrize(
        ("match", "params", "want"),
        [
            pytest.param(gpu(50), PreciseParams(), 0.5, id="gpu-half"),
            pytest.param(gpu(100), PreciseParams(), 1.0, id="gpu-all"),
            pytest.param(Matched(100, cpu_blocks=100, exact=True), PreciseParams(), 0.8, id="cpu"),
            pytest.param(
                Matched(100, disk_blocks=100, exact=True), PreciseParams(), 0.5, id="disk"
            ),
            pytest.param(
                Matched(100, gpu_blocks=50, cpu_blocks=30, disk_blocks=20, exact=True),
                PreciseParams(),
                0.5 + 0.24 + 0.1,
                id="mixed",
            ),
            pytest.param(gpu(100, exact=False), PreciseParams(), 0.5, id="degraded"),
            pytest.param(
                gpu(100, exact=False), PreciseParams(degraded_factor=1.0), 1.0, id="trust-degraded"
            ),
            pytest.param(
                Matched(40, cpu_blocks=40, exact=True),
                PreciseParams(TierWeights(cpu=0.25)),
                0.1,
                id="custom-tiers",
            ),
            pytest.param(Matched(0, exact=True), PreciseParams(), 0.0, id="none"),
            pytest.param(
                gpu(100), PreciseParams(full_score_blocks=400), 0.25, id="full-score-above-prompt"
            ),
            pytest.param(
                gpu(50), PreciseParams(full_score_blocks=40), 0.5, id="full-score-below-prompt"
            ),
        ],
    )
    def test_score(self, match, params, want):
        idx = FakeIndex({"a": match})
        s = PrecisePrefixScorer("p", params, idx)
        cands = [view("a"), view("b")]
        ctx = ctx_for(request(100), cands, source=s)
        assert s.score(ctx, cands) == pytest.approx([want, 0.0])

    def test_one_index_call_per_cycle_restricted_to_candidates(self):
        idx = FakeIndex({"a": gpu(3), "z": gpu(9)})
        s = PrecisePrefixScorer("p", PreciseParams(), idx)
        cands = [view("a"), view("b")]
        ctx = ctx_for(request(10), cands, source=s)
        s.score(ctx, cands)
        assert dict(ctx.prefix()) == {"a": gpu(3)}
        assert idx.calls == 1

    def test_no_hashes_no_lookup(self):
        idx = FakeIndex({"a": gpu(3)})
        s = PrecisePrefixScorer("p", PreciseParams(), idx)
        cands = [view("a")]
        assert s.score(ctx_for(request(0), cands, source=s), cands) == [0.0]
        assert idx.calls == 0

    def test_index_failure_degrades_to_recompute(self, caplog):
        idx = FakeIndex({"a": gpu(3)})
        idx.fail = True
        s = PrecisePrefixScorer("p", PreciseParams(), idx)
        cands = [view("a")]
        with caplog.at_level(logging.WARNING):
            assert s.score(ctx_for(request(5), cands, source=s), cands) == [0.0]
        assert "KV index match failed" in caplog.text

    def test_needs_an_index(self):
        with pytest.raises(InvalidArgument, match="needs the KV block index"):
            PrecisePrefixScorer.build("p", PreciseParams(), PluginEnv())


# ---- approximate prefix -------------------------------------------------------------------------
def _routed(s: ApproxPrefixScorer, hashes: tuple, wid: str) -> None:
    s.on_routed(request(hashes=hashes), RouteDecision(WorkerId(wid), "t", "x"))


class TestApproxPrefix:
    @pytest.mark.parametrize(
        ("stride", "sent", "probe", "want"),
        [
            pytest.param(1, 10, chain(10), 10, id="all"),
            pytest.param(1, 10, chain(20), 10, id="longer-probe"),
            pytest.param(1, 10, chain(6), 6, id="shorter-probe"),
            pytest.param(1, 10, chain(10, diverge_at=4), 4, id="diverges"),
            pytest.param(4, 10, chain(10), 8, id="stride-rounds-down"),
            pytest.param(4, 10, chain(10, diverge_at=6), 4, id="stride-diverges"),
            pytest.param(4, 3, chain(3), 0, id="shorter-than-stride"),
            pytest.param(1, 10, chain(10, family=1), 0, id="other-conversation"),
        ],
    )
    def test_contiguous_prefix(self, stride, sent, probe, want):
        s = ApproxPrefixScorer("a", ApproxParams(stride_blocks=stride))
        _routed(s, chain(sent), "w")
        got = s.match(probe, [WorkerId("w")])
        assert (got[WorkerId("w")].blocks if got else 0) == want

    def test_several_workers_one_walk(self):
        s = ApproxPrefixScorer("a", ApproxParams(stride_blocks=1))
        _routed(s, chain(30), "x")
        _routed(s, chain(30, diverge_at=10), "y")
        _routed(s, chain(30, diverge_at=20), "z")
        got = s.match(chain(30), [WorkerId(w) for w in ("x", "y", "z", "unknown")])
        assert {w: m.blocks for w, m in got.items()} == {"x": 30, "y": 10, "z": 20}
        assert list(s.match(chain(30), [WorkerId("y")])) == ["y"]  # only the asked workers

    def test_lru_per_worker(self):
        s = ApproxPrefixScorer("a", ApproxParams(stride_blocks=1, blocks_per_worker=10))
        _routed(s, chain(8, family=1), "w")
        _routed(s, chain(8, family=2), "w")  # pushes out the oldest 6 blocks of family 1
        _routed(s, chain(8, family=1), "v")
        w, v = WorkerId("w"), WorkerId("v")
        assert s.match(chain(8, family=1), [w, v]) == {v: Matched(8, gpu_blocks=8)}
        assert s.match(chain(8, family=2), [w])[w].blocks == 8
        _routed(s, chain(8, family=2), "v")  # v: 16 > 10, drops 6 of family 1
        assert s.match(chain(8, family=1), [v]) == {}
        assert len(s) <= 20

    def test_scores_are_fractions(self):
        s = ApproxPrefixScorer("a", ApproxParams(stride_blocks=1))
        _routed(s, chain(5), "a")
        cands = [view("a"), view("b")]
        assert s.score(ctx_for(request(10), cands, source=s), cands) == [0.5, 0.0]


# ---- load ---------------------------------------------------------------------------------------
class TestLoad:
    @pytest.mark.parametrize(
        ("scorer", "loaded", "want"),
        [
            pytest.param(
                QueueScorer("q", QueueParams(half=4)), view("x", waiting=4), 0.5, id="queue-half"
            ),
            pytest.param(
                QueueScorer("q", QueueParams(half=4)), view("x", waiting=12), 0.25, id="queue-3x"
            ),
            pytest.param(
                InFlightScorer("f", InFlightParams(half=2)),
                view("x", in_flight=2),
                0.5,
                id="reported",
            ),
            pytest.param(
                InFlightScorer("f", InFlightParams(half=2)),
                view("x", router_in_flight=6),
                0.25,
                id="router-count",
            ),
            pytest.param(KvUsageScorer("k", NoParams()), view("x", kv=0.7), 0.3, id="kv"),
            pytest.param(KvUsageScorer("k", NoParams()), view("x", kv=1.7), 0.0, id="kv-over"),
        ],
    )
    def test_values(self, scorer, loaded, want):
        cands = [view("idle"), loaded]
        assert scorer.score(ctx_for(request(1), cands), cands) == pytest.approx([1.0, want])

    def test_in_flight_tokens_from_ledger(self):
        ledger = InFlightLedger()
        ledger.routed("r1", WorkerId("a"), prompt_tokens=1000, uncached_tokens=600)
        cands = [view("a"), view("b")]
        ctx = ctx_for(request(1), cands, ledger=ledger)
        all_tokens = InFlightTokensScorer("t", InFlightTokensParams(half=1000))
        prefill = InFlightTokensScorer("t", InFlightTokensParams(half=600, prefill_only=True))
        assert all_tokens.score(ctx, cands) == pytest.approx([0.5, 1.0])
        assert prefill.score(ctx, cands) == pytest.approx([0.5, 1.0])
        ledger.first_token("r1")
        assert prefill.score(ctx, cands) == pytest.approx([1.0, 1.0])

    @pytest.mark.parametrize("half", [0, -1.0])
    def test_half_must_be_positive(self, half):
        with pytest.raises(InvalidArgument, match="use a positive load"):
            QueueParams(half=half)


# ---- cost model ---------------------------------------------------------------------------------
class TestCostModel:
    P = CostParams(
        prefill_s_per_token=0.001,
        queued_request_s=1.0,
        running_request_s=0.1,
        cpu_s_per_token=0.0001,
        disk_s_per_token=0.0005,
        floor_s=0.5,
    )

    def test_estimate(self):
        idx = FakeIndex(
            {
                "hit": gpu(6),
                "tiered": Matched(8, gpu_blocks=4, cpu_blocks=2, disk_blocks=2, exact=True),
                "busy": gpu(8),
            }
        )
        source = PrecisePrefixScorer("p", PreciseParams(), idx)
        cands = [view("cold"), view("hit"), view("tiered", running=3), view("busy", waiting=2)]
        ledger = InFlightLedger()
        ledger.routed("o", WorkerId("busy"), 5000, 5000)  # 5 s of prefill queued: beats 2 waiting
        ctx = ctx_for(request(8, prompt_tokens=8 * BLOCK + 4), cands, source, ledger)
        cost = CostModelScorer("c", self.P)
        got = cost.estimate(ctx, cands)
        tokens = 8 * BLOCK + 4  # 132
        assert got == pytest.approx(
            [
                tokens * 0.001,  # cold: recompute everything
                (tokens - 6 * BLOCK) * 0.001,  # hit: the tail only
                0.3 + 4 * 0.001 + 2 * BLOCK * 0.0001 + 2 * BLOCK * 0.0005,  # running + tiers
                5.0 + 4 * 0.001,  # busy: the ledger's queue
            ]
        )
        scores = cost.score(ctx, cands)
        best = min(got) + 0.5
        assert scores == pytest.approx([best / (c + 0.5) for c in got])
        assert max(scores) == 1.0

    def test_block_size_falls_back_to_prompt_over_blocks(self):
        idx = FakeIndex({"a": gpu(5)})
        source = PrecisePrefixScorer("p", PreciseParams(), idx)
        cands = [view("a", block_size=0)]
        ctx = ctx_for(request(10, prompt_tokens=100), cands, source)
        assert CostModelScorer("c", self.P).estimate(ctx, cands) == pytest.approx([0.05])

    @pytest.mark.parametrize(
        ("kw", "match"),
        [
            pytest.param({"prefill_s_per_token": -1.0}, "prefill_s_per_token is -1.0", id="neg"),
            pytest.param({"floor_s": 0.0}, "floor_s is 0.0; use seconds > 0", id="floor"),
        ],
    )
    def test_params(self, kw, match):
        with pytest.raises(InvalidArgument, match=match):
            CostParams(**kw)


# ---- session affinity ---------------------------------------------------------------------------
class TestSessionAffinity:
    @pytest.mark.parametrize(
        ("params", "home", "saturated"),
        [
            pytest.param(
                SessionParams(max_waiting=3), view("h", waiting=2), False, id="below-waiting"
            ),
            pytest.param(SessionParams(max_waiting=3), view("h", waiting=3), True, id="at-waiting"),
            pytest.param(
                SessionParams(max_waiting=0), view("h", waiting=99), False, id="waiting-off"
            ),
            pytest.param(
                SessionParams(max_in_flight=4), view("h", in_flight=4), True, id="in-flight"
            ),
            pytest.param(
                SessionParams(max_in_flight=4),
                view("h", router_in_flight=4),
                True,
                id="router-in-flight",
            ),
            pytest.param(SessionParams(max_kv_usage=0.9), view("h", kv=0.95), True, id="kv"),
            pytest.param(SessionParams(max_kv_usage=1.0), view("h", kv=1.0), False, id="kv-off"),
        ],
    )
    def test_saturation(self, params, home, saturated):
        s = SessionAffinityScorer("s", params)
        req = request(1, session="x")
        s.on_routed(req, RouteDecision(WorkerId("h"), "t", "x"))
        cands = [view("other"), home]
        assert s.score(ctx_for(req, cands), cands) == [0.0, 0.0 if saturated else 1.0]

    def test_bounded_lru(self):
        s = SessionAffinityScorer("s", SessionParams(max_sessions=2))
        for sid, w in (("a", "w1"), ("b", "w2"), ("a", "w3"), ("c", "w4")):
            s.on_routed(request(1, session=sid), RouteDecision(WorkerId(w), "t", "x"))
        assert len(s) == 2
        assert s.worker_of("a") == "w3" and s.worker_of("b") is None and s.worker_of("c") == "w4"


# ---- pickers ------------------------------------------------------------------------------------
class TestPickers:
    def test_max_score_runner_up_is_outside_the_tie(self):
        p = MaxScorePicker("m", MaxScoreParams(seed=0), random.Random())
        cands = views(4)
        ctx = ctx_for(request(1), cands)
        seen = set()
        for _ in range(50):
            c = p.pick(ctx, cands, [0.9, 0.2, 0.9, 0.5])
            seen.add(c.index)
            assert (c.runner_up, c.tied) == (3, 2)
        assert seen == {0, 2}

    def test_max_score_all_tied_and_single(self):
        p = MaxScorePicker("m", MaxScoreParams(seed=0), random.Random())
        cands = views(3)
        ctx = ctx_for(request(1), cands)
        assert p.pick(ctx, cands, [0.1, 0.1, 0.1]).runner_up == -1
        assert p.pick(ctx, cands[:1], [0.1]).index == 0

    def test_seeded_pickers_repeat(self):
        cands = views(8)
        ctx = ctx_for(request(1), cands)
        for make in (
            lambda: RandomPicker("r", SeedParams(seed=7), random.Random()),
            lambda: MaxScorePicker("m", MaxScoreParams(seed=7), random.Random()),
        ):
            a, b = make(), make()
            assert [a.pick(ctx, cands, [0.0] * 8).index for _ in range(20)] == [
                b.pick(ctx, cands, [0.0] * 8).index for _ in range(20)
            ]

    def test_round_robin(self):
        p = RoundRobinPicker("rr", NoParams())
        cands = views(3)
        ctx = ctx_for(request(1), cands)
        assert [p.pick(ctx, cands, [0.0] * 3).index for _ in range(4)] == [0, 1, 2, 0]


# ---- ledger -------------------------------------------------------------------------------------
class TestLedger:
    def test_never_negative(self):
        led = InFlightLedger()
        a = WorkerId("a")
        led.finished("nope", None)
        led.first_token("nope")
        led.routed("r", a, 100, 150)  # uncached is capped at the prompt
        led.first_token("r")
        led.first_token("r")
        assert (led.tally(a).prompt_tokens, led.tally(a).prefill_tokens) == (100, 0)
        led.finished("r", a)
        led.finished("r", a)
        assert led.tally(a).requests == 0 and len(led) == 0


# ---- properties ---------------------------------------------------------------------------------
loads = st.fixed_dictionaries(
    {
        "waiting": st.integers(0, 10_000),
        "running": st.integers(0, 10_000),
        "in_flight": st.integers(0, 10_000),
        "router_in_flight": st.integers(0, 10_000),
        "kv": st.floats(-1.0, 2.0),
    }
)


@st.composite
def scenes(draw):
    n = draw(st.integers(1, 8))
    blocks = draw(st.integers(0, 300))
    cands = [view(f"w{i}", **draw(loads)) for i in range(n)]
    matches = {}
    for i in range(n):
        if draw(st.booleans()):
            b = draw(st.integers(0, blocks))
            g = draw(st.integers(0, b))
            c = draw(st.integers(0, b - g))
            matches[f"w{i}"] = Matched(
                b, gpu_blocks=g, cpu_blocks=c, disk_blocks=b - g - c, exact=draw(st.booleans())
            )
    prompt = draw(st.integers(blocks * BLOCK, blocks * BLOCK + BLOCK - 1)) if blocks else 0
    inflight = draw(st.lists(st.tuples(st.integers(0, n - 1), st.integers(0, 10**6)), max_size=5))
    return cands, matches, request(blocks, prompt_tokens=prompt, session="s"), inflight


SCORERS = {
    "precise-prefix": {"tier_weights": {"gpu": 1.0, "cpu": 0.7, "disk": 0.2}},
    "approximate-prefix": {"stride_blocks": 2},
    "cost-model": {},
    "session-affinity": {"max_waiting": 5},
    "queue": {},
    "in-flight": {},
    "in-flight-tokens": {"prefill_only": True},
    "kv-usage": {},
    "routed-volume": {"half_life_requests": 3, "count": "uncached"},
    "active-context": {"idle_requests": 2},
    "ttft-cost": {"min_sample_tokens": 1},
}


def test_every_builtin_scorer_is_covered():

    assert set(SCORERS) == set(default_registry().names(Kind.SCORER))


@pytest.mark.parametrize("name", sorted(SCORERS))
@settings(max_examples=80, deadline=None)
@given(scene=scenes())
def test_scores_are_in_unit_interval(name, scene):
    cands, matches, req, inflight = scene
    reg = default_registry()

    env = PluginEnv(FakeIndex(matches), random.Random(0))
    scorer = reg.create(name, Kind.SCORER, name, SCORERS[name], env, "test")
    source = reg.create("precise-prefix", Kind.SCORER, "p", None, env, "test")
    ledger = InFlightLedger()
    for i, (w, tokens) in enumerate(inflight):
        ledger.routed(f"r{i}", cands[w].record.worker_id, tokens, tokens // 2)
    if hasattr(scorer, "on_routed"):  # give the learning scorers something to know
        scorer.on_routed(req, RouteDecision(cands[0].record.worker_id, "t", "x"))
    out = scorer.score(ctx_for(req, cands, source, ledger), cands)
    assert len(out) == len(cands)
    assert all(0.0 <= x <= 1.0 for x in out), out


class TestRoutedVolume:
    def _scorer(self, **params):
        from services.router.core.scheduler.load import RoutedVolumeParams, RoutedVolumeScorer

        return RoutedVolumeScorer("routed-volume", RoutedVolumeParams(**params))

    def test_new_work_goes_where_recent_volume_is_lowest(self):
        scorer = self._scorer(half_life_requests=1000)
        fleet = views(3)
        ctx = ctx_for(request(8), fleet)
        assert list(scorer.score(ctx, fleet)) == [1.0, 1.0, 1.0]  # nothing routed yet
        big = request(8, prompt_tokens=90_000)
        small = request(8, prompt_tokens=10_000)
        scorer.on_routed(big, RouteDecision(fleet[0].record.worker_id, "t", "x"))
        scorer.on_routed(small, RouteDecision(fleet[1].record.worker_id, "t", "x"))
        s = list(scorer.score(ctx, fleet))
        assert s[2] == 1.0 > s[1] > s[0]  # idle > light > heavy
        assert all(0.0 <= x <= 1.0 for x in s)

    def test_volume_decays_per_decision(self):
        scorer = self._scorer(half_life_requests=1)
        fleet = views(2)
        ctx = ctx_for(request(8), fleet)
        scorer.on_routed(
            request(8, prompt_tokens=1000), RouteDecision(fleet[0].record.worker_id, "t", "x")
        )
        before = list(scorer.score(ctx, fleet))
        for _ in range(10):  # ten decisions for the other worker: the first one's volume fades
            scorer.on_routed(
                request(8, prompt_tokens=1000), RouteDecision(fleet[1].record.worker_id, "t", "x")
            )
        after = list(scorer.score(ctx, fleet))
        assert before[0] < before[1] and after[0] > after[1]

    @pytest.mark.parametrize(
        ("yield_to_prefix", "held_blocks", "flat"),
        [
            pytest.param(1.0, 100, True, id="full-yield-warm: prefix decides alone"),
            pytest.param(1.0, 0, False, id="full-yield-cold: volume decides"),
            pytest.param(0.0, 100, False, id="no-yield-warm: volume still counts"),
        ],
    )
    def test_yield_to_prefix(self, yield_to_prefix, held_blocks, flat):
        scorer = self._scorer(half_life_requests=1000, yield_to_prefix=yield_to_prefix)
        fleet = [view("a"), view("b")]
        scorer.on_routed(request(8, prompt_tokens=5000), RouteDecision(WorkerId("a"), "t", "x"))
        source = PrecisePrefixScorer("p", PreciseParams(), FakeIndex({"a": gpu(held_blocks)}))
        s = list(scorer.score(ctx_for(request(100), fleet, source=source), fleet))
        assert (s[0] == pytest.approx(s[1])) is flat
        assert all(0.0 <= x <= 1.0 for x in s)

    def test_bad_params(self):
        with pytest.raises(InvalidArgument, match="count is 'all'"):
            self._scorer(count="all")
        with pytest.raises(InvalidArgument, match="yield_to_prefix"):
            self._scorer(yield_to_prefix=1.5)


class TestActiveContext:
    def _scorer(self, idle_requests=100):
        from services.router.core.scheduler.active_context import (
            ActiveContextParams,
            ActiveContextScorer,
        )

        return ActiveContextScorer("ac", ActiveContextParams(idle_requests=idle_requests))

    @staticmethod
    def _turn(scorer, session, tokens, wid):
        scorer.on_routed(
            request(8, prompt_tokens=tokens, session=session),
            RouteDecision(WorkerId(wid), "t", "x"),
        )

    def test_footprint_is_the_live_sessions_latest_contexts(self):
        s = self._scorer()
        self._turn(s, "a", 10_000, "w0")
        self._turn(s, "a", 12_000, "w0")  # a turn replaces its session's last context
        self._turn(s, "b", 5_000, "w1")
        self._turn(s, "", 99_000, "w1")  # no session: leaves no footprint
        assert (s.footprint("w0"), s.footprint("w1")) == (12_000, 5_000)
        self._turn(s, "b", 6_000, "w0")  # b moved: it leaves w1
        assert (s.footprint("w0"), s.footprint("w1")) == (18_000, 0)

    def test_idle_sessions_expire(self):
        s = self._scorer(idle_requests=3)
        self._turn(s, "a", 10_000, "w0")
        for i in range(3):
            self._turn(s, "b", 1_000 + i, "w1")
        assert s.footprint("w0") == 0 and s.footprint("w1") == 1_002

    def test_own_session_left_out_and_light_workers_win(self):
        s = self._scorer()
        fleet = views(3)
        w0, w1, _w2 = (v.record.worker_id for v in fleet)
        self._turn(s, "a", 100_000, w0)  # the session being scored lives on w0
        self._turn(s, "b", 50_000, w0)
        self._turn(s, "c", 50_000, w1)
        ctx = ctx_for(request(8, prompt_tokens=101_000, session="a"), fleet)
        got = list(s.score(ctx, fleet))
        # Without its own context w0 carries what w1 does; w2 carries nothing.
        assert got[0] == pytest.approx(got[1]) and got[2] == 1.0 > got[0]
        cold = ctx_for(request(8, prompt_tokens=1_000, session="new"), fleet)
        got = list(s.score(cold, fleet))
        assert got[2] == 1.0 > got[1] > got[0]

    def test_idle_fleet_scores_flat(self):
        s = self._scorer()
        fleet = views(2)
        assert list(s.score(ctx_for(request(8, session="x"), fleet), fleet)) == [1.0, 1.0]

    def test_bad_params(self):
        with pytest.raises(InvalidArgument, match="idle_requests"):
            self._scorer(idle_requests=0)

    @pytest.mark.parametrize(
        ("fork_share", "held_blocks", "flat"),
        [
            pytest.param(0.7, 90, True, id="fork: continues a held context, follows the prefix"),
            pytest.param(0.7, 50, False, id="not-a-fork: mostly new context, balanced"),
            pytest.param(0.0, 90, False, id="forks-off: balanced"),
        ],
    )
    def test_forks_follow_prefix_affinity_for_life(self, fork_share, held_blocks, flat):
        from services.router.core.scheduler.active_context import (
            ActiveContextParams,
            ActiveContextScorer,
        )

        s = ActiveContextScorer("ac", ActiveContextParams(fork_share=fork_share))
        fleet = views(2)
        w0 = fleet[0].record.worker_id
        self._turn(s, "main", 100_000, w0)  # w0 carries a big session, w1 nothing
        source = PrecisePrefixScorer("p", PreciseParams(), FakeIndex({w0: gpu(held_blocks)}))
        first = request(100, rid="f1", prompt_tokens=3_200, session="sub")
        got = list(s.score(ctx_for(first, fleet, source=source), fleet))
        assert (got[0] == got[1]) is flat
        s.on_routed(first, RouteDecision(w0, "t", "x"))
        # Its later turns: still a fork (flat) or still balanced, whatever they match now.
        later = request(100, rid="f2", prompt_tokens=3_500, session="sub")
        got = list(s.score(ctx_for(later, fleet, source=source), fleet))
        assert (got[0] == got[1]) is flat
        assert s.footprint(w0) == 103_200  # its first turn counts either way
