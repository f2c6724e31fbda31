"""The generated coding-agent sessions: deterministic per seed, contexts that grow, sub-agents
that share their session's prefix, and the reuse the published studies report."""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest

from benchmarks.replay.agentic import AgenticConfig, agentic_sessions
from benchmarks.replay.traces import stream_stats

SMALL = AgenticConfig(
    sessions=6,
    start_window_s=60.0,
    system_prompt_tokens=2_000,
    first_prompt_tokens=(2_000, 4_000),
    window_tokens=40_000,
    early_end_tokens=(20_000, 40_000),
    burst_probability=0.3,
)


@pytest.fixture(scope="module")
def small():
    return list(agentic_sessions(SMALL))


def test_deterministic_per_seed(small):
    assert list(agentic_sessions(SMALL)) == small
    other = list(agentic_sessions(replace(SMALL, seed=1)))
    assert [r.block_hashes for r in other] != [r.block_hashes for r in small]


def test_arrival_order_and_window(small):
    assert [r.arrival_s for r in small] == sorted(r.arrival_s for r in small)
    assert all(0 < r.input_tokens <= SMALL.window_tokens for r in small)
    assert all(len(r.block_hashes) == r.input_tokens // SMALL.block_size for r in small)
    assert all(20 <= r.output_tokens <= 4_000 for r in small)


def test_a_session_resends_its_growing_context(small):
    mains = {}
    for r in small:
        if "/" not in r.session_id:
            mains.setdefault(r.session_id, []).append(r)
    assert len(mains) == SMALL.sessions
    for turns in mains.values():
        assert len(turns) > 3
        for prev, cur in itertools.pairwise(turns):
            assert cur.input_tokens > prev.input_tokens
            assert cur.block_hashes[: len(prev.block_hashes)] == prev.block_hashes
            assert cur.arrival_s > prev.arrival_s
    system_blocks = SMALL.system_prompt_tokens // SMALL.block_size
    firsts = [turns[0].block_hashes for turns in mains.values()]
    assert len({f[:system_blocks] for f in firsts}) == 1  # one system prompt for all
    assert len({f[system_blocks] for f in firsts}) == len(firsts)  # then their own


def test_sub_agents_share_their_session_prefix(small):
    subs = [r for r in small if "/" in r.session_id]
    assert subs, "the config should produce bursts"
    last_main = {}
    checked = set()
    for r in small:
        if "/" not in r.session_id:
            last_main[r.session_id] = r
            continue
        session, _agent = r.session_id.split("/")
        if r.session_id in checked:
            continue
        checked.add(r.session_id)
        parent = last_main[session]  # the turn that started the burst
        assert r.block_hashes[: len(parent.block_hashes)] == parent.block_hashes
        assert r.input_tokens > parent.input_tokens
    # A burst's agents share the session's context, then diverge.
    starts = {}
    for r in subs:
        starts.setdefault(r.session_id, r)
    by_session = {}
    for sid, r in starts.items():
        by_session.setdefault(sid.split("/")[0], []).append(r)
    pairs = [rs for rs in by_session.values() if len(rs) > 1]
    assert pairs
    a, b = pairs[0][:2]
    n = min(len(a.block_hashes), len(b.block_hashes))
    assert a.block_hashes[: n // 2] == b.block_hashes[: n // 2]
    assert a.block_hashes[n - 1] != b.block_hashes[n - 1]


def test_reuse_and_context_sizes_at_default_scale():
    stats = stream_stats(agentic_sessions(AgenticConfig(sessions=8)))
    assert stats.reuse90_fraction >= 0.93  # published studies: 96% of requests
    assert 150_000 <= stats.median_input_late <= 200_000
    assert 250 <= stats.median_output <= 350
    assert stats.ceiling > 0.9
