"""Priced peer hints (``services/router/core/peer_cost.py``): a fetch from a peer over the
measured speed of that link against recomputing at the worker's measured prefill speed; probes of
a link skipped as slow; the fetch budget a hint carries. And ``PeerHints.decide`` with a price."""

from __future__ import annotations

import pytest

from kvmesh.errors import InvalidArgument
from services.router.core.peer_cost import PeerCost, PeerCostConfig, PeerOption
from services.router.core.peers import PeerHintConfig, PeerHints
from services.router.core.types import LoadSnapshot, PeerHint, RouteDecision

from .test_router_peers import KA, KC, PROMPT, B, mesh

L1 = "00112233aabbccdd"
BS = 32
PREFILL = 1e-4  # s/token: the tiny model's order on these cores
FAST, SLOW = 2e-5, 8e-3  # s/token: a veth link; the same at 512 kbit/s


class Rates:
    """What the kvmanagers published: (fetcher, peer) -> link s/token, fetcher -> cpu s/token."""

    def __init__(self, links: dict[tuple[str, str], float], cpu: dict[str, float] | None = None):
        self.links = links
        self.cpu = cpu or {}

    def s_per_token(self, kvmanager_id: str, layout_key: str, kind: str) -> float:
        return self.cpu.get(kvmanager_id, 0.0) if kind == "cpu" else 0.0

    def peer_s_per_token(self, kvmanager_id: str, peer_id: str, layout_key: str) -> float:
        return self.links.get((kvmanager_id, peer_id), 0.0)


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def cost(rates: Rates | None, **cfg) -> PeerCost:
    """A worker whose prefill speed is known (PREFILL): the default stands in for it."""
    cfg.setdefault("default_prefill_s_per_token", PREFILL)
    cfg.setdefault("latency_s", 0.0)
    return PeerCost(rates, lambda _w: None, PeerCostConfig(**cfg), clock=Clock())


def price(c: PeerCost, peers: list[tuple[str, int]], local: int = 0):
    return c.price("w", "kvm-b", L1, BS, local, peers, 4)


CASES = [
    pytest.param({}, [("kvm-a", 20)], "kvm-a", None, id="unmeasured-link-is-tried"),
    pytest.param({("kvm-b", "kvm-a"): FAST}, [("kvm-a", 20)], "kvm-a", None, id="fast-link"),
    pytest.param({("kvm-b", "kvm-a"): SLOW}, [("kvm-a", 20)], None, "kvm-a", id="slow-link"),
    pytest.param(
        {("kvm-b", "kvm-a"): SLOW, ("kvm-b", "kvm-c"): FAST},
        [("kvm-a", 20), ("kvm-c", 16)],
        "kvm-c",
        "kvm-a",
        id="slow-longest-fast-shorter",
    ),
    pytest.param(
        {("kvm-b", "kvm-a"): FAST, ("kvm-b", "kvm-c"): FAST},
        [("kvm-a", 20), ("kvm-c", 16)],
        "kvm-a",
        None,
        id="both-fast-longest",
    ),
    pytest.param(
        {("kvm-a", "kvm-b"): SLOW}, [("kvm-a", 20)], "kvm-a", None, id="a-link-has-a-direction"
    ),
    pytest.param({}, [("kvm-a", 3)], None, None, id="gain-below-min"),
]


@pytest.mark.parametrize(("links", "peers", "chosen", "skipped"), CASES)
def test_the_cheapest_source_wins(links, peers, chosen, skipped):
    p = price(cost(Rates(links)), peers)
    assert (p.chosen.kvmanager_id if p.chosen else None) == chosen
    assert (p.skipped.kvmanager_id if p.skipped else None) == skipped
    assert not p.probe


def test_the_prices():
    c = cost(Rates({("kvm-b", "kvm-a"): SLOW, ("kvm-b", "kvm-c"): FAST}, {"kvm-b": 1e-5}))
    p = price(c, [("kvm-a", 20), ("kvm-c", 16)], local=4)
    assert p.recompute_s == pytest.approx(16 * BS * PREFILL)
    # The link plus the CPU tier's load into the engine; the rest (to kvm-a's 20) recomputed.
    want_c = 12 * BS * (FAST + 1e-5) + 4 * BS * PREFILL
    assert p.chosen == PeerOption(
        "kvm-c", 16, pytest.approx(12 * BS * (FAST + 1e-5)), pytest.approx(want_c), True
    )  # type: ignore[arg-type]
    assert p.skipped is not None and p.skipped.fetch_s == pytest.approx(16 * BS * (SLOW + 1e-5))
    # Its budget: recomputing the 12 blocks it brings, or the floor when that is less.
    assert p.max_fetch_s == pytest.approx(max(0.25, 12 * BS * PREFILL))
    big = price(cost(Rates({}), budget_floor_s=0.01), [("kvm-a", 200)])
    assert big.max_fetch_s == pytest.approx(200 * BS * PREFILL)


def test_the_workers_measured_prefill_speed_decides():
    """A link that beats a slow engine's recompute loses to a fast engine's."""
    link = {("kvm-b", "kvm-a"): 5e-4}
    loads: dict[str, LoadSnapshot] = {}
    c = PeerCost(
        Rates(link),
        loads.get,
        PeerCostConfig(default_prefill_s_per_token=1e-3, min_sample_tokens=100, latency_s=0.0),
    )
    assert price(c, [("kvm-a", 20)]).chosen is not None  # 5e-4 < the default 1e-3
    loads["w"] = LoadSnapshot(prefill_computed_tokens=50, prefill_s=0.1)
    price(c, [("kvm-a", 20)])  # the first report (under min_sample_tokens): counters to start from
    loads["w"] = LoadSnapshot(prefill_computed_tokens=10050, prefill_s=0.2)  # 1e-5 s/token
    p = price(c, [("kvm-a", 20)])
    assert p.chosen is None and p.skipped is not None
    assert p.recompute_s == pytest.approx(20 * BS * 1e-5)


def test_a_link_skipped_as_slow_is_probed_once_per_interval():
    clock = Clock()
    c = PeerCost(
        Rates({("kvm-b", "kvm-a"): SLOW}),
        lambda _w: None,
        PeerCostConfig(default_prefill_s_per_token=PREFILL, probe_interval_s=30.0),
        clock=clock,
    )
    assert price(c, [("kvm-a", 20)]).chosen is None  # the first skip starts the interval
    clock.t += 29.0
    assert price(c, [("kvm-a", 20)]).chosen is None
    clock.t += 1.0
    p = price(c, [("kvm-a", 20)])
    assert p.probe and p.chosen is not None and p.chosen.kvmanager_id == "kvm-a"
    assert p.max_fetch_s == pytest.approx(0.25)  # bounded like any hint
    assert price(c, [("kvm-a", 20)]).chosen is None  # once
    clock.t += 30.0
    assert price(c, [("kvm-a", 20)]).probe
    never = cost(Rates({("kvm-b", "kvm-a"): SLOW}), probe_interval_s=0.0)
    for _ in range(3):
        never._clock = lambda: 1e9  # type: ignore[method-assign]
        assert price(never, [("kvm-a", 20)]).chosen is None


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("latency_s", -1.0),
        ("probe_interval_s", float("inf")),
        ("budget_floor_s", float("nan")),
        ("default_prefill_s_per_token", 0.0),
        ("min_sample_tokens", 0),
    ],
)
def test_bad_config_says_what_to_fix(field, value):
    with pytest.raises(InvalidArgument, match=field):
        PeerCostConfig(**{field: value})


# ---- PeerHints.decide with a price ---------------------------------------------------------
def hints(rates: Rates | None, **cfg) -> PeerHints:
    return PeerHints(
        mesh(peers={KA: 20, KC: 16}), PeerHintConfig(), cost(rates, **cfg), lambda _w: BS
    )


def test_decide_names_the_fast_peer_and_says_which_was_skipped():
    slow_a = Rates({("kvm-b", "kvm-a"): SLOW, ("kvm-b", "kvm-c"): FAST})
    got = hints(slow_a).decide(PROMPT, B)
    assert got.hint is not None and got.hint.kvmanager_id == "kvm-c" and got.hint.blocks == 16
    assert got.hint.max_fetch_s == pytest.approx(0.25) and not got.hint.probe
    assert got.skipped is not None and got.skipped.kvmanager_id == "kvm-a"
    both_slow = Rates({("kvm-b", "kvm-a"): SLOW, ("kvm-b", "kvm-c"): SLOW})
    got = hints(both_slow).decide(PROMPT, B)
    assert got.hint is None and got.skipped is not None and got.skipped.kvmanager_id == "kvm-a"
    d = RouteDecision(B, "p", "r", peer_skipped=got.skipped)
    assert "peer_skipped=kvm-a peer_blocks=20 fetch_s=" in d.details()
    assert d.attributes()["peer_skipped"] == "kvm-a"


def test_decide_unpriced_is_the_plain_hint():
    """No rates, pricing off, or no block size: the longest peer, as without a price."""
    plain = PeerHint("kvm-a", 20, 0)
    assert hints(None).decide(PROMPT, B).hint == plain
    assert hints(Rates({("kvm-b", "kvm-a"): SLOW}), enabled=False).decide(PROMPT, B).hint == plain
    no_bs = PeerHints(mesh(peers={KA: 20}), cost=cost(Rates({})), block_size_of=lambda _w: 0)
    assert no_bs.decide(PROMPT, B).hint == plain
