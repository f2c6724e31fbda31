"""Data-parallel ranks as routing targets: the target ids, a worker record's expansion into
per-rank targets, the router's worker set following etcd with them, and the simulated ranked
engine (services/worker/sim/ranks.py) running each request on its rank."""

from __future__ import annotations

import asyncio

import pytest

from kvmesh import errors
from kvmesh.discovery.keys import (
    WorkerId,
    WorkerRecord,
    routing_targets,
    split_target,
    target_id,
)
from kvmesh.sampling import Sampling
from services.router.core.workers import WorkerSet
from services.worker.core import GenerateRequest, RankedEngine
from services.worker.sim.engine import SimEngineConfig, SimulatedEngine
from services.worker.sim.model import SimWorkerConfig
from services.worker.sim.ranks import RankedSimEngine


def rec(wid: str, ranks: int = 1) -> WorkerRecord:
    return WorkerRecord(
        worker_id=WorkerId(wid), address="h:1", model="m", model_path="", data_parallel_size=ranks
    )


def test_target_ids_round_trip_and_never_collide_with_worker_ids() -> None:
    assert target_id("w-1", 3) == "w-1#r3"
    assert split_target("w-1#r3") == ("w-1", 3)
    assert split_target("w-1") == ("w-1", None)
    assert split_target("w#rx") == ("w#rx", None)  # not a rank: the id as it is


def test_a_record_with_ranks_becomes_one_target_per_rank() -> None:
    one = rec("w")
    assert routing_targets(one) == (one,)
    ranks = routing_targets(rec("w", 3))
    assert [t.worker_id for t in ranks] == ["w#r0", "w#r1", "w#r2"]
    assert [t.data_parallel_rank for t in ranks] == [0, 1, 2]
    assert {t.address for t in ranks} == {"h:1"}
    assert WorkerRecord.from_json(rec("w", 3).to_json()).data_parallel_size == 3


def test_worker_set_follows_a_ranked_worker_through_put_resize_and_delete() -> None:
    ws = WorkerSet()
    change = ws.apply_put(rec("w", 2))
    assert [r.worker_id for r in change.added] == ["w#r0", "w#r1"]
    assert [v.record.worker_id for v in ws.candidates("m")] == ["w#r0", "w#r1"]
    assert ws.models()[0].workers == 1  # one worker, two targets
    change = ws.apply_put(rec("w", 3))  # restarted with three ranks
    assert [r.worker_id for r in change.added] == ["w#r2"]
    assert [r.worker_id for r in change.updated] == ["w#r0", "w#r1"]
    change = ws.apply_put(rec("w", 1))  # and with one
    assert sorted(change.removed) == ["w#r0", "w#r1", "w#r2"]
    assert [r.worker_id for r in change.added] == ["w"]
    ws.apply_put(rec("w", 2))
    ws.apply_put(rec("v"))
    assert sorted(ws.apply_delete(WorkerId("w")).removed) == ["w#r0", "w#r1"]
    assert [v.record.worker_id for v in ws.all()] == ["v"]
    change = ws.apply_snapshot([rec("x", 2)])
    assert change.removed == ("v",) and [r.worker_id for r in change.added] == ["x#r0", "x#r1"]


def _rank() -> SimulatedEngine:
    return SimulatedEngine(
        SimEngineConfig(worker=SimWorkerConfig(capacity_blocks=256, block_size=16), speedup=100)
    )


def _req(rid: str, rank: int | None) -> GenerateRequest:
    return GenerateRequest(rid, tuple(range(64)), Sampling(max_tokens=2), data_parallel_rank=rank)


async def _run(engine: RankedSimEngine, req: GenerateRequest) -> None:
    async for _ in engine.generate(req):
        pass


async def test_ranked_engine_runs_a_request_on_its_rank_and_picks_one_otherwise() -> None:
    engine = RankedSimEngine([_rank(), _rank()])
    assert isinstance(engine, RankedEngine)
    assert engine.info.data_parallel_size == 2
    stored: list[list[int]] = [[], []]
    for r in range(2):
        engine.set_rank_kv_event_sink(r, lambda evs, r=r: stored[r].append(len(evs)))
    await _run(engine, _req("a", 1))
    assert engine.rank_load(1).prefix_cache_queried_tokens > 0
    assert engine.rank_load(0).prefix_cache_queried_tokens == 0
    assert stored[1] and not stored[0]  # rank 1's cache, rank 1's events
    # Without a rank: the least loaded (in flight here), lowest first; two at once spread.
    await asyncio.gather(_run(engine, _req("b", None)), _run(engine, _req("c", None)))
    assert engine.rank_load(0).prefix_cache_queried_tokens > 0
    total = engine.load().prefix_cache_queried_tokens
    assert total == sum(engine.rank_load(r).prefix_cache_queried_tokens for r in range(2))
    with pytest.raises(errors.InvalidArgument):
        await _run(engine, _req("d", 2))
    await engine.close()


async def test_round_robin_pick_alternates() -> None:
    engine = RankedSimEngine([_rank(), _rank()], pick="round-robin")
    assert [engine.choose_rank() for _ in range(4)] == [0, 1, 0, 1]
    await engine.close()


def test_kvmesh_up_passes_data_parallel_flags_to_every_worker(tmp_path, monkeypatch) -> None:
    from kvmesh.cli import _mesh_spec
    from kvmesh.cli import parse_args as cli_args
    from kvmesh.launcher import Mesh

    monkeypatch.setenv("KVMESH_HOME", str(tmp_path))
    base = ["up", "--etcd", "x:1", "--workers", "2", "--model", "tiny"]
    spec = _mesh_spec(cli_args([*base, "--data-parallel-size", "2", "--enable-expert-parallel"]))
    assert spec.worker_args == ("--data-parallel-size", "2", "--enable-expert-parallel")
    argv = Mesh(spec)._worker_argv("w1", [])
    assert argv[argv.index("--data-parallel-size") + 1] == "2"
    assert _mesh_spec(cli_args(base)).worker_args == ()
    with pytest.raises(SystemExit):
        _mesh_spec(cli_args([*base, "--data-parallel-size", "0"]))


def test_worker_flags_check_data_parallel_settings() -> None:
    from services.worker.main import parse_args

    cfg = parse_args(["--engine", "simulated", "--data-parallel-size", "2"], environ={})
    assert cfg.engine.data_parallel_size == 2
    from services.worker.main import simulated_engine

    engine = simulated_engine(cfg)
    assert isinstance(engine, RankedSimEngine) and len(engine.ranks) == 2
    with pytest.raises(SystemExit):
        parse_args(["--engine", "simulated", "--data-parallel-size", "0"], environ={})
    with pytest.raises(SystemExit):
        parse_args(["--engine", "simulated", "--enable-expert-parallel"], environ={})
