"""The router's Prometheus /metrics, scraped over HTTP from a real router in front of simulated
workers (services/worker/sim: a simulator, not an engine) behind the real worker gRPC service and
a real etcd: requests by status, routing decisions by the plugin that decided, predicted and
served cache hits, latency histograms and the KV event streams' state."""

from __future__ import annotations

import asyncio
import functools
import urllib.request

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvmesh.client import RouterClient, make_request
from kvmesh.kv.hashing import HashConfig, block_hashes
from services.router.config import RouterConfig
from services.router.main import start_router
from services.worker.config import WorkerConfig
from services.worker.server import start_worker
from services.worker.sim.engine import SimEngineConfig, SimulatedEngine
from services.worker.sim.model import SimWorkerConfig

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

PREFIX = 640  # 20 blocks of 32


def sim_engine() -> SimulatedEngine:
    return SimulatedEngine(
        SimEngineConfig(
            worker=SimWorkerConfig(capacity_blocks=1024, block_size=32),
            model="sim",
            max_model_len=4096,
            vocab_size=1000,
            speedup=50.0,
        ),
        hasher=functools.partial(block_hashes, cfg=HashConfig(block_size=32)),
    )


def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(url, timeout=5) as resp:
        assert resp.status == 200
        text = resp.read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def total(samples, name: str, **labels: str) -> float:
    want = set(labels.items())
    return sum(v for (n, lab), v in samples.items() if n == name and want <= set(lab))


@pytest.fixture
async def mesh(etcd, request):
    name = f"metrics{abs(hash(request.node.name)) % 10**6}"
    endpoints = tuple(etcd.endpoints)
    workers = [
        await start_worker(
            WorkerConfig(
                worker_id=f"sim-{i}", cluster=name, etcd_endpoints=endpoints, drain_grace_s=1.0
            ),
            sim_engine(),
        )
        for i in range(2)
    ]
    router = await start_router(
        RouterConfig(
            cluster=name, etcd_endpoints=endpoints, drain_grace_s=1.0, metrics_refresh_s=0.2
        )
    )
    try:
        yield router
    finally:
        await router.stop()
        for w in workers:
            await w.stop()


async def test_metrics_count_requests_decisions_and_cache_hits(mesh):
    router = mesh
    assert router.metrics_server is not None
    url = router.metrics_server.url
    prompt = list(range(1, PREFIX + 1))
    async with RouterClient(router.address) as client:
        await client.wait_for_models()
        token_chunks: list[int] = []  # chunks that carried tokens, per request

        def count(chunk) -> None:
            if chunk.token_ids:
                token_chunks[-1] += 1

        token_chunks.append(0)
        first = await client.complete(
            make_request(prompt, max_tokens=4, session_id="a"), on_chunk=count
        )
        token_chunks.append(0)
        await asyncio.sleep(0.5)  # the first turn's KV events reach the router's index
        second = await client.complete(
            make_request(prompt + first.token_ids + [7, 8, 9], max_tokens=4, session_id="a"),
            on_chunk=count,
        )
        with pytest.raises(grpc.aio.AioRpcError) as bad:
            await client.complete(make_request([], max_tokens=4))
        assert bad.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert second.usage.worker_id == first.usage.worker_id
    assert second.usage.cached_prompt_tokens >= PREFIX - 32

    await asyncio.sleep(0.5)  # one gauge refresh
    m = await asyncio.to_thread(scrape, url)
    assert total(m, "kvmesh_router_requests_total", model="sim", code="OK") == 2
    assert total(m, "kvmesh_router_requests_total", code="INVALID_ARGUMENT") == 1
    # Two decisions, both by the default profile; the second one decided by prefix affinity.
    assert total(m, "kvmesh_router_routing_decisions_total", profile="precise-sticky") == 2
    reasons = {
        dict(lab)["reason"]
        for (n, lab), v in m.items()
        if n == "kvmesh_router_routing_decisions_total" and v > 0
    }
    assert reasons & {"cost-model", "precise-prefix"}, reasons
    assert total(m, "kvmesh_router_routing_decision_seconds_count") == 2
    assert total(m, "kvmesh_router_prompt_tokens_total", model="sim") == (
        2 * PREFIX + len(first.token_ids) + 3
    )
    predicted = total(m, "kvmesh_router_predicted_cached_tokens_total", model="sim")
    served = total(m, "kvmesh_router_cached_prompt_tokens_total", model="sim")
    assert predicted >= PREFIX - 32
    assert served == first.usage.cached_prompt_tokens + second.usage.cached_prompt_tokens
    assert total(m, "kvmesh_router_time_to_first_token_seconds_count", model="sim") == 2
    # One inter-token gap per token-carrying chunk after a request's first.
    gaps = sum(n - 1 for n in token_chunks)
    assert total(m, "kvmesh_router_inter_token_latency_seconds_count", model="sim") == gaps
    assert total(m, "kvmesh_router_in_flight_requests") == 0
    assert total(m, "kvmesh_router_etcd_connected") == 1
    assert total(m, "kvmesh_router_etcd_registered") == 1
    assert total(m, "kvmesh_router_kv_index_blocks") >= PREFIX // 32
    for w in ("sim-0", "sim-1"):
        assert total(m, "kvmesh_router_kv_stream_live", worker=w) == 1
        assert total(m, "kvmesh_router_kv_view_exact", worker=w) == 1
        assert total(m, "kvmesh_router_kv_event_batches", worker=w) >= 1


def test_metrics_port_flags():
    from services.router.main import parse_args

    assert parse_args([]).metrics_port == 0
    assert parse_args(["--metrics-port", "-1"]).metrics_port == -1
    cfg = parse_args(["--metrics-port", "9400", "--metrics-host", "0.0.0.0"])
    assert (cfg.metrics_port, cfg.metrics_host) == (9400, "0.0.0.0")
