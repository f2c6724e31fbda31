"""The worker side of peer hints, without vLLM: the hint on the wire and in the request
(``servicer.request_from_pb``, ``validation.check_kv_source``), in ``kv_transfer_params``
(``plan.PeerSource``), which blocks a request fetches (``plan.peer_fetch_range``) and the
per-request fetch state the connector's scheduler side polls (``peer_prefetch.PeerPrefetcher``,
with a fake fetch and a fake clock)."""

from __future__ import annotations

import threading
import time
from collections import Counter

import pytest

from kvmesh.errors import InvalidArgument
from kvmesh.v1 import common_pb2, worker_pb2
from services.worker.connector.client import StoreConfig
from services.worker.connector.peer_prefetch import (
    FetchOutcome,
    PeerFetchConfig,
    PeerPrefetcher,
    make_prefetcher,
)
from services.worker.connector.plan import (
    KV_SOURCE_PARAM,
    STORE_PREFIX_PARAM,
    PeerSource,
    known_store_prefix,
    peer_fetch_range,
)
from services.worker.core import EngineInfo, GenerateRequest, KvSource, Sampling
from services.worker.servicer import request_from_pb
from services.worker.validation import check_request

INFO = EngineInfo(model="m", model_path="/m", max_model_len=1000, block_size=32, vocab_size=50)
PEER = PeerSource("kvm-a", 10)


# ---- the hint on the wire, in the request, in kv_transfer_params ------------------------------
def test_request_from_pb_carries_the_hint():
    msg = worker_pb2.WorkerGenerateRequest(
        request_id="r",
        prompt_token_ids=[1, 2],
        sampling=common_pb2.SamplingParams(max_tokens=3),
        kv_source=worker_pb2.KvSource(kvmanager_id="kvm-a", blocks=7),
    )
    assert request_from_pb(msg).kv_source == KvSource("kvm-a", 7)
    msg.kv_source.handoff_wait_s = 2.5
    assert request_from_pb(msg).kv_source == KvSource("kvm-a", 7, 2.5)
    msg.kv_source.max_fetch_s = 0.4
    assert request_from_pb(msg).kv_source == KvSource("kvm-a", 7, 2.5, 0.4)
    msg.ClearField("kv_source")
    assert request_from_pb(msg).kv_source is None


def test_request_from_pb_carries_the_store_prefix_count():
    msg = worker_pb2.WorkerGenerateRequest(
        request_id="r", prompt_token_ids=[1, 2], sampling=common_pb2.SamplingParams(max_tokens=3)
    )
    assert request_from_pb(msg).store_prefix_blocks is None
    msg.store_prefix_blocks = 0
    assert request_from_pb(msg).store_prefix_blocks == 0
    msg.store_prefix_blocks = 9
    assert request_from_pb(msg).store_prefix_blocks == 9


@pytest.mark.parametrize(
    ("params", "computed", "want"),
    [
        pytest.param({STORE_PREFIX_PARAM: 3}, 96, 3, id="engine-cache-covers-it"),
        pytest.param({STORE_PREFIX_PARAM: 3}, 100, 3, id="engine-cache-longer"),
        pytest.param({STORE_PREFIX_PARAM: 0}, 0, 0, id="store-holds-nothing"),
        pytest.param({STORE_PREFIX_PARAM: 4}, 96, None, id="store-holds-more"),
        pytest.param({}, 96, None, id="no-count"),
        pytest.param(None, 96, None, id="no-params"),
        pytest.param({STORE_PREFIX_PARAM: -1}, 96, None, id="negative"),
        pytest.param({STORE_PREFIX_PARAM: "3"}, 96, None, id="not-an-int"),
        pytest.param({STORE_PREFIX_PARAM: True}, 96, None, id="bool"),
    ],
)
def test_a_store_prefix_count_skips_the_lookup_only_when_the_engine_covers_it(
    params, computed, want
):
    assert known_store_prefix(params, computed, 32) == want


def req(source: KvSource | None, tokens: int = 100) -> GenerateRequest:
    return GenerateRequest("r", (1,) * tokens, Sampling(max_tokens=4), kv_source=source)


@pytest.mark.parametrize(
    ("source", "error"),
    [
        pytest.param(None, None, id="none"),
        pytest.param(KvSource("kvm-a", 3), None, id="all-full-blocks"),
        pytest.param(KvSource("kvm-a", 1), None, id="one-block"),
        pytest.param(KvSource("", 3), "kv_source.kvmanager_id", id="no-id"),
        pytest.param(KvSource("k" * 300, 3), "kv_source.kvmanager_id", id="long-id"),
        pytest.param(KvSource("kvm-a", 0), "use 1 to 3", id="no-blocks"),
        pytest.param(KvSource("kvm-a", 4), "the prompt has 3 full blocks", id="beyond-prompt"),
        pytest.param(KvSource("kvm-a", 3, 30.0), None, id="handoff-wait"),
        pytest.param(KvSource("kvm-a", 3, -1.0), "handoff_wait_s is -1.0", id="negative-wait"),
        pytest.param(KvSource("kvm-a", 3, 601.0), "to 600 seconds", id="endless-wait"),
        pytest.param(KvSource("kvm-a", 3, float("nan")), "handoff_wait_s", id="nan-wait"),
        pytest.param(KvSource("kvm-a", 3, 0.0, 0.3), None, id="fetch-budget"),
        pytest.param(KvSource("kvm-a", 3, 0.0, -0.1), "max_fetch_s is -0.1", id="negative-budget"),
        pytest.param(KvSource("kvm-a", 3, 0.0, float("nan")), "max_fetch_s", id="nan-budget"),
    ],
)
def test_kv_source_validation(source, error):
    if error is None:
        check_request(req(source), INFO)
    else:
        with pytest.raises(InvalidArgument, match=error):
            check_request(req(source), INFO)


@pytest.mark.parametrize(
    ("params", "want"),
    [
        pytest.param(PEER.to_params(), PEER, id="round-trip"),
        pytest.param({**PEER.to_params(), "other": 1}, PEER, id="other-keys-kept-apart"),
        pytest.param(None, None, id="no-params"),
        pytest.param({}, None, id="no-hint"),
        pytest.param({KV_SOURCE_PARAM: "kvm-a"}, None, id="not-a-mapping"),
        pytest.param({KV_SOURCE_PARAM: {"kvmanager_id": "", "blocks": 3}}, None, id="no-id"),
        pytest.param({KV_SOURCE_PARAM: {"kvmanager_id": "k", "blocks": 0}}, None, id="no-blocks"),
        pytest.param({KV_SOURCE_PARAM: {"kvmanager_id": "k", "blocks": "3"}}, None, id="str"),
        pytest.param(
            PeerSource("kvm-a", 10, 4.5).to_params(), PeerSource("kvm-a", 10, 4.5), id="wait"
        ),
        pytest.param(
            {KV_SOURCE_PARAM: {"kvmanager_id": "k", "blocks": 3, "wait_s": "long"}},
            PeerSource("k", 3),
            id="bad-wait-is-the-default",
        ),
        pytest.param(
            PeerSource("kvm-a", 10, 0.0, 0.3).to_params(),
            PeerSource("kvm-a", 10, 0.0, 0.3),
            id="budget",
        ),
        pytest.param(
            {KV_SOURCE_PARAM: {"kvmanager_id": "k", "blocks": 3, "max_s": True}},
            PeerSource("k", 3),
            id="bad-budget-is-the-default",
        ),
    ],
)
def test_peer_source_from_params(params, want):
    assert PeerSource.from_params(params) == want


# ---- which blocks to fetch ----------------------------------------------------------------------
@pytest.mark.parametrize(
    ("peer_blocks", "keys", "store", "computed", "tokens", "want"),
    [
        pytest.param(10, 10, 0, 0, 330, range(0, 10), id="cold"),
        pytest.param(10, 10, 4, 0, 330, range(4, 10), id="beyond-the-store"),
        pytest.param(10, 10, 4, 6 * 32, 330, range(4, 10), id="engine-ahead-of-store"),
        pytest.param(10, 10, 0, 10 * 32, 330, range(0), id="engine-has-it"),
        pytest.param(10, 10, 10, 0, 330, range(0), id="store-has-it"),
        pytest.param(10, 10, 12, 0, 330, range(0), id="store-has-more"),
        pytest.param(10, 10, 0, 0, 320, range(0, 9), id="never-the-last-token"),
        pytest.param(10, 6, 0, 0, 330, range(0, 6), id="known-keys-only"),
        pytest.param(10, 10, 0, 0, 32, range(0), id="too-short-to-load"),
    ],
)
def test_peer_fetch_range(peer_blocks, keys, store, computed, tokens, want):
    got = peer_fetch_range(PeerSource("k", peer_blocks), keys, store, computed, tokens, 32)
    assert got == want


# ---- the prefetcher -------------------------------------------------------------------------------
class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


SIX = FetchOutcome(6)


class FakeFetch:
    """Blocks each call until ``release``; records the calls."""

    def __init__(self, outcome: FetchOutcome = SIX) -> None:
        self.outcome = outcome
        self.calls: list[tuple[str, list[int], PeerSource, float]] = []
        self.release = threading.Event()
        self.started = threading.Event()

    def __call__(self, layout_key, keys, peer, timeout_s) -> FetchOutcome:
        self.calls.append((layout_key, list(keys), peer, timeout_s))
        self.started.set()
        self.release.wait(10)
        return self.outcome


def prefetcher(fetch: FakeFetch, clock: Clock, counts: Counter) -> PeerPrefetcher:
    cfg = PeerFetchConfig(timeout_s=2.0, poll_s=0.001)
    return PeerPrefetcher(cfg, fetch, lambda name, n: counts.update({name: n}), clock)


def test_one_fetch_per_request_polled_until_done():
    fetch, clock, counts = FakeFetch(), Clock(), Counter()
    pf = prefetcher(fetch, clock, counts)
    try:
        assert pf.start("r1", PEER, ["L"], [5, 6, 7])
        assert not pf.start("r1", PEER, ["L"], [5, 6, 7])  # once per request
        assert not pf.start("r2", PEER, ["L"], [])  # nothing to fetch
        assert fetch.started.wait(5)
        assert pf.pending("r1")  # in flight, within its time
        assert not pf.pending("r2")
        fetch.release.set()
        for _ in range(1000):
            if not pf.pending("r1"):
                break
        assert not pf.pending("r1") and not pf.start("r1", PEER, ["L"], [5])
        assert fetch.calls == [("L", [5, 6, 7], PEER, 2.0)]
        assert counts == Counter(peer_fetches=1, peer_fetch_blocks=6)
        pf.forget("r1")
        assert len(pf) == 0
    finally:
        fetch.release.set()
        pf.close()


def test_a_fetch_past_its_time_is_not_waited_for():
    fetch, clock, counts = FakeFetch(), Clock(), Counter()
    pf = prefetcher(fetch, clock, counts)
    try:
        assert pf.start("r1", PEER, ["L"], [5, 6])
        assert pf.pending("r1")
        clock.t += 2.5  # past timeout_s
        assert not pf.pending("r1")
        assert not pf.pending("r1")  # settled: counted once
        assert counts == Counter(peer_fetches=1, peer_fetch_timeouts=1)
    finally:
        fetch.release.set()
        pf.close()


def test_a_hint_with_its_own_wait_is_waited_for_that_much_longer():
    """An overlapped hand-off: the prefill still runs elsewhere, so the request waits for its
    blocks up to the hint's wait plus the usual time for the last fetch."""
    fetch, clock, counts = FakeFetch(), Clock(), Counter()
    pf = prefetcher(fetch, clock, counts)
    peer = PeerSource("kvm-a", 10, 5.0)
    try:
        assert pf.start("r1", peer, ["L"], [5, 6])
        assert fetch.started.wait(5)
        clock.t += 6.5  # past timeout_s (2), within wait + timeout_s (7)
        assert pf.pending("r1")
        clock.t += 1.0
        assert not pf.pending("r1")
        assert fetch.calls[0][3] == pytest.approx(7.0)  # the fetch's own deadline
        assert counts == Counter(peer_fetches=1, peer_fetch_timeouts=1)
    finally:
        fetch.release.set()
        pf.close()


def test_a_hint_with_a_budget_gives_up_there():
    """The router priced the fetch: past the time recomputing its blocks would take, waiting is
    a loss, so the request goes ahead with what arrived (sooner than timeout_s); a budget longer
    than timeout_s changes nothing."""
    fetch, clock, counts = FakeFetch(), Clock(), Counter()
    pf = prefetcher(fetch, clock, counts)
    try:
        assert pf.start("r1", PeerSource("kvm-a", 10, 0.0, 0.3), ["L"], [5, 6])
        assert pf.start("r2", PeerSource("kvm-a", 10, 0.0, 9.0), ["L"], [5, 6])
        deadline = time.monotonic() + 5
        while len(fetch.calls) < 2 and time.monotonic() < deadline:  # both on the pool
            time.sleep(0.01)
        clock.t += 0.2
        assert pf.pending("r1")
        clock.t += 0.2  # past r1's budget, within timeout_s
        assert not pf.pending("r1") and pf.pending("r2")
        clock.t += 1.7
        assert not pf.pending("r2")
        deadlines = sorted(call[3] for call in fetch.calls)
        assert deadlines == [pytest.approx(0.3), pytest.approx(2.0)]  # the fetches' deadlines
        assert counts == Counter(peer_fetches=2, peer_fetch_timeouts=2)
    finally:
        fetch.release.set()
        pf.close()


@pytest.mark.parametrize(
    ("outcome", "want"),
    [
        pytest.param(FetchOutcome(0, "NOT_FOUND"), Counter(peer_fetch_failures=1), id="unknown"),
        pytest.param(
            FetchOutcome(2, "UNAVAILABLE"),
            Counter(peer_fetch_blocks=2, peer_fetch_failures=1),
            id="broke-midway",
        ),
    ],
)
def test_failures_are_counted_and_only_a_miss(outcome, want):
    fetch, clock, counts = FakeFetch(outcome), Clock(), Counter()
    fetch.release.set()
    pf = prefetcher(fetch, clock, counts)
    try:
        assert pf.start("r1", PEER, ["L"], [5, 6])
        for _ in range(1000):
            if not pf.pending("r1"):
                break
        assert counts == Counter(peer_fetches=1) + want
    finally:
        pf.close()


def test_tp_ranks_fetch_each_layout_and_count_the_least():
    outcomes = iter([FetchOutcome(3), FetchOutcome(2, "UNAVAILABLE")])
    calls = []

    def fetch(key, keys, peer, timeout_s):
        calls.append(key)
        return next(outcomes)

    counts: Counter = Counter()
    pf = PeerPrefetcher(PeerFetchConfig(poll_s=1.0), fetch, lambda n, c: counts.update({n: c}))
    try:
        assert pf.start("r", PEER, ["rank0", "rank1"], [1, 2, 3])
        assert not pf.pending("r")
        assert calls == ["rank0", "rank1"]
        assert counts == Counter(peer_fetches=1, peer_fetch_blocks=2, peer_fetch_failures=1)
    finally:
        pf.close()


def test_config():
    assert PeerFetchConfig.from_extra(None) == PeerFetchConfig()
    assert PeerFetchConfig.from_extra({"timeout_s": 0.5}).timeout_s == 0.5
    with pytest.raises(ValueError, match="unknown peer_fetch keys"):
        PeerFetchConfig.from_extra({"timeout": 1})
    with pytest.raises(ValueError, match="timeout_s"):
        PeerFetchConfig(timeout_s=0)
    with pytest.raises(ValueError, match="max_concurrent"):
        PeerFetchConfig(max_concurrent=0)
    kvm = StoreConfig(store="kvmanager", store_path="h:1")
    directory = StoreConfig(store="directory", store_path="/tmp/x")
    assert PeerFetchConfig().address(kvm) == "h:1"
    assert PeerFetchConfig(kvmanager="h:2").address(directory) == "h:2"
    assert PeerFetchConfig().address(directory) == ""
    assert make_prefetcher(PeerFetchConfig(), directory) is None
    assert make_prefetcher(PeerFetchConfig(enabled=False), kvm) is None
    pf = make_prefetcher(PeerFetchConfig(), kvm)
    assert pf is not None
    pf.close()


def test_a_kvmanager_that_is_not_there_is_a_failure_not_an_error():
    """The real fetcher against a closed port: UNAVAILABLE, 0 blocks, no exception."""
    from services.worker.connector.peer_prefetch import KvManagerFetcher

    fetcher = KvManagerFetcher("127.0.0.1:9")
    key = (
        "kvmesh-kv1;model=tiny;block_size=32;num_layers=2;num_kv_heads=2;head_size=32;"
        "dtype=float32;tp_rank=0;tp_size=1;device=cpu"
    )
    try:
        got = fetcher(key, [1, 2], PEER, 1.0)
    finally:
        fetcher.close()
    assert got.fetched == 0 and got.error in ("UNAVAILABLE", "DEADLINE_EXCEEDED")
