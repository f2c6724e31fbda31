"""The kvmanager's measured transfer speeds (services/kvmanager/core/rates.py) and how they
travel on its etcd record (KvManagerRecord.transfer_s_per_token) to the routers."""

from __future__ import annotations

import json

import pytest

from kvmesh.discovery.keys import KvManagerRecord
from services.kvmanager.core.rates import Transfer, TransferMeter, moved
from services.router.core.node_stores import KvManagerSet

L1, L2 = "00000000000000aa", "00000000000000bb"


@pytest.mark.parametrize(
    ("samples", "want"),
    [
        pytest.param([], 0.0, id="nothing-yet"),
        pytest.param([(50, 1.0)], 0.0, id="under-min-waits"),
        pytest.param([(50, 1.0), (50, 1.0)], 0.02, id="pending-joins-the-next"),
        pytest.param([(100, 1.0), (100, 3.0)], 0.01 + 0.5 * (0.03 - 0.01), id="moving-average"),
        pytest.param([(100, 1.0), (0, 5.0), (100, 0.0)], 0.01, id="empty-or-timeless-ignored"),
    ],
)
def test_meter(samples, want):
    m = TransferMeter(min_sample_tokens=100, half_life_samples=1.0, min_sample_s=100.0)
    for tokens, seconds in samples:
        m.add(L1, Transfer.CPU, tokens, seconds)
    assert m.s_per_token(L1, Transfer.CPU) == pytest.approx(want)
    assert m.s_per_token(L1, Transfer.PEER) == 0.0


def test_a_slow_call_is_a_sample_on_its_own():
    """Under min_sample_tokens but past min_sample_s: a slow link says so in one call."""
    m = TransferMeter(min_sample_tokens=4096, half_life_samples=1.0, min_sample_s=0.25)
    m.add(L1, Transfer.PEER, 640, 0.01)  # fast and small: waits
    assert m.s_per_token(L1, Transfer.PEER) == 0.0
    m.add(L1, Transfer.PEER, 224, 1.8)  # took long enough: a sample, not mixed with the quick
    assert m.s_per_token(L1, Transfer.PEER) == pytest.approx(1.8 / 224)
    m.add(L1, Transfer.PEER, 640, 0.1)  # the quick ones go on adding up: 1280 tokens in 0.11 s
    m.add(L1, Transfer.PEER, 2816, 0.01)  # ... 4096 tokens in 0.12 s: a sample
    assert m.s_per_token(L1, Transfer.PEER) == pytest.approx((1.8 / 224 + 0.12 / 4096) / 2)


def test_peer_fetches_are_measured_per_link():
    m = TransferMeter(min_sample_tokens=100, min_sample_s=100.0)
    m.add(L1, Transfer.PEER, 100, 0.01, source="kvm-a")  # a fast link
    m.add(L1, Transfer.PEER, 100, 1.0, source="kvm-b")  # a slow one
    m.add(L1, Transfer.CPU, 100, 0.001, source="kvm-a")  # only peer fetches have a source
    assert m.s_per_token(L1, Transfer.PEER, "kvm-a") == pytest.approx(1e-4)
    assert m.s_per_token(L1, Transfer.PEER, "kvm-b") == pytest.approx(1e-2)
    # The kind's own rate averages both links (what the TTFT scorer prices a fetch with).
    assert 1e-4 < m.s_per_token(L1, Transfer.PEER) < 1e-2
    assert m.snapshot() == {L1: {"cpu": 1e-5, "peer": m.s_per_token(L1, Transfer.PEER)}}
    assert m.peer_snapshot() == {"kvm-a": {L1: 1e-4}, "kvm-b": {L1: 1e-2}}
    peers = m.peer_snapshot()
    assert not moved(peers, {**peers, "kvm-a": {L1: 1.1e-4}})
    assert moved(peers, {**peers, "kvm-b": {L1: 5e-3}})  # the slow link got faster
    assert moved(peers, {**peers, "kvm-c": {L1: 1e-3}})  # a new link


def test_snapshot_per_layout_and_kind_and_when_to_publish():
    m = TransferMeter(min_sample_tokens=10, min_sample_s=100.0)
    m.add(L1, Transfer.CPU, 10, 0.001)
    m.add(L1, Transfer.PEER, 20, 0.01)
    m.add(L2, Transfer.DISK, 5, 1.0)  # waits for more
    snap = m.snapshot()
    assert snap == {L1: {"cpu": 1e-4, "peer": 5e-4}}
    assert moved({}, snap)
    assert not moved(snap, {L1: {"cpu": 1.1e-4, "peer": 5e-4}})  # noise: not rewritten
    assert moved(snap, {L1: {"cpu": 1.3e-4, "peer": 5e-4}})
    assert moved(snap, {**snap, L2: {"disk": 0.1}})  # a new kind


def test_the_record_carries_them_and_routers_read_them():
    rec = KvManagerRecord("kvm-1", "h:1", "n1", transfer_s_per_token={L1: {"cpu": 2e-6}})
    back = KvManagerRecord.from_json(rec.to_json())
    assert back == rec
    # An older kvmanager's record has none; a malformed one keeps only what is well formed.
    assert KvManagerRecord.from_json('{"kvmanager_id": "k", "address": "a", "node": "n"}') == (
        KvManagerRecord("k", "a", "n")
    )
    raw = json.loads(rec.to_json())
    raw["transfer_s_per_token"] = {L1: {"cpu": -1, "disk": "x", "peer": 3e-6}, L2: 7, 5: {}}
    assert KvManagerRecord.from_json(json.dumps(raw)).transfer_s_per_token == {L1: {"peer": 3e-6}}
    # Per-link peer speeds travel the same way.
    rec = KvManagerRecord(
        "kvm-1",
        "h:1",
        "n1",
        transfer_s_per_token={L1: {"cpu": 2e-6}},
        peer_s_per_token={"kvm-2": {L1: 8e-3}},
    )
    back = KvManagerRecord.from_json(rec.to_json())
    assert back == rec
    raw = json.loads(rec.to_json())
    raw["peer_s_per_token"] = {"kvm-2": {L1: 8e-3, L2: float("nan")}, "kvm-3": []}
    assert KvManagerRecord.from_json(json.dumps(raw)).peer_s_per_token == {"kvm-2": {L1: 8e-3}}
    kvms = KvManagerSet()
    kvms.apply_put(back)
    assert kvms.peer_s_per_token("kvm-1", "kvm-2", L1) == 8e-3
    assert kvms.peer_s_per_token("kvm-1", "kvm-3", L1) == 0.0
    assert kvms.peer_s_per_token("kvm-2", "kvm-1", L1) == 0.0  # a link has a direction
    assert kvms.s_per_token("kvm-1", L1, "cpu") == 2e-6
    assert kvms.s_per_token("kvm-1", L1, "peer") == 0.0
    assert kvms.s_per_token("kvm-1", L2, "cpu") == 0.0
    assert kvms.s_per_token("kvm-2", L1, "cpu") == 0.0
