"""The prefill/decode decision (services/router/core/disagg.py): threshold on the decode pick's
uncached prompt, role selection for each stage, and the cases that stay aggregated; and the
error a client gets when the decode worker fails with no one to take over
(services/router/disagg.py)."""

from __future__ import annotations

import random

import grpc
import pytest

from kvmesh.discovery.keys import Role, WorkerId
from kvmesh.errors import InvalidArgument, Unavailable
from kvmesh.grpc_errors import status_for
from services.router.core.disagg import DisaggConfig, DisaggHandler, Reason
from services.router.core.routing import make_policy
from services.router.core.scheduler import Matched
from services.router.disagg import decode_failed
from tests.unit.scheduler_fakes import BLOCK, FakeIndex, gpu, request, view

P, D, B = Role.PREFILL, Role.DECODE, Role.BOTH


def handler(
    matches: dict[str, Matched] | None = None,
    threshold: int = 100,
    handoff: set[str] | None = None,
    enabled: bool = True,
) -> DisaggHandler:
    policy = make_policy("precise-prefix", index=FakeIndex(matches), rng=random.Random(0))
    return DisaggHandler(
        DisaggConfig(enabled=enabled, threshold_tokens=threshold),
        policy,
        can_hand_off=(lambda w: handoff is None or w in handoff),
    )


# prompt of 20 blocks of 16 tokens + 5 = 325 tokens
CASES = [
    # id, workers (id, role, waiting), matches, threshold, handoff,
    #   expected (decode, prefill or None, reason, uncached)
    pytest.param(
        [("p0", P, 0), ("d0", D, 0)],
        {},
        100,
        None,
        ("d0", "p0", Reason.DISAGGREGATED, 325),
        id="cold-long-prompt-disaggregates",
    ),
    pytest.param(
        [("p0", P, 0), ("d0", D, 0)],
        {"d0": gpu(15)},
        100,
        None,
        ("d0", None, Reason.BELOW_THRESHOLD, 85),
        id="decode-holds-most-stays-aggregated",
    ),
    pytest.param(
        [("p0", P, 0), ("d0", D, 0)],
        {"d0": gpu(14)},
        100,
        None,
        ("d0", "p0", Reason.DISAGGREGATED, 101),
        id="threshold-is-inclusive",
    ),
    pytest.param(
        [("b0", B, 0), ("b1", B, 0)],
        {},
        100,
        None,
        ("?", None, Reason.NO_PREFILL_WORKERS, 325),
        id="both-only-mesh-never-disaggregates",
    ),
    pytest.param(
        [("p0", P, 0), ("d0", D, 0)],
        {},
        100,
        set(),
        ("d0", None, Reason.NO_PREFILL_CANDIDATE, 325),
        id="prefill-without-kvmanager",
    ),
    pytest.param(
        [("p0", P, 0), ("p1", P, 0), ("d0", D, 0)],
        {"p1": gpu(10)},
        100,
        None,
        ("d0", "p1", Reason.DISAGGREGATED, 325),
        id="prefill-by-prefix-score",
    ),
    pytest.param(
        [("p0", P, 0), ("d0", D, 6), ("d1", D, 0)],
        {},
        100,
        None,
        ("d1", "p0", Reason.DISAGGREGATED, 325),
        id="decode-by-load",
    ),
    pytest.param(
        [("p0", P, 0), ("d0", D, 0), ("d1", D, 0)],
        {"d1": gpu(3), "p0": gpu(1)},
        100,
        None,
        ("d1", "p0", Reason.DISAGGREGATED, 277),
        id="decode-by-what-it-holds",
    ),
    pytest.param(
        [("p0", P, 0), ("b0", B, 0)],
        {},
        100,
        None,
        ("b0", "p0", Reason.DISAGGREGATED, 325),
        id="both-worker-decodes",
    ),
    pytest.param(
        [("p0", P, 0), ("b0", B, 0), ("d0", D, 9)],
        {"b0": gpu(2)},
        100,
        None,
        ("b0", "p0", Reason.DISAGGREGATED, 293),
        id="prefill-never-the-decode-pick",
    ),
]


@pytest.mark.parametrize(("workers", "matches", "threshold", "handoff", "expected"), CASES)
def test_decision(workers, matches, threshold, handoff, expected) -> None:
    cands = [view(w, role=r, waiting=q) for w, r, q in workers]
    d = handler(matches, threshold, handoff).decide(request(20), cands)
    want_decode, want_prefill, want_reason, want_uncached = expected
    if want_decode != "?":
        assert d.decode.worker_id == want_decode
    assert (d.prefill.worker_id if d.prefill else None) == want_prefill
    assert d.reason is want_reason
    assert d.uncached_tokens == want_uncached
    assert d.disaggregated is (want_prefill is not None)
    # roles: the decode pick can decode, the prefill pick can prefill
    roles = {WorkerId(w): r for w, r, _ in workers}
    assert roles[d.decode.worker_id] in (D, B)
    if d.prefill is not None:
        assert roles[d.prefill.worker_id] in (P, B)
        assert d.prefill.worker_id != d.decode.worker_id


def test_disabled_serves_aggregated_on_a_decode_worker() -> None:
    d = handler(enabled=False).decide(request(20), [view("p0", role=P), view("d0", role=D)])
    assert (d.decode.worker_id, d.prefill, d.reason) == ("d0", None, Reason.DISABLED)


def test_prefill_only_mesh_is_unavailable_with_a_hint() -> None:
    with pytest.raises(Unavailable, match="--role decode"):
        handler().decide(request(20), [view("p0", role=P)])


def test_pick_decode_excludes_prefill_workers() -> None:
    h = handler({"p0": gpu(20)})
    for _ in range(5):
        assert h.pick_decode(request(20), [view("p0", role=P), view("d0", role=D)]).worker_id == (
            "d0"
        )


def test_uncached_counts_the_node_store_tiers() -> None:
    m = Matched(blocks=20, gpu_blocks=0, cpu_blocks=20)
    d = handler({"d0": m}).decide(request(20), [view("p0", role=P), view("d0", role=D)])
    assert d.reason is Reason.BELOW_THRESHOLD
    assert d.uncached_tokens == 325 - 20 * BLOCK


@pytest.mark.parametrize(
    "kw", [{"threshold_tokens": 0}, {"prefill_timeout_s": 0.0}], ids=["threshold", "timeout"]
)
def test_config_is_checked(kw) -> None:
    with pytest.raises(InvalidArgument):
        DisaggConfig(**kw)


@pytest.mark.parametrize(
    ("code", "details", "streamed", "says"),
    [
        # what a SIGKILLed worker's connection says mid-stream (tests/e2e/test_disagg_failures.py)
        (grpc.StatusCode.UNAVAILABLE, "Socket closed", 37, "after 37 streamed token(s)"),
        (grpc.StatusCode.INTERNAL, "engine died", 1, "after 1 streamed token(s)"),
        (grpc.StatusCode.CANCELLED, "", 5, "(CANCELLED: no details)"),
        (grpc.StatusCode.UNAVAILABLE, "failed to connect", 0, "no other worker could take"),
    ],
    ids=["killed-mid-stream", "internal-mid-stream", "cancelled-by-worker", "none-left-before"],
)
def test_a_failed_decode_worker_is_a_retryable_unavailable(code, details, streamed, says) -> None:
    exc = decode_failed(WorkerId("decode-1"), code, details, streamed)
    assert status_for(exc) is grpc.StatusCode.UNAVAILABLE
    msg = str(exc)
    assert says in msg
    assert "worker decode-1" in msg and "retry the request" in msg
    assert details in msg
