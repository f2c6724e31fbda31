"""The fast scenarios of ``kvmesh bench chaos`` as tests (benchmarks/chaos): multi-turn greedy
sessions over gRPC and the OpenAI HTTP front door keep going through a SIGKILLed worker, a
SIGSTOPped kvmanager and a SIGSTOPped etcd (longer than the workers' leases: they vanish from
etcd while alive, and the routers keep them until they register again) with no failed or hung
turn, and every turn's output equals the no-fault run's for the same turn."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from benchmarks.chaos.cli import summarize
from benchmarks.chaos.faults import SCENARIOS, Fleet, Timing
from benchmarks.chaos.sessions import (
    OK,
    LoadResult,
    LoadSpec,
    run_load,
)
from kvmesh.client import RouterClient, make_request
from kvmesh.etcd_server import free_port
from kvmesh.launcher import Mesh, MeshSpec, stop_child
from kvmesh.v1 import kvmanager_pb2, kvmanager_pb2_grpc

pytestmark = pytest.mark.e2e

SPEC = LoadSpec(sessions=2, turns=4, max_tokens=32, first_prompt_tokens=128)
CONNECTION_ERRORS = (
    "ClientPayloadError",
    "ServerDisconnectedError",
    "ClientOSError",
    "ClientConnectorError",
)
TIMING = Timing(warmup_s=2.0, settle_s=3.0, pause_s=4.0)


@pytest.fixture(scope="module")
def fleet(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    spec = MeshSpec(
        model_path=tiny_model,
        served_model_name="tiny",
        workers=2,
        max_model_len=2048,
        kv_cache_bytes=64 << 20,
        kvmanager_cpu_bytes=256 << 20,
        log_dir=tmp_path_factory.mktemp("chaos"),
        # shorter than the etcd stop (2 x pause): the workers' leases expire while it is stopped
        # float32: the outputs compared with the no-fault run's are then a check of the KV
        # path; in bf16 a recompute instead of a load (or another batch) can flip a near-tie
        # of the random model's logits (seen once in 116 turns of stop-kvmanager)
        worker_args=("--etcd-ttl-s", "3", "--dtype", "float32"),
        # fixed: the killed kvmanager's successor comes back where the connectors look
        kvmanager_args=("--port", str(free_port())),
        router_port=free_port(),
        router_http_port=free_port(),
    )
    with Mesh(spec) as m:
        f = Fleet.start(m, routers=2)
        try:
            yield f
        finally:
            for child in f.routers[1:]:
                stop_child(child, grace_s=10.0)


def load(fleet: Fleet, scenario: str) -> LoadResult:
    fault = SCENARIOS.get(scenario)

    def until() -> asyncio.Task[None]:
        if fault is None:
            return asyncio.create_task(asyncio.sleep(8.0))
        return asyncio.create_task(fault(fleet, TIMING))

    return asyncio.run(run_load(fleet.grpc_addresses, fleet.http_base_urls, SPEC, until))


@pytest.fixture(scope="module")
def baseline(fleet: Fleet) -> LoadResult:
    return load(fleet, "none")


@pytest.mark.parametrize(
    "scenario", ["kill-worker", "stop-kvmanager", "kill-kvmanager", "stop-etcd"]
)
def test_no_turn_lost(fleet: Fleet, baseline: LoadResult, scenario: str) -> None:
    run = load(fleet, scenario)
    for api in ("grpc", "http"):
        row = summarize(scenario, run, baseline, api)
        assert row.sent > 0, row
        assert (row.failed_before_first, row.failed_mid, row.hung) == (0, 0, 0), row
        assert row.compared > 0 and row.identical == row.compared, row
    if scenario == "kill-kvmanager":  # the workers save to its successor
        assert fleet.mesh.kvmanager is not None
        address = fleet.mesh.kvmanager.ready["address"]
        assert asyncio.run(saves_reach(address, fleet.grpc_addresses, 20.0)), address


async def saves_reach(address: str, routers: str, timeout_s: float) -> bool:
    """Whether new prompts' blocks reach the kvmanager at ``address`` within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    async with RouterClient(routers) as client, grpc.aio.insecure_channel(address) as channel:
        stub = kvmanager_pb2_grpc.KvManagerStub(channel)
        i = 0
        while time.monotonic() < deadline:
            prompt = [7 + (i * 131 + j) % 900 for j in range(128)]
            await client.complete(make_request(prompt, max_tokens=4), timeout_s=30)
            info = await stub.GetInfo(kvmanager_pb2.KvManagerInfoRequest(), timeout=10)
            if sum(t.blocks for t in info.tiers) > 0:
                return True
            i += 1
            await asyncio.sleep(0.2)
    return False


def test_router_killed(fleet: Fleet, baseline: LoadResult) -> None:
    """One of two routers SIGKILLed: gRPC clients fail over (and resume) through the other
    with nothing lost; over HTTP only the streams cut on the dead router fail, each with an
    error a client can retry, and every turn that finished is the no-fault run's."""
    run = load(fleet, "kill-router")
    grpc_row = summarize("kill-router", run, baseline, "grpc")
    # a retry through router B that reaches the worker still running router A's copy of the
    # same request id waits for that copy to go (docs/failover.md), it is not refused
    assert (grpc_row.failed_before_first, grpc_row.failed_mid, grpc_row.hung) == (0, 0, 0), (
        grpc_row.errors
    )
    assert grpc_row.identical == grpc_row.compared > 0, grpc_row
    http = summarize("kill-router", run, baseline, "http")
    # only requests whose router was the killed one (index 0) fail, each with a connection
    # error (refused, reset, cut chunked body): what the OpenAI SDK retries itself
    failed = [t for t in run.turns if t.key[0] == "http" and t.outcome != OK]
    assert all(t.router == 0 for t in failed), failed
    assert all(t.error.startswith(CONNECTION_ERRORS) for t in failed), failed
    assert http.hung == 0, http
    assert http.identical == http.compared > 0, http
