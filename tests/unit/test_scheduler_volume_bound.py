"""The ``volume-bound`` filter: which candidates it drops (recent routed volume past
``max_over_mean`` x the candidates' mean) and why, the all-dropped fallback, the decay of the
count it reads, that it reads the profile's own ``routed-volume`` count, and, with
``move_slack_s``, that it turns a candidate away only when the ttft-cost estimate says the
move is cheap."""

from __future__ import annotations

import math
import random

import pytest

from kvmesh.discovery.keys import WorkerId
from kvmesh.errors import InvalidArgument
from services.router.core.scheduler import (
    CycleContext,
    InFlightLedger,
    Matched,
    PluginEnv,
    load_profile,
)
from services.router.core.scheduler.filters import (
    RecentPrefixes,
    VolumeBoundFilter,
    VolumeBoundParams,
    costly_moves_stay,
    graduated_slack,
    within_bound,
)
from services.router.core.scheduler.load import RoutedVolume
from services.router.core.scheduler.prefix import PreciseParams, PrecisePrefixScorer
from services.router.core.scheduler.ttft import TtftCostScorer, TtftParams
from services.router.core.types import Explanation, RouteDecision
from tests.unit.scheduler_fakes import BLOCK, FakeIndex, chain, gpu, request, views

VIEWS4 = ("w00", "w01", "w02", "w03")


def route(volume: RoutedVolume, wid: str, tokens: int) -> None:
    volume.on_routed(request(1, prompt_tokens=tokens), RouteDecision(WorkerId(wid), "t", "x"))


def kept(f: VolumeBoundFilter, volume: RoutedVolume, n: int) -> list[str]:
    fleet = views(n)
    ctx = CycleContext(request(1), fleet, InFlightLedger(), None, volume)
    return [v.record.worker_id for v in f.filter(ctx, fleet)]


class TestWithinBound:
    @pytest.mark.parametrize(
        ("volumes", "max_over_mean", "want"),
        [
            # mean 110, limit 121: only the 130 is past it
            pytest.param([100, 100, 130], 1.1, [True, True, False], id="one-past-the-bound"),
            # mean 100, limit 110: exactly at the bound stays
            pytest.param([90, 110, 100], 1.1, [True, True, True], id="at-the-bound-stays"),
            # mean 250, limit 275: the two heavy ones go
            pytest.param([0, 0, 500, 500], 1.1, [True, True, False, False], id="two-past"),
            # mean 100, limit 200: a looser bound keeps 150
            pytest.param([50, 150, 100, 100], 2.0, [True, True, True, True], id="loose"),
            pytest.param([0, 0, 0], 1.1, [True, True, True], id="nothing-routed-yet"),
            pytest.param([], 1.1, [], id="no-candidates"),
        ],
    )
    def test_which_drop(self, volumes, max_over_mean, want):
        assert within_bound(volumes, max_over_mean) == want

    @pytest.mark.parametrize(
        ("volumes", "added", "want"),
        [
            # with 20 tokens more: mean 106.7, bound 117.3; 100 + 20 is past it, 80 + 20 is not
            pytest.param([100, 80, 120], 20, [False, True, False], id="the-request-tips-it"),
            pytest.param([100, 80, 120], 0, [True, True, False], id="without-it"),
            # an even fleet: whoever takes it goes past; none would pass, so all stay
            pytest.param([100, 100, 100], 30, [True, True, True], id="even-fleet"),
            pytest.param([0, 0], 10, [True, True], id="nothing-routed-yet"),
        ],
    )
    def test_prospective(self, volumes, added, want):
        assert within_bound(volumes, 1.1, added) == want

    def test_every_one_past_the_bound_keeps_all(self):
        # Below 1 an even fleet is all past the bound: dropping all would leave no worker.
        assert within_bound([100, 100, 100], 0.9) == [True, True, True]
        # ... but an uneven one still drops those past it (mean 100, limit 90).
        assert within_bound([80, 100, 120], 0.9) == [True, False, False]

    @pytest.mark.parametrize("bad", [0.0, -1.0, math.nan])
    def test_bad_params(self, bad):
        with pytest.raises(InvalidArgument, match="max_over_mean is"):
            VolumeBoundParams(max_over_mean=bad)


class TestFilter:
    def test_drops_the_worker_past_the_bound(self):
        vol = RoutedVolume(half_life_requests=1e9)
        f = VolumeBoundFilter("vb", VolumeBoundParams())
        assert kept(f, vol, 4) == ["w00", "w01", "w02", "w03"]  # nothing routed: all stay
        for wid, tokens in (("w00", 1300), ("w01", 1000), ("w02", 1000), ("w03", 1000)):
            route(vol, wid, tokens)
        # mean 1075, bound 1182.5: w00's 1300 is past it
        assert kept(f, vol, 4) == ["w01", "w02", "w03"]
        route(vol, "w01", 1000)  # mean 1325, bound 1457.5: w01's 2000 is past it, w00 back
        assert kept(f, vol, 4) == ["w00", "w02", "w03"]

    def test_prospective_counts_the_request(self):
        vol = RoutedVolume(half_life_requests=1e9)
        for wid, tokens in (("w00", 1100), ("w01", 1000), ("w02", 1000), ("w03", 900)):
            route(vol, wid, tokens)
        fleet = views(4)
        big = CycleContext(request(1, prompt_tokens=400), fleet, InFlightLedger(), None, vol)
        # before it: mean 1000, bound 1100, all within
        plain = VolumeBoundFilter("vb", VolumeBoundParams())
        assert [v.record.worker_id for v in plain.filter(big, fleet)] == list(VIEWS4)
        # with its 400 tokens: mean 1100, bound 1210; whoever takes it is past it (1500 / 1400
        # / 1400 / 1300): none would pass, so all stay
        pro = VolumeBoundFilter("vb", VolumeBoundParams(prospective=True))
        assert [v.record.worker_id for v in pro.filter(big, fleet)] == list(VIEWS4)
        # 100 tokens: mean 1025, bound 1127.5; w03 (1000) and w01, w02 (1100) take it, w00
        # (1200) does not
        small = CycleContext(request(1, prompt_tokens=100), fleet, InFlightLedger(), None, vol)
        assert [v.record.worker_id for v in pro.filter(small, fleet)] == ["w01", "w02", "w03"]
        assert [v.record.worker_id for v in plain.filter(small, fleet)] == list(VIEWS4)

    def test_the_count_decays_per_decision(self):
        vol = RoutedVolume(half_life_requests=2)
        f = VolumeBoundFilter("vb", VolumeBoundParams())
        route(vol, "w00", 10_000)
        assert kept(f, vol, 2) == ["w01"]
        # Each decision halves w00's count every two; w01 gets 1,000 each time: after six
        # w00 holds 10,000 / 8 = 1,250 and w01 about 1,000 x (1 + ... + 0.5^2.5) ~ 3,270.
        for _ in range(6):
            route(vol, "w01", 1_000)
        assert vol.routed_volume("w00") == pytest.approx(1_250)
        assert kept(f, vol, 2) == ["w00"]

    def test_one_candidate_and_no_source_pass_through(self):
        vol = RoutedVolume(half_life_requests=10)
        route(vol, "w00", 5_000)
        f = VolumeBoundFilter("vb", VolumeBoundParams())
        assert kept(f, vol, 1) == ["w00"]
        fleet = views(2)
        ctx = CycleContext(request(1), fleet, InFlightLedger(), None)  # no volume source
        assert f.filter(ctx, fleet) == fleet

    def test_spares_the_workers_holding_the_request_on_gpu(self):
        # w00 and w01 are past the bound (mean 1,000, bound 1,100); w00 holds the whole request
        # on its GPU, w01 half of it, w02 all of it on its node's CPU tier only.
        vol = RoutedVolume(half_life_requests=1e9)
        for wid, tokens in (("w00", 1500), ("w01", 1500), ("w02", 500), ("w03", 500)):
            route(vol, wid, tokens)
        held = {"w00": gpu(8), "w01": gpu(4), "w02": Matched(8, cpu_blocks=8, exact=True)}
        source = PrecisePrefixScorer("p", PreciseParams(), FakeIndex(held))
        fleet = views(4)

        def kept_ids(spare: float) -> list[str]:
            f = VolumeBoundFilter("vb", VolumeBoundParams(spare_gpu_share=spare))
            ctx = CycleContext(request(8), fleet, InFlightLedger(), source, vol)
            return [v.record.worker_id for v in f.filter(ctx, fleet)]

        assert kept_ids(0.0) == ["w02", "w03"]  # the hard bound
        assert kept_ids(0.9) == ["w00", "w02", "w03"]  # w00's turn stays with its cache
        assert kept_ids(0.5) == ["w00", "w01", "w02", "w03"]
        with pytest.raises(InvalidArgument, match=r"spare_gpu_share is 1\.5"):
            VolumeBoundParams(spare_gpu_share=1.5)


PROFILE = """
name: bounded
filters: [serving, model, role, volume-bound]
scorers:
  - {type: precise-prefix, weight: 1}
  - {type: routed-volume, weight: %s, params: {half_life_requests: 1000}}
"""


class TestInAProfile:
    def test_needs_a_routed_volume_scorer(self):
        text = "name: b\nfilters: [serving, volume-bound]\nscorers: [precise-prefix]\n"
        with pytest.raises(InvalidArgument, match="filter 'volume-bound' bounds the routed-vol"):
            load_profile(text, env=PluginEnv(FakeIndex()))

    def test_reads_the_scorers_count_and_turns_the_prefix_holder_away(self):
        # w00 holds the whole prompt; a weight-0 routed-volume scorer still counts (and is the
        # filter's source), so the prefix decides until w00 is past 1.1x the mean.
        idx = FakeIndex({"w00": gpu(8)})
        s = load_profile(PROFILE % 0, env=PluginEnv(idx, random.Random(0)))
        assert s.scorer_names == ("precise-prefix",)
        assert s.volume_source is not None
        fleet = views(4)
        picks = []
        for i in range(5):
            req = request(8, rid=f"r{i}", prompt_tokens=1000)
            d = s.pick(req, fleet)
            s.on_routed(req, d)
            picks.append((d.worker_id, d.explanation.eligible))
        # r0: nothing routed yet, all eligible, w00 wins on its prefix. r1: w00's 1,000 is past
        # 1.1x the mean (250): dropped, the other three tie. r2: the two routed to are past 1.1x
        # 500. r3: three at ~1,000 are past 1.1x 750: one left, the one not yet routed to. r4:
        # all at ~1,000 (w00's decayed most, the least): all eligible, w00 wins on its prefix.
        assert [e for _, e in picks] == [4, 3, 2, 1, 4]
        assert picks[0][0] == picks[4][0] == "w00"
        assert sorted(w for w, _ in picks[:4]) == ["w00", "w01", "w02", "w03"]
        assert s.volume_source.routed_volume("w00") == pytest.approx(
            1000 * 0.5 ** (4 / 1000) + 1000
        )


# ---- move_slack_s: a candidate past the bound goes only when moving is cheap ------------------
# Known rates (the ttft-cost scorer's own estimate, no displacement: the views report an empty
# cache): recompute 1 ms a token, the node's CPU tier 0.1 ms a token + 10 ms.
RATES = TtftParams(
    prefill_s_per_token=0.001,
    cpu_s_per_token=0.0001,
    cpu_latency_s=0.01,
    in_flight=False,
)
PAST = (("w00", 1500), ("w01", 500), ("w02", 500), ("w03", 500))  # mean 750: w00 past 825


class TestCostlyMovesStay:
    @pytest.mark.parametrize(
        ("ttft", "within", "factor", "slack", "want"),
        [
            # w0 past the bound at 1.0 s; the best within it 1.2 s: a move costs 0.2 s more.
            pytest.param(
                [1.0, 1.2, 1.5],
                [False, True, True],
                1.0,
                0.25,
                [False, True, True],
                id="cheap-move-drops",
            ),
            pytest.param(
                [1.0, 1.3, 1.5],
                [False, True, True],
                1.0,
                0.25,
                [True, True, True],
                id="costly-move-stays",
            ),
            pytest.param(
                [1.0, 1.25, 1.5],
                [False, True, True],
                1.0,
                0.25,
                [False, True, True],
                id="at-the-slack-drops",
            ),
            pytest.param(
                [1.0, 1.3, 1.5], [False, True, True], 1.5, 0.0, [False, True, True], id="factor"
            ),
            # faster elsewhere: always a move worth making
            pytest.param([2.0, 0.5], [False, True], 1.0, 0.0, [False, True], id="faster-elsewhere"),
            # each past the bound judged on its own estimate
            pytest.param(
                [0.1, 1.0, 1.2], [False, False, True], 1.0, 0.25, [True, False, True], id="two-past"
            ),
        ],
    )
    def test_which_stay(self, ttft, within, factor, slack, want):
        assert costly_moves_stay(ttft, within, within, factor, slack) == want

    def test_spared_stay_spared(self):
        assert costly_moves_stay([0.1, 5.0], [False, True], [True, True], 1.0, 0.0) == [True, True]

    def test_a_slack_per_candidate(self):
        # Both past the bound cost 0.9 s more to move: the one with 1 s of slack goes, the one
        # with 0.5 s stays.
        within = [False, False, True]
        got = costly_moves_stay([0.1, 0.1, 1.0], within, within, 1.0, [1.0, 0.5, 0.0])
        assert got == [False, True, True]


class TestGraduatedSlack:
    @pytest.mark.parametrize(
        ("volumes", "want"),
        [
            # mean 100, bound 1.1: 150 is 0.4 past it (+0.4 x 2 s), 110 at it, 40 within
            pytest.param([150, 110, 40], [1.05, 0.25, 0.25], id="by-the-excess"),
            pytest.param([0, 0], [0.25, 0.25], id="nothing-routed-yet"),
            pytest.param([], [], id="no-candidates"),
        ],
    )
    def test_slack(self, volumes, want):
        assert graduated_slack(volumes, 1.1, 0.25, 2.0) == pytest.approx(want)

    def test_capped(self):
        # 150 would get 1.05 s; the cap holds it at 0.8 s, and 110's 0.25 s is under it
        got = graduated_slack([150, 110, 40], 1.1, 0.25, 2.0, max_s=0.8)
        assert got == pytest.approx([0.8, 0.25, 0.25])

    @pytest.mark.parametrize(
        ("kw", "match"),
        [
            ({"move_slack_s": -0.1}, r"move_slack_s is -0\.1"),
            ({"move_slack_s": 0.1, "move_factor": 0.5}, r"move_factor is 0\.5"),
            ({"move_slack_per_excess_s": -1.0}, r"move_slack_per_excess_s is -1\.0"),
            ({"move_slack_s": 0.5, "move_slack_max_s": 0.25}, r"move_slack_max_s is 0\.25"),
        ],
    )
    def test_bad_params(self, kw, match):
        with pytest.raises(InvalidArgument, match=match):
            VolumeBoundParams(**kw)


def cheap_kept(
    held, blocks, tokens, slack, ledger=None, factor=1.0, per_excess=0.0, slack_max=None
):
    """Which of four workers (w00 past the bound) the filter keeps, with a real ttft-cost
    scorer over a real precise-prefix scorer reading ``held``; and the context it used."""
    vol = RoutedVolume(half_life_requests=1e9)
    for wid, t in PAST:
        route(vol, wid, t)
    idx = FakeIndex(held)
    source = PrecisePrefixScorer("p", PreciseParams(), idx)
    cost = TtftCostScorer("t", RATES, idx)
    fleet = views(4)
    f = VolumeBoundFilter(
        "vb",
        VolumeBoundParams(
            move_slack_s=slack,
            move_factor=factor,
            move_slack_per_excess_s=per_excess,
            move_slack_max_s=slack_max,
        ),
    )
    ctx = CycleContext(
        request(blocks, prompt_tokens=tokens),
        fleet,
        ledger or InFlightLedger(),
        source,
        vol,
        cost,
    )
    return [v.record.worker_id for v in f.filter(ctx, fleet)], ctx, cost


class TestCheapMoves:
    def test_a_long_warm_context_stays_past_the_bound(self):
        # w00 holds a 64-block (1,028-token) prompt on its GPU: 4 ms there, 1.028 s of
        # recompute anywhere else. A move costs 1.02 s more than staying: past a 0.25 s slack.
        got, _, _ = cheap_kept({"w00": gpu(64)}, 64, 64 * BLOCK + 4, 0.25)
        assert got == ["w00", "w01", "w02", "w03"]
        # ... unless the slack allows a second of it
        got, _, _ = cheap_kept({"w00": gpu(64)}, 64, 64 * BLOCK + 4, 1.1)
        assert got == ["w01", "w02", "w03"]

    def test_the_slack_grows_with_the_excess(self):
        # w00 is at 2x the mean, 0.9 past the 1.1 bound: 0.5 s per unit of excess gives it
        # 0.25 + 0.45 = 0.7 s of slack (the 1.02 s move stays), 1 s per unit 1.15 s (it goes).
        got, _, _ = cheap_kept({"w00": gpu(64)}, 64, 64 * BLOCK + 4, 0.25, per_excess=0.5)
        assert got == ["w00", "w01", "w02", "w03"]
        got, _, _ = cheap_kept({"w00": gpu(64)}, 64, 64 * BLOCK + 4, 0.25, per_excess=1.0)
        assert got == ["w01", "w02", "w03"]
        # ... unless a cap holds the slack under the move's cost
        got, _, _ = cheap_kept(
            {"w00": gpu(64)}, 64, 64 * BLOCK + 4, 0.25, per_excess=1.0, slack_max=1.0
        )
        assert got == ["w00", "w01", "w02", "w03"]

    def test_new_work_goes(self):
        # Nobody holds the request: it costs the same everywhere, so the worker past the bound
        # goes even with no slack at all.
        got, _, _ = cheap_kept({}, 64, 64 * BLOCK + 4, 0.0)
        assert got == ["w01", "w02", "w03"]

    def test_a_sibling_loading_it_from_its_node_tier_is_a_cheap_move(self):
        # w01 has the whole prefix on its node's CPU tier: 10 ms + 1,024 x 0.1 ms + 4 ms of
        # prefill = 0.118 s, 0.114 s more than staying on w00: inside 0.25 s, w00 goes.
        held = {"w00": gpu(64), "w01": Matched(64, cpu_blocks=64, exact=True)}
        got, _, _ = cheap_kept(held, 64, 64 * BLOCK + 4, 0.25)
        assert got == ["w01", "w02", "w03"]
        got, _, _ = cheap_kept(held, 64, 64 * BLOCK + 4, 0.1)  # not inside 0.1 s: it stays
        assert got == ["w00", "w01", "w02", "w03"]
        # move_factor: 0.118 s is within 30x of 4 ms, not within 20x
        got, _, _ = cheap_kept(held, 64, 64 * BLOCK + 4, 0.0, factor=30.0)
        assert got == ["w01", "w02", "w03"]
        got, _, _ = cheap_kept(held, 64, 64 * BLOCK + 4, 0.0, factor=20.0)
        assert got == ["w00", "w01", "w02", "w03"]

    def test_a_queue_on_the_holder_makes_the_move_cheap(self):
        # 1,000 tokens still to prefill on w00 (this router's ledger): 1.004 s there against
        # 1.028 s of recompute elsewhere, within 0.25 s: w00 goes.
        ledger = InFlightLedger()
        ledger.routed("earlier", WorkerId("w00"), 1000, 1000)
        got, _, _ = cheap_kept({"w00": gpu(64)}, 64, 64 * BLOCK + 4, 0.25, ledger)
        assert got == ["w01", "w02", "w03"]

    def test_the_scorer_reuses_the_filters_estimate(self):
        got, ctx, cost = cheap_kept({}, 64, 64 * BLOCK + 4, 0.0)
        memo = ctx.costs
        assert memo is not None and memo[0] is cost
        assert sorted(memo[1]) == ["w00", "w01", "w02", "w03"]  # every candidate before it
        kept_views = [v for v in views(4) if v.record.worker_id in got]
        assert cost.ttft_estimates(ctx, kept_views) is memo[1]  # one estimate per decision
        assert cost.score(ctx, kept_views) == [1.0, 1.0, 1.0]


CHEAP = """
name: cheap
filters: [serving, model, role, {type: volume-bound, params: {move_slack_s: 0.25}}]
scorers:
  - {type: precise-prefix, weight: 1}
  - {type: routed-volume, weight: 0, params: {half_life_requests: 1e9}}
%s
"""


class TestCheapMovesInAProfile:
    def test_needs_a_ttft_cost_scorer(self):
        with pytest.raises(InvalidArgument, match="add a ttft-cost scorer"):
            load_profile(CHEAP % "", env=PluginEnv(FakeIndex()))

    def test_warm_turns_stay_and_new_work_goes(self):
        # As TestCheapMoves, through a built profile: w00 past the bound holds the warm turn
        # (1.02 s cheaper there: it stays), not the cold one (the same cost anywhere: it goes).
        idx = FakeIndex({"w00": gpu(64)})
        s = load_profile(
            CHEAP % "  - {type: ttft-cost, weight: 0, params: {prefill_s_per_token: 0.001}}",
            env=PluginEnv(idx, random.Random(0)),
        )
        assert s.cost_source is not None
        assert s.scorer_names == ("precise-prefix",)
        vol = s.volume_source
        assert isinstance(vol, RoutedVolume)
        for wid, t in PAST:
            route(vol, wid, t)
        fleet = views(4)
        warm = s.pick(request(64, rid="warm", prompt_tokens=64 * BLOCK + 4), fleet)
        assert (warm.worker_id, warm.explanation.eligible) == ("w00", 4)
        idx.matches = {}  # a request nobody holds (FakeIndex answers every hash alike)
        cold = s.pick(request(64, rid="cold", hashes=chain(64, family=7)), fleet)
        assert cold.worker_id != "w00" and cold.explanation.eligible == 3


def placed(f: VolumeBoundFilter, req, gpu_blocks: int) -> None:
    """The scheduler's on_routed for ``req`` placed on a worker holding ``gpu_blocks``."""
    e = Explanation("p", "x", 4, 4, (), (), cached_gpu_blocks=gpu_blocks)
    f.on_routed(req, RouteDecision(WorkerId("w00"), "p", "x", e))


class TestRecurringPrefixes:
    def test_the_count_decays_per_decision_and_fades_away(self):
        recent = RecentPrefixes(half_life_requests=2.0)
        a, b = chain(2)
        recent.decide(a)
        recent.decide(a)
        assert recent.count(a) == pytest.approx(1.0 + 0.5**0.5)
        recent.decide(None)  # a decision whose winner held nothing: only decays
        recent.decide(None)
        assert recent.count(a) == pytest.approx(0.5 * (1.0 + 0.5**0.5))
        assert recent.count(b) == 0.0
        for _ in range(1024):  # the table is pruned every 1,024 decisions here
            recent.decide(None)
        assert recent.count(a) == 0.0 and not recent._counts

    def filter_over(self, recurrences: int, *, depth=64, slack_max=None, half_life=1e9):
        """w00 (past the bound) holds the 64-block prompt on its GPU: 1.02 s cheaper there
        than anywhere else; ``recurrences`` earlier requests were placed on a holder of the
        same prefix at ``depth`` blocks. Which candidates the filter keeps."""
        vol = RoutedVolume(half_life_requests=1e9)
        for wid, t in PAST:
            route(vol, wid, t)
        idx = FakeIndex({"w00": gpu(64)})
        f = VolumeBoundFilter(
            "vb",
            VolumeBoundParams(
                move_slack_s=0.25,
                move_slack_max_s=slack_max,
                recurrence_half_life_requests=half_life,
            ),
        )
        req = request(64, prompt_tokens=64 * BLOCK + 4)
        for _ in range(recurrences):
            placed(f, req, depth)
        fleet = views(4)
        source = PrecisePrefixScorer("p", PreciseParams(), idx)
        ctx = CycleContext(
            req, fleet, InFlightLedger(), source, vol, TtftCostScorer("t", RATES, idx)
        )
        return [v.record.worker_id for v in f.filter(ctx, fleet)]

    def test_a_recurring_prefix_moves_at_a_slack_grown_by_its_recurrences(self):
        # 0.25 s x (1 + 3) = 1.0 s < 1.02 s: it stays; x (1 + 4) = 1.25 s: it goes.
        assert self.filter_over(3) == ["w00", "w01", "w02", "w03"]
        assert self.filter_over(4) == ["w01", "w02", "w03"]
        # ... not under a cap below the move's cost
        assert self.filter_over(4, slack_max=1.0) == ["w00", "w01", "w02", "w03"]
        # ... nor when the count has decayed (half-life 1 decision: 4 recurrences ~ 1.9)
        assert self.filter_over(4, half_life=1.0) == ["w00", "w01", "w02", "w03"]

    def test_only_the_same_prefix_at_the_same_depth_counts(self):
        # Placed while the holder had 63 blocks of it: another prefix (a shorter one).
        assert self.filter_over(10, depth=63) == ["w00", "w01", "w02", "w03"]
        assert self.filter_over(10, depth=0) == ["w00", "w01", "w02", "w03"]  # cold ones

    def test_off_by_default_and_without_a_move_slack(self):
        assert VolumeBoundParams().recurrence_half_life_requests == 0.0
        assert VolumeBoundFilter("vb", VolumeBoundParams())._recent is None
        hard = VolumeBoundFilter("vb", VolumeBoundParams(recurrence_half_life_requests=400))
        assert hard._recent is None  # a hard bound moves whatever the cost: nothing to grow
        placed(hard, request(4), 4)  # and counts nothing

    def test_bad_param(self):
        with pytest.raises(InvalidArgument, match=r"recurrence_half_life_requests is -1"):
            VolumeBoundParams(recurrence_half_life_requests=-1.0)

    def test_in_a_profile_a_hot_prefix_moves_once_it_recurs(self):
        # Through a built profile (the scheduler calls the filter's on_routed): the warm
        # 64-block prompt stays on w00 (past the bound) for its first four placements, r = 0..3,
        # and goes from the fifth, r = 4 (w01 then holds nothing per this index: it counts
        # nothing, and the prefix keeps its count).
        idx = FakeIndex({"w00": gpu(64)})
        s = load_profile(
            RECURRING % "  - {type: ttft-cost, weight: 0, params: {prefill_s_per_token: 0.001}}",
            env=PluginEnv(idx, random.Random(0)),
        )
        vol = s.volume_source
        assert isinstance(vol, RoutedVolume)
        for wid, t in PAST:
            route(vol, wid, t)
        fleet = views(4)
        got = []
        for k in range(6):
            r = request(64, rid=f"r{k}", prompt_tokens=64 * BLOCK + 4)
            d = s.pick(r, fleet)
            s.on_routed(r, d)
            got.append(d.worker_id)
        assert got[:4] == ["w00"] * 4 and "w00" not in got[4:]


RECURRING = """
name: recurring
filters:
  - serving
  - {type: volume-bound, params: {move_slack_s: 0.25, recurrence_half_life_requests: 1e9}}
scorers:
  - {type: precise-prefix, weight: 1}
  - {type: routed-volume, weight: 0, params: {half_life_requests: 1e9}}
%s
"""
