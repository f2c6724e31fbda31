"""The scheduler framework: registry, parameters, YAML profiles, the weighted sum, decision
explanations, feedback, and the behaviours the baseline profiles promise."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvmesh.discovery.keys import Role, WorkerId
from kvmesh.errors import InvalidArgument, Unavailable
from kvmesh.kv.events import BlockStored, KvEventBatch, Tier
from services.router.core.routing import POLICIES, make_policy
from services.router.core.scheduler import (
    BUILTIN_PROFILES,
    Kind,
    Matched,
    PluginEnv,
    PluginType,
    Registry,
    Scheduler,
    Weighted,
    build_scheduler,
    builtin_profile,
    default_registry,
    load_profile,
    parse_params,
    parse_yaml,
)
from services.router.core.scheduler.affinity import SessionParams
from services.router.core.scheduler.cost import CostParams
from services.router.core.scheduler.filters import RoleParams, ServingFilter
from services.router.core.scheduler.params import NoParams
from services.router.core.scheduler.pickers import MaxScoreParams, MaxScorePicker
from services.router.core.scheduler.prefix import PreciseParams, TierWeights
from services.router.core.types import RouteDecision
from tests.unit.scheduler_fakes import (
    BLOCK,
    FakeIndex,
    FixedParams,
    FixedScorer,
    chain,
    fixed_registry,
    gpu,
    request,
    view,
    views,
)

REPO = Path(__file__).resolve().parents[2]
PROFILES = REPO / "services" / "router" / "core" / "scheduler" / "profiles"


def fixed_profile(*columns: tuple[float, tuple[float, ...]], picker: str = "max-score") -> str:
    scorers = "\n".join(
        f"  - {{type: fixed, name: s{i}, weight: {w}, params: {{scores: {list(s)}}}}}"
        for i, (w, s) in enumerate(columns)
    )
    params = "{}" if picker == "round-robin" else "{seed: 1}"
    return f"name: t\nscorers:\n{scorers or '  []'}\npicker: {{type: {picker}, params: {params}}}\n"


def sched(text: str, index: FakeIndex | None = None, seed: int = 0) -> Scheduler:
    return load_profile(text, registry=fixed_registry(), env=PluginEnv(index, random.Random(seed)))


# ---- registry ---------------------------------------------------------------------------------
class TestRegistry:
    def test_builtins(self):
        reg = default_registry()
        assert reg.names(Kind.FILTER) == ["model", "reserve", "role", "serving", "volume-bound"]
        assert reg.names(Kind.PICKER) == ["max-score", "random", "round-robin"]
        assert reg.names(Kind.SCORER) == [
            "active-context",
            "approximate-prefix",
            "cost-model",
            "in-flight",
            "in-flight-tokens",
            "kv-usage",
            "precise-prefix",
            "queue",
            "routed-volume",
            "session-affinity",
            "ttft-cost",
        ]

    @pytest.mark.parametrize("kind", list(Kind), ids=str)
    def test_duplicate_names_rejected_across_kinds(self, kind):
        reg = default_registry()
        with pytest.raises(InvalidArgument, match="'serving' is already registered"):
            reg.register(PluginType("serving", kind, NoParams, lambda n, p, e: ServingFilter(n, p)))

    @pytest.mark.parametrize(
        ("name", "kind", "match"),
        [
            pytest.param(
                "queu", Kind.SCORER, "unknown scorer type 'queu' .did you mean 'queue'", id="typo"
            ),
            pytest.param(
                "fastest",
                Kind.PICKER,
                "known pickers: max-score, random, round-robin",
                id="unknown",
            ),
            pytest.param(
                "max-score", Kind.FILTER, "'max-score' is a picker, not a filter", id="wrong-kind"
            ),
        ],
    )
    def test_get_errors(self, name, kind, match):
        with pytest.raises(InvalidArgument, match=match):
            default_registry().get(name, kind, "here")


# ---- parameters -------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class _Nested:
    tiers: TierWeights = field(default_factory=TierWeights)
    roles: tuple[Role, ...] = ()
    limit: int | None = None


class TestParams:
    @pytest.mark.parametrize(
        ("cls", "raw", "match"),
        [
            pytest.param(
                SessionParams,
                {"max_wait": 3},
                r"unknown key 'max_wait' \(did you mean 'max_waiting'\?\); known keys: max_in_flight, max_kv_usage, max_sessions, max_waiting",
                id="unknown-key",
            ),
            pytest.param(
                SessionParams,
                {"max_waiting": "4"},
                r"x\.max_waiting: expected an integer, got str '4'",
                id="str-for-int",
            ),
            pytest.param(
                SessionParams,
                {"max_waiting": True},
                "expected an integer, got bool",
                id="bool-for-int",
            ),
            pytest.param(
                SessionParams,
                {"max_kv_usage": 1.5},
                r"^x: max_kv_usage is 1.5; use a fraction in \(0, 1\]",
                id="range",
            ),
            pytest.param(
                CostParams,
                {"floor_s": "fast"},
                "floor_s: expected a number, got str 'fast'",
                id="bad-float",
            ),
            pytest.param(
                CostParams, {"floor_s": float("nan")}, "expected a finite number", id="nan"
            ),
            pytest.param(
                PreciseParams,
                {"tier_weights": {"gpu": 1, "ssd": 0.1}},
                r"x\.tier_weights: unknown key 'ssd'",
                id="nested-unknown",
            ),
            pytest.param(
                PreciseParams,
                {"tier_weights": {"cpu": 2}},
                r"tier_weights.cpu is 2.0; use a weight in \[0, 1\]",
                id="nested-range",
            ),
            pytest.param(
                PreciseParams,
                {"tier_weights": [1, 2]},
                "expected a mapping",
                id="nested-not-mapping",
            ),
            pytest.param(
                RoleParams,
                {"accept": ["gpu"]},
                r"accept\[0\]: 'gpu' is not one of both, prefill, decode",
                id="enum",
            ),
            pytest.param(RoleParams, {"accept": "both"}, "expected a list", id="not-a-list"),
            pytest.param(
                SessionParams,
                [1, 2],
                "expected a mapping of keys to values, got a list",
                id="not-mapping",
            ),
        ],
    )
    def test_errors_say_what_to_fix(self, cls, raw, match):
        with pytest.raises(InvalidArgument, match=match):
            parse_params(cls, raw, "x")

    def test_conversions(self):
        assert parse_params(SessionParams, None, "x") == SessionParams()
        assert (
            parse_params(CostParams, {"prefill_s_per_token": "1e-5"}, "x").prefill_s_per_token
            == 1e-5
        )
        assert parse_params(CostParams, {"floor_s": 1}, "x").floor_s == 1.0
        got = parse_params(_Nested, {"tiers": {"disk": 0}, "roles": ["decode"], "limit": None}, "x")
        assert got == _Nested(TierWeights(disk=0.0), (Role.DECODE,), None)
        assert parse_params(_Nested, {"limit": 3}, "x").limit == 3


# ---- profiles ---------------------------------------------------------------------------------
class TestProfiles:
    @pytest.mark.parametrize("name", sorted(BUILTIN_PROFILES))
    def test_builtins_build(self, name):
        s = build_scheduler(builtin_profile(name), env=PluginEnv(FakeIndex()))
        assert s.name == name
        d = s.pick(request(8), views(3))
        assert d.policy == name

    @pytest.mark.parametrize("name", sorted(BUILTIN_PROFILES))
    def test_each_builtin_file_names_its_profile(self, name):
        path = PROFILES / f"{name}.yaml"
        assert parse_yaml(path.read_text()) == builtin_profile(name)
        assert builtin_profile(name).name == name

    def test_every_file_in_profiles_is_a_builtin(self):
        files = {p.stem for p in PROFILES.glob("*.yaml")}
        assert files == set(BUILTIN_PROFILES) >= {"precise-sticky", "round-robin"}

    def test_defaults(self):
        spec = parse_yaml("name: bare")
        assert [f.type for f in spec.filters] == ["serving", "model", "role"]
        assert spec.scorers == ()
        assert spec.picker.type == "max-score"
        assert parse_yaml("name: x\nfilters: []").filters == ()

    def test_entry_forms(self):
        spec = parse_yaml(
            "name: x\nscorers:\n  - queue\n  - {type: queue, name: q2, weight: 2, params: {half: 1}}\n"
        )
        assert [(s.type, s.name, s.weight, dict(s.params)) for s in spec.scorers] == [
            ("queue", "queue", 1.0, {}),
            ("queue", "q2", 2.0, {"half": 1}),
        ]

    @pytest.mark.parametrize(
        ("text", "match"),
        [
            pytest.param("- a\n- b", "expected a mapping with keys", id="not-mapping"),
            pytest.param("scorers: []", "'name' is required", id="no-name"),
            pytest.param(
                "name: x\nscorer: []",
                r"unknown key 'scorer' \(did you mean 'scorers'\?\)",
                id="top-key",
            ),
            pytest.param(
                "name: x\nfilters: serving", "'filters' must be a list", id="filters-not-list"
            ),
            pytest.param(
                "name: x\nfilters: [{type: serving, weight: 1}]",
                "only scorers have a weight",
                id="filter-weight",
            ),
            pytest.param(
                "name: x\nscorers: [{type: queue, half: 2}]",
                "plugin parameters go under 'params'",
                id="params-inline",
            ),
            pytest.param(
                "name: x\nscorers: [{weight: 2}]", r"scorers\[0\]: 'type' is required", id="no-type"
            ),
            pytest.param(
                "name: x\nscorers: [{type: queue, weight: -1}]",
                "'weight' is -1.0; use a number >= 0",
                id="neg-weight",
            ),
            pytest.param(
                "name: x\nscorers: [{type: queue, weight: .inf}]",
                "weight: expected a finite number",
                id="inf-weight",
            ),
            pytest.param(
                "name: x\nscorers: [{type: queue, weight: heavy}]",
                "weight: expected a number, got str 'heavy'",
                id="str-weight",
            ),
            pytest.param(
                "name: x\nscorers: [{type: queue, params: [1]}]",
                "'params' must be a mapping",
                id="params-list",
            ),
            pytest.param(
                "name: x\nscorers: [42]", "expected a plugin type name or a mapping", id="entry-int"
            ),
            pytest.param(
                "name: x\nscorers: [{type: queue, params: {halff: 2}}]",
                r"profile 'x' scorer 'queue' params: unknown key 'halff' \(did you mean 'half'\?\)",
                id="param-key",
            ),
            pytest.param(
                "name: x\nscorers: [fastest]",
                "profile 'x' scorer 'fastest': unknown scorer type 'fastest'",
                id="unknown-type",
            ),
            pytest.param(
                "name: x\npicker: queue", "'queue' is a scorer, not a picker", id="wrong-kind"
            ),
            pytest.param(
                "name: x\nscorers: [queue, queue]",
                r"plugin names \['queue'\] are used more than once",
                id="dup-names",
            ),
            pytest.param(
                "name: x\nscorers: [precise-prefix]", "needs the KV block index", id="no-index"
            ),
            pytest.param(
                "name: x\nscorers: [cost-model]", "needs a prefix scorer", id="cost-needs-prefix"
            ),
            pytest.param("name: x\nscorers: [a: b: c]", "not valid YAML", id="bad-yaml"),
        ],
    )
    def test_errors_say_what_to_fix(self, text, match):
        with pytest.raises(InvalidArgument, match=match):
            load_profile(text)

    def test_load_from_file(self, tmp_path):
        path = tmp_path / "mine.yaml"
        path.write_text("name: mine\nscorers: [queue]\n")
        assert load_profile(path).name == "mine"
        assert load_profile(str(path)).name == "mine"
        with pytest.raises(InvalidArgument, match="cannot read scheduler profile"):
            load_profile(tmp_path / "missing.yaml")
        path.write_text("name: mine\nscorers: [nope]\n")
        with pytest.raises(InvalidArgument, match="unknown scorer type 'nope'"):
            load_profile(path)

    def test_registry_extension(self):
        reg = Registry()
        with pytest.raises(InvalidArgument, match="unknown filter type 'serving'"):
            load_profile("name: x", registry=reg)


class TestMakePolicy:
    @pytest.mark.parametrize("name", ["least-loaded", "round-robin", "random"])
    def test_old_names_still_work(self, name):
        p = make_policy(name)
        assert p.name == name
        assert p.pick(request(2), views(2)).policy == name

    def test_precise_needs_index(self):
        with pytest.raises(InvalidArgument, match="needs the KV block index"):
            make_policy("precise-sticky")
        assert make_policy("precise-sticky", index=FakeIndex()).name == "precise-sticky"

    def test_unknown(self):
        with pytest.raises(
            InvalidArgument, match="unknown routing policy 'fastest'; choose one of"
        ):
            make_policy("fastest")

    def test_yaml_path(self):
        p = make_policy(str(PROFILES / "approximate-prefix.yaml"))
        assert p.name == "approximate-prefix"

    def test_policies_lists_builtins(self):
        assert set(POLICIES) >= {"least-loaded", "round-robin", "random", "precise-sticky"}


# ---- the framework ----------------------------------------------------------------------------
finite = st.floats(min_value=-2.0, max_value=3.0, allow_nan=False)
raw_score = st.one_of(finite, st.just(float("nan")), st.just(math.inf), st.just(-math.inf))


def clamp(x: float) -> float:
    return x if 0.0 <= x <= 1.0 else (1.0 if x > 1.0 else 0.0)


class TestFramework:
    @settings(max_examples=60, deadline=None)
    @given(
        n=st.integers(1, 6),
        cols=st.lists(
            st.tuples(st.floats(0.0, 5.0), st.lists(raw_score, min_size=6, max_size=6)),
            min_size=1,
            max_size=4,
        ),
    )
    def test_total_is_weighted_sum_of_clamped_scores(self, n, cols):
        s = Scheduler(
            "t",
            [],
            [
                Weighted(FixedScorer(f"s{i}", FixedParams(tuple(c))), w)
                for i, (w, c) in enumerate(cols)
            ],
            MaxScorePicker("max-score", MaxScoreParams(seed=1), random.Random()),
        )
        d = s.pick(request(4), views(n))
        e = d.explanation
        assert e is not None
        # every candidate's column entries are weight * clamp(raw)
        expect = [[w * clamp(c[i]) for i in range(n)] for w, c in cols if w > 0]
        assert len(e.columns) == len(expect)
        for col, want in zip(e.columns, expect, strict=True):
            assert list(col) == pytest.approx(want)
        totals = [sum(col[i] for col in expect) for i in range(n)]
        win = e.worker_ids.index(d.worker_id)
        assert e.winner_total == pytest.approx(totals[win])
        # The winner is a best total, up to the picker's tie epsilon (1e-9).
        assert totals[win] >= max(totals) - 1e-9 - 1e-12

    def test_on_cycle_sees_each_cycle_before_on_routed(self):
        # A role filter drops w01 (a prefill worker); the hook gets the cycle (the eligible
        # candidates), every candidate offered, and the decision, once per pick.
        s = sched("name: t\nfilters: [role]\n" + fixed_profile((1.0, (0.2, 0.9)))[8:])
        assert s.on_cycle is None  # off by default
        seen = []
        s.on_cycle = lambda ctx, offered, d: seen.append(
            ([v.record.worker_id for v in ctx.candidates], len(offered), d)
        )
        fleet = views(3)
        fleet[1] = view("w01", role=Role.PREFILL)
        d = s.pick(request(4), fleet)
        assert seen == [(["w00", "w02"], 3, d)] and d.worker_id == "w02"

    def test_deciding_plugin_is_largest_margin(self):
        s = sched(
            fixed_profile((1.0, (0.9, 0.2, 0.0)), (2.0, (0.5, 0.5, 0.0)), (0.5, (0.0, 1.0, 0.0)))
        )
        d = s.pick(request(4), views(3))
        e = d.explanation
        assert d.worker_id == "w00"
        assert e.runner_up == "w01"
        assert e.winner_scores == pytest.approx((0.9, 1.0, 0.0))
        assert e.runner_up_scores == pytest.approx((0.2, 1.0, 0.5))
        assert d.reason == e.deciding == "s0"
        assert e.margin == pytest.approx(0.2)
        text = d.details(full=True)
        assert "deciding=s0" in text and "runner-up w01" in text and "w02: total=0.000" in text

    @pytest.mark.parametrize(
        ("profile", "n", "reason"),
        [
            pytest.param(fixed_profile((1.0, (0.5,))), 1, "only-candidate", id="single"),
            pytest.param(fixed_profile((1.0, (0.5, 0.5))), 2, "tie-break", id="tie"),
            pytest.param(fixed_profile(), 3, "tie-break", id="no-scorers"),
            pytest.param(
                fixed_profile((1.0, (1.0, 0.0)), picker="round-robin"), 2, "round-robin", id="rr"
            ),
            pytest.param(
                fixed_profile((1.0, (1.0, 0.0)), picker="random"), 2, "random", id="random"
            ),
        ],
    )
    def test_verdicts(self, profile, n, reason):
        d = sched(profile).pick(request(4), views(n))
        assert d.reason == reason
        if reason in ("round-robin", "random"):
            assert d.explanation.runner_up is None

    def test_weight_zero_scorer_is_not_run_but_feeds_cost_model(self):
        idx = FakeIndex({"w00": gpu(10)})
        s = sched(
            "name: t\nscorers:\n  - {type: cost-model, weight: 1}\n"
            "  - {type: precise-prefix, weight: 0}\n",
            idx,
        )
        assert s.scorer_names == ("cost-model",)
        d = s.pick(request(10), views(3))
        assert d.worker_id == "w00" and d.reason == "cost-model"
        assert d.explanation.cached_blocks == 10
        assert d.explanation.cached_tokens == 10 * BLOCK
        assert idx.calls == 1  # one match per cycle, shared by every reader

    def test_no_candidates(self):
        with pytest.raises(Unavailable, match="no serving worker for model 'tiny'"):
            sched("name: t").pick(request(1), [])

    def test_filter_that_empties_is_named(self):
        with pytest.raises(
            Unavailable, match=r"passed filter 'model' \(2 candidate\(s\) before it\)"
        ):
            sched("name: t").pick(request(1, model="big"), views(2))

    def test_bad_scorer_length_is_a_bug(self):
        reg = fixed_registry()

        class Short:
            name = "short"

            def score(self, ctx, candidates):
                return [1.0]

        reg.register(PluginType("short", Kind.SCORER, NoParams, lambda n, p, e: Short()))
        s = load_profile("name: t\nscorers: [short]", registry=reg)
        with pytest.raises(RuntimeError, match="returned 1 scores for 2 candidates"):
            s.pick(request(1), views(2))

    def test_timings_accumulate(self):
        s = sched(fixed_profile((1.0, (1.0,))))
        for _ in range(3):
            d = s.pick(request(1), views(2))
        t = s.timings()
        assert list(t) == ["serving", "model", "role", "s0", "max-score"]
        assert all(x.calls == 3 and x.total_ns >= x.max_ns >= 0 for x in t.values())
        assert len(d.explanation.stage_ns) == 5

    def test_attributes_are_counts_and_ids(self):
        idx = FakeIndex({"w01": gpu(3)})
        d = sched("name: t\nscorers: [precise-prefix]", idx).pick(request(4), views(2))
        a = d.attributes()
        assert a["worker_id"] == "w01" and a["reason"] == "precise-prefix"
        assert a["cached_blocks"] == 3 and a["total_blocks"] == 4 and a["runner_up"] == "w00"
        assert all(isinstance(v, str | int | float) for v in a.values())


# ---- feedback -----------------------------------------------------------------------------------
class TestFeedback:
    def test_ledger_follows_the_request(self):
        idx = FakeIndex({"w00": gpu(6)})
        s = sched("name: t\nscorers: [precise-prefix]", idx)
        req = request(10)  # 165 tokens, 96 of them cached on w00
        d = s.pick(req, views(2))
        s.on_routed(req, d)
        t = s.ledger.tally(WorkerId("w00"))
        assert (t.requests, t.prompt_tokens, t.prefill_tokens) == (1, 165, 165 - 96)
        s.on_first_token(req, d.worker_id)
        assert s.ledger.tally(WorkerId("w00")).prefill_tokens == 0
        s.on_finished(req, WorkerId("w01"))  # another worker's attempt: ignored
        assert len(s.ledger) == 1
        s.on_finished(req, d.worker_id)
        assert len(s.ledger) == 0 and s.ledger.tally(WorkerId("w00")).requests == 0

    def test_ledger_counts_the_prefill_backlog_per_band(self):
        """What a request of a band waits for on an engine that schedules by priority: the
        prefills of its band and higher only."""
        from services.router.core.scheduler import InFlightLedger

        led, w = InFlightLedger(), WorkerId("w00")
        led.routed("lo", w, 1000, 1000, priority=0)
        led.routed("hi", w, 100, 60, priority=10)
        t = led.tally(w)
        assert t.prefill_tokens == 1060
        assert [t.prefill_tokens_from(p) for p in (-1, 0, 5, 10, 11)] == [1060, 1060, 60, 60, 0]
        led.first_token("hi")
        assert (t.prefill_tokens, t.prefill_tokens_from(10), t.prefill_by_band) == (
            1000,
            0,
            {0: 1000},
        )
        led.finished("lo", None)
        led.finished("hi", None)
        assert led.tally(w).prefill_by_band == {}

    def test_retry_replaces_the_attempt(self):
        s = sched("name: t")
        req = request(2)
        s.on_routed(req, s.pick(req, [view("a")]))
        s.on_routed(req, s.pick(req, [view("b")]))
        assert s.ledger.tally(WorkerId("a")).requests == 0
        assert s.ledger.tally(WorkerId("b")).requests == 1

    def test_plugins_get_the_hooks_they_have(self):
        calls = []

        class Learner:
            name = "learner"

            def score(self, ctx, candidates):
                return [0.0] * len(candidates)

            def on_finished(self, request, worker_id):  # only this hook
                calls.append((request.request_id, worker_id))

        reg = fixed_registry()
        reg.register(PluginType("learner", Kind.SCORER, NoParams, lambda n, p, e: Learner()))
        s = load_profile("name: t\nscorers: [learner]", registry=reg)
        req = request(1, rid="q")
        d = s.pick(req, views(1))
        s.on_routed(req, d)
        s.on_first_token(req, d.worker_id)
        s.on_finished(req, d.worker_id)
        assert calls == [("q", "w00")]


# ---- behaviours of the baseline profiles ------------------------------------------------------
class TestPrecisePrefix:
    @pytest.mark.parametrize(
        ("matches", "want"),
        [
            pytest.param({"w00": gpu(10), "w01": gpu(60), "w02": gpu(30)}, "w01", id="longest"),
            pytest.param(
                {"w00": gpu(50), "w01": Matched(60, cpu_blocks=60, exact=True)},
                "w00",
                id="gpu-beats-more-cpu",
            ),
            pytest.param(
                {"w00": gpu(40), "w01": gpu(60, exact=False)}, "w00", id="degraded-discounted"
            ),
            pytest.param(
                {"w02": Matched(60, gpu_blocks=10, disk_blocks=50, exact=True)},
                "w02",
                id="disk-beats-nothing",
            ),
        ],
    )
    def test_picks_the_best_prefix(self, matches, want):
        s = build_scheduler(
            builtin_profile("precise-prefix"), env=PluginEnv(FakeIndex(matches), random.Random(0))
        )
        d = s.pick(request(64), views(3))
        assert d.worker_id == want
        assert d.reason == "precise-prefix"


class TestPreciseSticky:
    """Turn after turn of a 195K-token agent context, 90%+ cached on one worker."""

    BLOCKS = 6100
    TOKENS = 6100 * 32

    def scheduler(self, cached: dict[str, int]):
        idx = FakeIndex({w: gpu(b) for w, b in cached.items()})
        return build_scheduler(
            builtin_profile("precise-sticky"), env=PluginEnv(idx, random.Random(0))
        )

    def req(self, session="s1"):
        return request(self.BLOCKS, session=session, prompt_tokens=self.TOKENS)

    def fleet(self, hot_waiting: int):
        return [
            view("w00", waiting=hot_waiting, block_size=32),
            *(view(f"w0{i}", block_size=32) for i in (1, 2, 3)),
        ]

    @pytest.mark.parametrize("waiting", [0, 1, 3, 6])
    def test_keeps_affinity_while_queue_costs_less_than_recompute(self, waiting):
        # recompute elsewhere: 195200 tok * 2.5e-5 = 4.9 s; queue on w00: waiting * 0.5 s
        s = self.scheduler({"w00": 5800})
        d = s.pick(self.req(), self.fleet(waiting))
        assert d.worker_id == "w00"
        assert d.explanation.cached_blocks == 5800

    @pytest.mark.parametrize("waiting", [16, 40])
    def test_moves_away_when_queue_costs_more_than_recompute(self, waiting):
        s = self.scheduler({"w00": 5800})
        d = s.pick(self.req(), self.fleet(waiting))
        assert d.worker_id != "w00"
        assert d.reason == "cost-model"
        assert d.explanation.runner_up == "w00"

    def test_threshold_is_the_cost_model(self):
        # Without the stickiness bonuses the switch happens where queue == recompute difference.
        idx = FakeIndex({"w00": gpu(5800)})
        s = load_profile(
            "name: t\nscorers:\n  - {type: cost-model, params: {queued_request_s: 0.5}}\n"
            "  - {type: precise-prefix, weight: 0}\npicker: {type: max-score, params: {seed: 0}}",
            env=PluginEnv(idx),
        )
        recompute = self.TOKENS * 2.5e-5
        cached_cost = (self.TOKENS - 5800 * 32) * 2.5e-5
        threshold = (recompute - cached_cost) / 0.5  # waiting requests that cost as much
        below, above = math.floor(threshold), math.ceil(threshold + 1e-9)
        assert s.pick(self.req(), self.fleet(below)).worker_id == "w00"
        assert s.pick(self.req(), self.fleet(above)).worker_id != "w00"

    def test_router_ledger_counts_as_queue_until_first_token(self):
        # Two other full prompts just sent to w00 and not yet prefilled make it hot before its
        # own load report says so; their first tokens make it cool again.
        s = self.scheduler({"w00": 5800})
        fleet = self.fleet(0)
        others = [request(self.BLOCKS, rid=f"o{i}", prompt_tokens=self.TOKENS) for i in range(2)]
        for other in others:
            s.on_routed(other, RouteDecision(WorkerId("w00"), "elsewhere", "x"))
        assert s.ledger.tally(WorkerId("w00")).prefill_tokens == 2 * self.TOKENS
        moved = s.pick(self.req("s9"), fleet)
        assert moved.worker_id != "w00" and moved.reason == "cost-model"
        for other in others:
            s.on_first_token(other, WorkerId("w00"))
        assert s.pick(self.req("s9"), fleet).worker_id == "w00"


class TestSessionAffinity:
    PROFILE = (
        "name: t\nscorers:\n  - {type: session-affinity, weight: 1, params: {max_waiting: 3}}\n"
        "  - {type: queue, weight: 0.5}\npicker: {type: max-score, params: {seed: 3}}"
    )

    def test_sticks_until_saturated_then_moves_and_resticks(self):
        s = sched(self.PROFILE)
        fleet = views(3)
        first = s.pick(request(1, session="a"), fleet)
        s.on_routed(request(1, session="a"), first)
        home = first.worker_id
        for waiting in (0, 1, 2):  # below max_waiting: stays even though others are idler
            fleet = [
                view(v.record.worker_id, waiting=waiting if v.record.worker_id == home else 0)
                for v in fleet
            ]
            d = s.pick(request(1, session="a"), fleet)
            assert d.worker_id == home and d.reason == "session-affinity"
            s.on_routed(request(1, session="a"), d)
        fleet = [
            view(v.record.worker_id, waiting=3 if v.record.worker_id == home else 0) for v in fleet
        ]
        moved = s.pick(request(1, session="a"), fleet)
        assert moved.worker_id != home
        s.on_routed(request(1, session="a"), moved)
        fleet = [
            view(v.record.worker_id, waiting=1 if v.record.worker_id == moved.worker_id else 0)
            for v in fleet
        ]
        assert s.pick(request(1, session="a"), fleet).worker_id == moved.worker_id

    def test_no_session_no_affinity(self):
        s = sched(self.PROFILE)
        d = s.pick(request(1), views(3))
        s.on_routed(request(1), d)
        assert s.pick(request(1), views(3)).reason == "tie-break"


class TestApproximatePrefix:
    def test_learns_from_on_routed(self):
        s = build_scheduler(
            builtin_profile("approximate-prefix"), env=PluginEnv(rng=random.Random(5))
        )
        fleet = views(4)
        turns = {}
        for conv in range(4):  # four conversations spread over the fleet
            req = request(hashes=chain(200, family=conv), rid=f"c{conv}")
            d = s.pick(req, fleet)
            s.on_routed(req, d)
            s.on_finished(req, d.worker_id)
            turns[conv] = d.worker_id
        for conv in range(4):  # the next turn of each: its prefix plus new blocks
            req = request(
                hashes=chain(200, family=conv) + chain(20, family=conv + 100), rid=f"n{conv}"
            )
            d = s.pick(req, fleet)
            assert d.worker_id == turns[conv]
            assert d.reason == "approximate-prefix"
            assert d.explanation.cached_blocks == 200

    def test_longest_learned_prefix_wins(self):
        s = sched("name: t\nscorers: [{type: approximate-prefix, params: {stride_blocks: 1}}]")
        a = request(hashes=chain(100), rid="a")
        b = request(hashes=chain(100, diverge_at=60), rid="b")
        s.on_routed(a, _decision("w00"))
        s.on_routed(b, _decision("w01"))
        probe = request(hashes=chain(100, diverge_at=80, branch=9))
        d = s.pick(probe, views(3))
        assert d.worker_id == "w00" and d.explanation.cached_blocks == 80
        assert d.explanation.runner_up == "w01"


def _decision(wid: str) -> RouteDecision:
    return RouteDecision(WorkerId(wid), "t", "x")


class TestWithTheKvIndex:
    """The router's real KV index satisfies ``PrefixIndex`` as it is (no adapter)."""

    def test_precise_profiles_route_on_it(self):
        index = pytest.importorskip("services.router.core.index")
        idx = index.KvIndex()
        for wid, held in (("w00", 30), ("w01", 90)):
            stored = BlockStored(chain(held), None, Tier.GPU, BLOCK)
            idx.apply(KvEventBatch(wid, "e1", 1, (stored,), snapshot=True))
        for name in ("precise-prefix", "precise-sticky"):
            s = make_policy(name, index=idx, rng=random.Random(0))
            d = s.pick(request(hashes=chain(100), session="s"), views(3))
            assert (d.worker_id, d.explanation.cached_blocks) == ("w01", 90)
