"""``kvmesh bench replay --dp-ranks``: per-rank routing against per-worker routing on the same
simulated ranks; the per-worker index merges its ranks' KV events (a block gone only when no
rank holds it); and the worker's own rank pick; plus services/worker/dp.py's helpers."""

from __future__ import annotations

import pytest

from benchmarks.replay.agentic import AgenticConfig, agentic_sessions
from benchmarks.replay.dp import PerWorkerPolicy, format_rows, run_pair
from kvmesh import errors
from kvmesh.kv.events import BlockHash, BlockRemoved, BlockStored
from services.worker.core import EngineLoad, SpecDecodeCounts
from services.worker.dp import rank_event_configs, sum_loads
from services.worker.sim.model import SimWorkerConfig


def h(*xs: int) -> tuple[BlockHash, ...]:
    return tuple(BlockHash(x) for x in xs)


def test_per_worker_index_is_the_union_of_its_ranks() -> None:
    policy = PerWorkerPolicy("precise-prefix", workers=2, ranks=2)
    policy.on_kv_events(0, [BlockStored(h(1, 2), None)])  # worker 0, rank 0
    policy.on_kv_events(1, [BlockStored(h(1), None)])  # worker 0, rank 1
    policy.on_kv_events(0, [BlockRemoved(h(1, 2))])  # rank 0 evicts both; rank 1 still has 1
    view = policy.inner.index.view(policy.inner._ids[0])
    assert view.gpu_blocks == 1
    policy.on_kv_events(1, [BlockRemoved(h(1))])
    assert policy.inner.index.view(policy.inner._ids[0]).gpu_blocks == 0
    with pytest.raises(ValueError, match="--dp-pick"):
        PerWorkerPolicy("precise-prefix", 2, 2, pick="sticky")


def test_per_rank_routing_captures_more_than_per_worker_on_agentic_sessions() -> None:
    reqs = list(agentic_sessions(AgenticConfig(seed=3, sessions=8, block_size=32)))[:300]
    cfg = SimWorkerConfig(capacity_blocks=16384, block_size=32)
    per_rank, per_worker = run_pair(reqs, "precise-sticky", workers=2, ranks=2, config=cfg)
    assert per_rank.report.requests == per_worker.report.requests == len(reqs)
    assert len(per_rank.report.worker_input_tokens) == 4  # the replay's fleet is the ranks
    # Per worker, half the turns land on the rank without the session's prefix.
    assert per_rank.report.hit_rate > per_worker.report.hit_rate
    table = format_rows([per_rank, per_worker])
    assert "| precise-sticky | per rank |" in table and "per worker (least-loaded)" in table


def test_rank_event_configs_offset_tcp_ports_and_refuse_ipc() -> None:
    cfgs = rank_event_configs({"endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5600"}, 3)
    assert [c["endpoint"] for c in cfgs] == ["tcp://*:5557", "tcp://*:5558", "tcp://*:5559"]
    assert [c["replay_endpoint"] for c in cfgs] == ["tcp://*:5600", "tcp://*:5601", "tcp://*:5602"]
    free = rank_event_configs(None, 2)
    assert free[1]["endpoint"].startswith("tcp://*:")
    with pytest.raises(errors.InvalidArgument, match="offsets the endpoint's port"):
        rank_event_configs({"endpoint": "ipc:///tmp/x"}, 2)


def test_sum_loads_adds_counts_and_averages_usage() -> None:
    a = EngineLoad(running_requests=1, kv_cache_usage=0.2, spec=SpecDecodeCounts(1, 2, 1, (1,)))
    b = EngineLoad(waiting_requests=2, kv_cache_usage=0.4, spec=SpecDecodeCounts(1, 2, 2, (1, 1)))
    s = sum_loads([a, b])
    assert (s.running_requests, s.waiting_requests) == (1, 2)
    assert s.kv_cache_usage == pytest.approx(0.3)
    assert s.spec == SpecDecodeCounts(2, 4, 3, (2, 1))
