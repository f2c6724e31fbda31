"""The fast scenarios of ``kvmesh bench chaos`` as tests (benchmarks/chaos): multi-turn greedy
sessions over gRPC and the OpenAI HTTP front door keep going through a SIGKILLed worker, a
SIGSTOPped kvmanager and a SIGSTOPped etcd with no failed or hung turn, and every turn's
output equals the no-fault run's for the same turn."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from benchmarks.chaos.cli import summarize
from benchmarks.chaos.faults import SCENARIOS, Timing
from benchmarks.chaos.sessions import LoadResult, LoadSpec, run_load
from kvmesh.launcher import Mesh, MeshSpec

pytestmark = pytest.mark.e2e

SPEC = LoadSpec(sessions=2, turns=4, max_tokens=32, first_prompt_tokens=128)
TIMING = Timing(warmup_s=2.0, settle_s=3.0, pause_s=4.0)


@pytest.fixture(scope="module")
def mesh(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    spec = MeshSpec(
        model_path=tiny_model,
        served_model_name="tiny",
        workers=2,
        max_model_len=2048,
        kv_cache_bytes=64 << 20,
        kvmanager_cpu_bytes=256 << 20,
        log_dir=tmp_path_factory.mktemp("chaos"),
    )
    with Mesh(spec) as m:
        yield m


def load(mesh: Mesh, scenario: str) -> LoadResult:
    fault = SCENARIOS.get(scenario)

    def until() -> asyncio.Task[None]:
        if fault is None:
            return asyncio.create_task(asyncio.sleep(8.0))
        return asyncio.create_task(fault(mesh, TIMING))

    return asyncio.run(run_load(mesh.router_address, mesh.http_base_url, SPEC, until))


@pytest.fixture(scope="module")
def baseline(mesh: Mesh) -> LoadResult:
    return load(mesh, "none")


@pytest.mark.parametrize("scenario", ["kill-worker", "stop-kvmanager", "stop-etcd"])
def test_no_turn_lost(mesh: Mesh, baseline: LoadResult, scenario: str) -> None:
    run = load(mesh, scenario)
    for api in ("grpc", "http"):
        row = summarize(scenario, run, baseline, api)
        assert row.sent > 0, row
        assert (row.failed_before_first, row.failed_mid, row.hung) == (0, 0, 0), row
        assert row.compared > 0 and row.identical == row.compared, row
