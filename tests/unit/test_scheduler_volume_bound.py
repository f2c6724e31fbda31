"""The ``volume-bound`` filter: which candidates it drops (recent routed volume past
``max_over_mean`` x the candidates' mean) and why, the all-dropped fallback, the decay of the
count it reads, and that it reads the profile's own ``routed-volume`` count."""

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
    VolumeBoundFilter,
    VolumeBoundParams,
    within_bound,
)
from services.router.core.scheduler.load import RoutedVolume
from services.router.core.scheduler.prefix import PreciseParams, PrecisePrefixScorer
from services.router.core.types import RouteDecision
from tests.unit.scheduler_fakes import FakeIndex, gpu, request, views


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
