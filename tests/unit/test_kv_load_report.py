"""Cached tokens by tier: where the KV connector's loads come from (``plan.load_report``), what
the scheduler side reports per request (``plan.LoadLedger``: a failed load reports nothing), the
report on the wire (``LoadReport`` in ``kv_transfer_params``), and the worker's split of vLLM's
``num_cached_tokens`` (``core.CachedTokens.split``)."""

from __future__ import annotations

import pytest

from kvmesh.kv.events import Tier
from services.worker.connector import plan as plans
from services.worker.connector.plan import (
    LOAD_REPORT_PARAM,
    REQUEST_ID_PARAM,
    LoadLedger,
    LoadReport,
    RequestPlan,
)
from services.worker.core import CachedTokens, OutputDelta

BLOCK = 32
C, D = Tier.CPU, Tier.DISK


# ---- where a load's blocks come from ----------------------------------------------------------
@pytest.mark.parametrize(
    ("tiers", "peer", "numbers", "want"),
    [
        pytest.param([C, C, C, C], range(0), range(0, 4), LoadReport(cpu=128), id="all-cpu"),
        pytest.param([C, D, D, C], range(0), range(0, 4), LoadReport(cpu=64, disk=64), id="mixed"),
        pytest.param(  # blocks 0-1 in the engine's own cache: only 2-3 load
            [D, D, D, C], range(0), range(2, 4), LoadReport(cpu=32, disk=32), id="after-local"
        ),
        pytest.param(  # the peer fetch stored blocks 2-5 (now in the local CPU tier)
            [C, C, C, C, C, C], range(2, 6), range(0, 6), LoadReport(cpu=64, peer=128), id="peer"
        ),
        pytest.param(  # a store that does not say: CPU
            [], range(0), range(0, 3), LoadReport(cpu=96), id="tiers-unknown"
        ),
        pytest.param([C, C], range(0), range(0), LoadReport(), id="nothing"),
    ],
)
def test_load_report(tiers: list[Tier], peer: range, numbers: range, want: LoadReport) -> None:
    p = RequestPlan(keys=list(range(8)))
    plans.after_lookup(p, numbers.start * BLOCK, len(tiers) or numbers.stop, tiers)
    p.peer_blocks = peer
    assert plans.load_report(p, numbers, BLOCK) == want


def test_after_lookup_keeps_the_tiers_of_the_leading_blocks() -> None:
    p = RequestPlan(keys=list(range(4)))
    plans.after_lookup(p, 0, 2, [D, C, C])
    assert (p.store_blocks, p.store_tiers, p.saved_blocks) == (2, [D, C], 2)


# ---- the scheduler side's ledger ----------------------------------------------------------------
def test_ledger_reports_a_load_when_sent_and_when_finished() -> None:
    ledger = LoadLedger()
    report = LoadReport(cpu=64, peer=32)
    assert ledger.sent("r-x1", "r", report, [7, 8, 9]) == [("r", report)]
    assert ledger.failed({1, 2}) == []  # another request's blocks
    assert ledger.finish("r-x1") == report
    assert ledger.finish("r-x1") is None and len(ledger) == 0


def test_ledger_a_failed_load_reports_nothing_loaded() -> None:
    ledger = LoadLedger()
    ledger.sent("a", "a", LoadReport(cpu=64, disk=32), [4, 5, 6])
    ledger.sent("b", "b", LoadReport(cpu=32), [10])
    failed = LoadReport(failed=96)
    assert ledger.failed({6, 99}) == [("a", failed)]
    assert ledger.failed({6}) == []  # reported once
    assert ledger.finish("a") == failed
    assert ledger.finish("b") == LoadReport(cpu=32)


def test_ledger_a_reload_keeps_the_first_report_and_watches_the_new_blocks() -> None:
    ledger = LoadLedger()
    first = LoadReport(disk=64)
    ledger.sent("a", "a", first, [1, 2])
    assert ledger.sent("a", "a", LoadReport(cpu=96), [5, 6, 7]) == []  # after a preemption
    assert ledger.failed({1}) == []  # its old blocks went back to the engine
    assert ledger.failed({7}) == [("a", LoadReport(failed=64))]


def test_no_load_no_report() -> None:
    assert LoadLedger().finish("never") is None


# ---- the report on the wire ---------------------------------------------------------------------
def test_report_round_trips_through_kv_transfer_params() -> None:
    r = LoadReport(cpu=1, disk=2, peer=3, failed=4)
    assert LoadReport.from_params({LOAD_REPORT_PARAM: r.to_dict()}) == r
    assert r.loaded == 6 and r.as_failed() == LoadReport(failed=10)


@pytest.mark.parametrize(
    "params",
    [
        pytest.param(None, id="none"),
        pytest.param({}, id="absent"),
        pytest.param({LOAD_REPORT_PARAM: [1, 2]}, id="not-a-dict"),
        pytest.param({LOAD_REPORT_PARAM: {"cpu": -1}}, id="negative"),
        pytest.param({LOAD_REPORT_PARAM: {"cpu": 1.5}}, id="float"),
        pytest.param({LOAD_REPORT_PARAM: {"disk": True}}, id="bool"),
    ],
)
def test_malformed_reports_are_ignored(params) -> None:
    assert LoadReport.from_params(params) is None


def test_request_id_param() -> None:
    assert plans.request_id_of({REQUEST_ID_PARAM: "mine"}, "mine-1a2b3c4d") == "mine"
    assert plans.request_id_of(None, "vllm-id") == "vllm-id"
    assert plans.request_id_of({REQUEST_ID_PARAM: ""}, "vllm-id") == "vllm-id"


# ---- the worker's split of num_cached_tokens ----------------------------------------------------
@pytest.mark.parametrize(
    ("engine_cached", "report", "want"),
    [
        pytest.param(96, LoadReport(), CachedTokens(gpu=96), id="engine-only"),
        pytest.param(896, LoadReport(cpu=896), CachedTokens(cpu=896), id="all-cpu"),
        pytest.param(
            320, LoadReport(cpu=64, disk=128), CachedTokens(gpu=128, cpu=64, disk=128), id="mixed"
        ),
        pytest.param(320, LoadReport(peer=256), CachedTokens(gpu=64, peer=256), id="peer"),
        pytest.param(  # the load failed: vLLM still counts its 256 planned tokens
            288, LoadReport(failed=256), CachedTokens(gpu=32), id="failed-load"
        ),
        pytest.param(  # never more loaded than vLLM counted
            64, LoadReport(cpu=64, disk=64), CachedTokens(cpu=64), id="clamped"
        ),
        pytest.param(0, LoadReport(failed=64), CachedTokens(), id="failed-nothing-counted"),
    ],
)
def test_cached_tokens_split(engine_cached: int, report: LoadReport, want: CachedTokens) -> None:
    got = CachedTokens.split(engine_cached, report.cpu, report.disk, report.peer, report.failed)
    assert got == want
    assert got.total <= engine_cached


def test_a_delta_without_a_split_is_all_the_engines_own() -> None:
    d = OutputDelta("r", (), "", prompt_tokens=100, cached_tokens=64, completion_tokens=1)
    assert d.cached_split() == CachedTokens(gpu=64)
    split = CachedTokens(gpu=32, cpu=32)
    assert OutputDelta("r", (), "", 100, 64, 1, cached_by_tier=split).cached_split() == split
