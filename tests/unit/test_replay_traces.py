"""Request streams for replays: Mooncake hash ids expanded into engine blocks, and the
properties of a stream (ceiling, reuse) that no cache affects."""

from __future__ import annotations

import json

import pytest

from benchmarks.replay.traces import (
    MOONCAKE_TRACE,
    Ceiling,
    MooncakeExpander,
    ReplayRequest,
    expand_hash_ids,
    load_mooncake,
    quantile,
    stream_stats,
)


def test_equal_ids_give_equal_blocks_and_distinct_ids_distinct_ones():
    a = expand_hash_ids([7, 8, 9], 3 * 512, block_size=32)
    b = expand_hash_ids([7, 8, 10], 3 * 512, block_size=32)
    assert len(a) == 48 and len(set(a)) == 48
    assert a[:32] == b[:32] and not set(a[32:]) & set(b[32:])
    assert a[16:32] == MooncakeExpander(32).blocks_of(8)
    assert all(0 <= x < 2**64 for x in a)


@pytest.mark.parametrize(
    ("tokens", "block_size", "blocks"),
    [
        (512, 32, 16),
        (1000, 32, 31),  # 488 tokens of the second id: 15 full blocks, an 8-token tail
        (1000, 16, 62),  # 488 = 30 full blocks of 16 + 8
        (1024, 512, 2),
        (31, 32, 0),
    ],
    ids=["one-id", "partial-last-32", "partial-last-16", "native-512", "under-a-block"],
)
def test_the_partial_last_block_gets_no_hash(tokens, block_size, blocks):
    ids = [1, 2]
    out = expand_hash_ids(ids, tokens, block_size)
    assert len(out) == blocks
    full = expand_hash_ids(ids, 1024, block_size)
    assert out == full[:blocks]  # a prefix of the same prompt's full expansion


def test_too_few_ids_and_bad_block_sizes_are_refused():
    with pytest.raises(ValueError, match="need"):
        expand_hash_ids([1], 1024)
    with pytest.raises(ValueError, match="divide"):
        MooncakeExpander(48)


def test_load_mooncake_from_a_file(tmp_path):
    path = tmp_path / "t.jsonl"
    rows = [
        {"timestamp": 1500, "input_length": 700, "output_length": 9, "hash_ids": [0, 1]},
        {"timestamp": 0, "input_length": 512, "output_length": 0, "hash_ids": [0]},
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    reqs = load_mooncake(path, block_size=64)
    assert [r.arrival_s for r in reqs] == [0.0, 1.5]  # sorted by arrival
    assert reqs[0].output_tokens == 1  # at least one token
    assert reqs[1].block_hashes[:8] == reqs[0].block_hashes
    assert len(reqs[1].block_hashes) == 10 and reqs[1].session_id == ""


def test_ceiling_counts_repeated_prefixes_less_the_last_token():
    ex = MooncakeExpander(32)
    c = Ceiling(32)
    r = lambda ids, n: ReplayRequest(0.0, "", ex.expand(ids, n), n, 1)  # noqa: E731
    assert c.observe(r([1, 2], 1024)) == 0
    assert c.observe(r([1, 2], 1024)) == 1024 - 32  # the last token is always computed
    assert c.observe(r([1, 3], 1024)) == 512
    assert c.observe(r([1, 2, 4], 1100)) == 1024


@pytest.mark.skipif(not MOONCAKE_TRACE.exists(), reason="the shared Mooncake trace is absent")
def test_the_real_mooncake_trace():
    reqs = load_mooncake()
    assert len(reqs) == 3993 and reqs[0].input_tokens == 40160
    assert len(reqs[0].block_hashes) == 40160 // 32
    stats = stream_stats(reqs)
    # The trace's README: 64% of its 512-token blocks repeat an earlier block.
    assert 0.62 < stats.ceiling < 0.67 and stats.sessions == 0


def test_quantile_is_nearest_rank():
    xs = [5.0, 1.0, 3.0, 2.0, 4.0]
    assert (quantile(xs, 0.5), quantile(xs, 0.99), quantile(xs, 0.0)) == (3.0, 5.0, 1.0)
    assert quantile([], 0.5) == 0.0
