"""Session retention in the replay (benchmarks/replay/retention.py): a node store keeps retained
blocks past pressure that an LRU would evict them under, and a session's next turn after a flood
of one-off requests is fully cached with retention, not without."""

from __future__ import annotations

from dataclasses import replace

import pytest

from benchmarks.replay.driver import replay
from benchmarks.replay.mesh import MeshConfig
from benchmarks.replay.policies import RoundRobin
from benchmarks.replay.retention import ReplayRetention, RetainingNodeStore, background
from benchmarks.replay.traces import ReplayRequest
from kvmesh.kv.events import BlockHash

from .test_replay_driver import CFG

H = tuple(BlockHash(b) for b in range(100, 120))


def test_retained_blocks_leave_ram_for_disk_last_and_never_leave_disk():
    s = RetainingNodeStore(cpu_blocks=2, disk_blocks=4, block_size=4)
    s.retained |= {H[0], H[1], H[2]}
    s.save(H[:3])  # RAM holds only retained blocks: the oldest goes to disk
    assert list(s.cpu) == [H[1], H[2]] and list(s.disk) == [H[0]]
    s.save(H[3:12])  # unretained blocks turn both tiers over; the retained ones stay
    assert H[1] in s.cpu and H[2] in s.cpu and H[0] in s.disk
    assert H[3] not in s and len(s.disk) == 4


def test_ram_only_retained_blocks_stay_in_ram():
    s = RetainingNodeStore(cpu_blocks=4, disk_blocks=0, block_size=4)
    s.retained.add(H[0])
    s.save(H[:1])
    s.save(H[1:10])
    assert H[0] in s.cpu and len(s.cpu) == 4


def turn(t: float, session: str, blocks: tuple[int, ...]) -> ReplayRequest:
    return ReplayRequest(t, session, tuple(BlockHash(b) for b in blocks), 4 * len(blocks) + 1, 1)


TRACE = [
    turn(0, "s", (1, 2, 3, 4)),
    *(turn(1 + i, "", tuple(range(100 + 4 * i, 104 + 4 * i))) for i in range(5)),  # a flood
    turn(10, "s", (1, 2, 3, 4, 5)),
]


@pytest.mark.parametrize(("budget", "kept"), [(0, 0.0), (4, 1.0)], ids=["lru", "retention"])
def test_the_next_turn_after_a_flood(budget: int, kept: float):
    mesh = MeshConfig(workers_per_node=1, cpu_blocks=8)
    hooks = ReplayRetention(budget, ttl_s=60)
    cfg = replace(CFG, capacity_blocks=8)
    replay(TRACE, RoundRobin(), workers=1, config=cfg, mesh=mesh, retention=hooks)
    r = hooks.result
    assert r is not None and r.follow_ups == 1 and r.kept_rate == kept


def test_a_budget_over_half_the_tier_is_refused():
    with pytest.raises(ValueError, match="over half"):
        ReplayRetention(5).store(8, 0, 4, None)


def test_background_requests_are_unique_and_evenly_spaced():
    reqs = list(background(2.0, 64, 32, 3.0))
    assert [r.arrival_s for r in reqs] == [0.0, 0.5, 1.0, 1.5, 2.0, 2.5]
    assert len({h for r in reqs for h in r.block_hashes}) == 12
    assert all(r.session_id == "" for r in reqs)
