"""The ttft-cost scorer (scheduler/ttft.py) and the prefill rates it learns (scheduler/rates.py):
pure, on hand-made matches, stores and load reports with known answers."""

from __future__ import annotations

from collections.abc import Mapping

import pytest

from kvmesh.discovery.keys import WorkerId
from kvmesh.errors import InvalidArgument
from services.router.core.index_types import StoreId, store_id
from services.router.core.scheduler import InFlightLedger, Matched
from services.router.core.scheduler.prefix import PreciseParams, PrecisePrefixScorer
from services.router.core.scheduler.rates import PrefillRates
from services.router.core.scheduler.ttft import TtftCostScorer, TtftParams, TtftTerms
from services.router.core.types import LoadSnapshot
from services.router.core.workers import WorkerView

from .scheduler_fakes import BLOCK, FakeIndex, ctx_for, gpu, request, view

LAYOUT = "00000000000000aa"
OTHER_LAYOUT = "00000000000000bb"
P = TtftParams(
    prefill_s_per_token=0.001,
    cpu_s_per_token=0.0001,
    cpu_latency_s=0.01,
    disk_s_per_token=0.0005,
    disk_latency_s=0.02,
    peer_s_per_token=0.0002,
    peer_latency_s=0.03,
    peer_min_gain_blocks=2,
    floor_s=0.5,
    min_sample_tokens=100,
    in_flight=False,  # the work-in-flight term has its own tests (test_scheduler_steps.py)
)


class StoreFakeIndex(FakeIndex):
    """FakeIndex plus the links of workers to node stores, as KvIndex has them."""

    def __init__(self, matches: Mapping[str, Matched], links: Mapping[str, StoreId]) -> None:
        super().__init__(matches)
        self._links = {WorkerId(k): v for k, v in links.items()}

    def linked(self, worker_id: WorkerId) -> StoreId | None:
        return self._links.get(worker_id)


def estimate(idx, cands, ledger=None, blocks=8, tokens=8 * BLOCK + 4, params=P):
    source = PrecisePrefixScorer("p", PreciseParams(), idx)
    scorer = TtftCostScorer("t", params, idx)
    ctx = ctx_for(request(blocks, prompt_tokens=tokens), cands, source, ledger)
    return scorer, ctx, scorer.estimate(ctx, cands)


TOKENS = 8 * BLOCK + 4  # 132


A = store_id("kvm-a", LAYOUT)
B = store_id("kvm-b", LAYOUT)
C = store_id("kvm-c", OTHER_LAYOUT)


@pytest.mark.parametrize(
    ("name", "match", "others", "queued", "want"),
    [
        # nothing anywhere: recompute the whole prompt
        ("cold", None, {}, 0, TOKENS * 0.001),
        # its engine holds 6 blocks: the tail only
        ("gpu", gpu(6), {}, 0, (TOKENS - 6 * BLOCK) * 0.001),
        # engine 4 + node cpu 2 + node disk 2: two loads and 4 tokens of prefill
        (
            "tiers",
            Matched(8, gpu_blocks=4, cpu_blocks=2, disk_blocks=2, exact=True),
            {},
            0,
            0.01 + 2 * BLOCK * 0.0001 + 0.02 + 2 * BLOCK * 0.0005 + 4 * 0.001,
        ),
        # a worker of another node holds 8 blocks (its store, written through), this one 2:
        # fetch 6 from that node's kvmanager
        ("peer", gpu(2), {"p": (B, 8)}, 0, 0.03 + 6 * BLOCK * 0.0002 + 4 * 0.001),
        # the peer's gain (1 block) is under the bar: recompute it
        ("short-peer", gpu(7), {"p": (B, 8)}, 0, (TOKENS - 7 * BLOCK) * 0.001),
        # a worker of its own node is no peer (its node store already counts in the match)
        ("own-node", None, {"s": (A, 8)}, 0, TOKENS * 0.001),
        # a node store of another layout means nothing to it
        ("other-layout", None, {"q": (C, 8)}, 0, TOKENS * 0.001),
        # a queue of 3000 uncached tokens routed to it and not yet prefilled: 3 s first
        ("queued", gpu(8), {}, 3000, 3.0 + 4 * 0.001),
    ],
)
def test_estimate(name, match, others, queued, want):
    matches = {k: gpu(b) for k, (_, b) in others.items()}
    if match is not None:
        matches["w"] = match
    links = {"w": A, **{k: sid for k, (sid, _) in others.items()}}
    idx = StoreFakeIndex(matches, links)
    ledger = InFlightLedger()
    if queued:
        ledger.routed("other", WorkerId("w"), queued, queued)
    _, _, got = estimate(idx, [view("w"), *(view(k) for k in others)], ledger)
    assert got[0] == pytest.approx(want), name


def test_score_moves_a_session_when_fetching_it_beats_waiting():
    # w0 holds the whole prompt but has 10 s of prefill queued; w1 (another node) holds nothing
    # but can fetch it from w0's node store: the session moves, with its cache.
    big = 1000 * BLOCK
    idx = StoreFakeIndex({"w0": gpu(1000)}, {"w0": A, "w1": B})
    ledger = InFlightLedger()
    ledger.routed("o", WorkerId("w0"), 10_000, 10_000)
    scorer, ctx, got = estimate(idx, [view("w0"), view("w1")], ledger, 1000, big + 4)
    assert got == pytest.approx([10.0 + 0.004, 0.03 + big * 0.0002 + 0.004])
    scores = scorer.score(ctx, [view("w0"), view("w1")])
    assert scores[1] == 1.0 and scores[0] == pytest.approx((got[1] + 0.5) / (got[0] + 0.5))
    # Without the queue it stays where its context is.
    _, _, idle = estimate(idx, [view("w0"), view("w1")], None, 1000, big + 4)
    assert idle[0] < idle[1]


def with_prefill(wid: str, tokens: int, seconds: float) -> WorkerView:
    v = view(wid)
    load = LoadSnapshot(prefill_computed_tokens=tokens, prefill_s=seconds)
    return WorkerView(record=v.record, load=load, router_in_flight=0)


def test_the_scorer_uses_each_workers_measured_prefill_rate():
    idx = StoreFakeIndex({}, {})
    source = PrecisePrefixScorer("p", PreciseParams(), idx)
    scorer = TtftCostScorer("t", P, idx)
    first = [with_prefill("fast", 0, 0.0), with_prefill("slow", 0, 0.0), view("new")]
    later = [with_prefill("fast", 1000, 0.5), with_prefill("slow", 1000, 4.0), view("new")]
    req = request(8, prompt_tokens=TOKENS)
    assert scorer.estimate(ctx_for(req, first, source), first) == pytest.approx(
        [TOKENS * 0.001] * 3  # nothing measured yet: the configured default
    )
    got = scorer.estimate(ctx_for(req, later, source), later)
    # fast: 0.5 ms per token, slow: 4 ms; new (no report yet): the fleet's mean
    assert got == pytest.approx([TOKENS * 0.0005, TOKENS * 0.004, TOKENS * 0.00225])


@pytest.mark.parametrize(
    ("reports", "want"),
    [
        ([(0, 0.0)], 0.01),  # one report: no sample yet, the default
        ([(0, 0.0), (50, 1.0)], 0.01),  # a sample under min_sample_tokens waits
        ([(0, 0.0), (50, 1.0), (100, 2.0)], 0.02),  # ... and is taken once it is large enough
        ([(0, 0.0), (100, 1.0), (200, 4.0)], 0.01 + 0.5 * (0.03 - 0.01)),  # moving average
        ([(0, 0.0), (100, 1.0), (10, 0.1)], 0.01),  # counters went back: a restart, forgotten
        ([(400, 8.0)], 0.02),  # first seen having served enough: its average since it started
        ([(400, 8.0), (500, 9.0)], 0.02 + 0.5 * (0.01 - 0.02)),  # ... then samples move it
        ([(50, 8.0)], 0.01),  # first seen having served too little: the default
    ],
)
def test_prefill_rates(reports, want):
    rates = PrefillRates(0.01, min_sample_tokens=100, half_life=1.0)
    for tokens, seconds in reports:
        rates.observe("w", LoadSnapshot(prefill_computed_tokens=tokens, prefill_s=seconds))
    assert rates.s_per_token("w") == pytest.approx(want)


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"prefill_s_per_token": 0.0}, "prefill_s_per_token must be > 0"),
        ({"peer_s_per_token": -1.0}, "peer_s_per_token is -1.0"),
        ({"peer_min_gain_blocks": 0}, "peer_min_gain_blocks must be >= 1"),
        ({"floor_s": 0.0}, "floor_s is 0.0"),
    ],
)
def test_params(kw, match):
    with pytest.raises(InvalidArgument, match=match):
        TtftParams(**kw)


def test_the_terms_add_up_to_the_estimate_term_by_term():
    # The same case as below at kv 0.5: w0's tail to prefill and what it displaces; w1's load
    # from the node's CPU tier, the same tail, and its whole prompt displaced.
    idx = StoreFakeIndex(
        {"w0": gpu(6), "w1": Matched(6, gpu_blocks=0, cpu_blocks=6, exact=True)},
        {"w0": A, "w1": A},
    )
    cands = [view("w0", kv=0.5), view("w1", kv=0.5)]
    scorer, ctx, got = estimate(idx, cands)
    terms: list[TtftTerms] = []
    assert scorer.estimate(ctx, cands, terms) == got
    tail = (TOKENS - 6 * BLOCK) * 0.001
    assert terms == [
        TtftTerms(0.0, 0.0, pytest.approx(tail), pytest.approx(0.5 * 36 * 0.0001), 0.0),
        TtftTerms(
            0.0,
            pytest.approx(0.01 + 6 * BLOCK * 0.0001),
            pytest.approx(tail),
            pytest.approx(0.5 * TOKENS * 0.0001),
            0.0,
        ),
    ]
    for t, e in zip(terms, got, strict=True):
        assert t.queue_s + t.fetch_s + t.prefill_s + t.displace_s + t.in_flight_s == pytest.approx(
            e
        )


def test_a_full_cache_charges_what_the_request_displaces():
    # w0 holds 6 of the 8 blocks on its GPU; w1 (same node store, A) holds them only on the node's
    # CPU tier. With both caches full of blocks in use (kv 1.0), each token brought onto a GPU
    # evicts another request's, which comes back from the CPU tier later: w0 brings 36 tokens
    # (the tail), w1 the whole 132; at kv 0.5 half of that; at kv 0 nothing.
    idx = StoreFakeIndex(
        {"w0": gpu(6), "w1": Matched(6, gpu_blocks=0, cpu_blocks=6, exact=True)},
        {"w0": A, "w1": A},
    )
    base0 = (TOKENS - 6 * BLOCK) * 0.001
    base1 = 0.01 + 6 * BLOCK * 0.0001 + (TOKENS - 6 * BLOCK) * 0.001
    for kv in (0.0, 0.5, 1.0):
        _, _, got = estimate(idx, [view("w0", kv=kv), view("w1", kv=kv)])
        assert got == pytest.approx(
            [base0 + kv * (TOKENS - 6 * BLOCK) * 0.0001, base1 + kv * TOKENS * 0.0001]
        ), kv
    off = TtftParams(**{**{f: getattr(P, f) for f in P.__slots__}, "displacement": False})
    _, _, got = estimate(idx, [view("w0", kv=1.0), view("w1", kv=1.0)], params=off)
    assert got == pytest.approx([base0, base1])
    # A worker without a node store refills from recompute, at its prefill rate.
    alone = StoreFakeIndex({"w0": gpu(6)}, {})
    _, _, got = estimate(alone, [view("w0", kv=1.0), view("w1", kv=1.0)])
    assert got == pytest.approx([base0 + (TOKENS - 6 * BLOCK) * 0.001, 2 * TOKENS * 0.001])


def test_the_kvmanagers_measured_transfer_rates_replace_the_configured_ones():
    from kvmesh.discovery.keys import KvManagerRecord
    from services.router.core.node_stores import KvManagerSet

    kvms = KvManagerSet()
    kvms.apply_put(
        KvManagerRecord(
            "kvm-a", "a:1", "node-a", transfer_s_per_token={LAYOUT: {"cpu": 0.0004, "peer": 0.001}}
        )
    )
    kvms.apply_put(KvManagerRecord("kvm-b", "b:1", "node-b"))  # nothing measured yet
    # w (node a) holds 2 blocks on GPU, 2 on its node's CPU tier; a worker of node b holds 8:
    # w fetches 4 from b at a's measured peer rate plus a's CPU tier load, and loads its own 2
    # from a's CPU tier at the measured rate.
    idx = StoreFakeIndex(
        {"w": Matched(4, gpu_blocks=2, cpu_blocks=2, exact=True), "p": gpu(8)},
        {"w": A, "p": B},
    )
    source = PrecisePrefixScorer("p", PreciseParams(), idx)
    scorer = TtftCostScorer("t", P, idx, kvms)
    cands = [view("w"), view("p")]
    got = scorer.estimate(ctx_for(request(8, prompt_tokens=TOKENS), cands, source), cands)
    want_w = 0.01 + 2 * BLOCK * 0.0004 + 0.03 + 4 * BLOCK * (0.001 + 0.0004) + 4 * 0.001
    assert got[0] == pytest.approx(want_w)
    assert scorer.links(A) == pytest.approx((0.0004, P.disk_s_per_token, 0.0014))
    assert scorer.links(B) == (P.cpu_s_per_token, P.disk_s_per_token, P.peer_s_per_token)
    assert TtftCostScorer("t", P, idx).links(A) == scorer.links(B)  # no source: configured
