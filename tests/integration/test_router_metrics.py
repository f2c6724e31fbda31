"""The router's Prometheus /metrics, scraped over HTTP from a real router in front of simulated
workers (services/worker/sim: a simulator, not an engine) behind the real worker gRPC service and
a real etcd: requests by status, routing decisions by the plugin that decided, predicted and
served cache hits, latency histograms and the KV event streams' state. Requests through the
router's own OpenAI front door (the official ``openai`` client, aiohttp) count by how they ended:
a finished one is OK on the router and the worker, a client that leaves is CANCELLED and aborts
the engine request."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
import urllib.request
from collections.abc import AsyncIterator

import aiohttp
import grpc
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvmesh.client import RouterClient, make_request
from kvmesh.kv.hashing import HashConfig, block_hashes
from services.router.config import RouterConfig
from services.router.main import RunningRouter, start_router
from services.worker.config import WorkerConfig
from services.worker.server import RunningWorker, start_worker
from services.worker.sim.engine import SimEngineConfig, SimulatedEngine
from services.worker.sim.model import SimWorkerConfig

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

PREFIX = 640  # 20 blocks of 32


class LingeringEngine(SimulatedEngine):
    """Ends its stream a moment after the finished delta, as a worker in another process does:
    its status reaches the router after its last message, not with it (in one process the
    simulator's would come at once and hide a caller that hangs up in between)."""

    async def generate(self, request):  # type: ignore[no-untyped-def]
        async for delta in super().generate(request):
            yield delta
            if delta.finish is not None:
                await asyncio.sleep(0.05)


def sim_engine(speedup: float = 50.0) -> SimulatedEngine:
    return LingeringEngine(
        SimEngineConfig(
            worker=SimWorkerConfig(capacity_blocks=1024, block_size=32),
            model="sim",
            max_model_len=4096,
            vocab_size=1000,
            speedup=speedup,
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


@contextlib.asynccontextmanager
async def sim_mesh(
    etcd, name: str, speedup: float = 50.0
) -> AsyncIterator[tuple[RunningRouter, list[RunningWorker]]]:
    """Two simulated workers and a router (with its OpenAI front door) in cluster ``name``."""
    endpoints = tuple(etcd.endpoints)
    workers = [
        await start_worker(
            WorkerConfig(
                worker_id=f"sim-{i}", cluster=name, etcd_endpoints=endpoints, drain_grace_s=1.0
            ),
            sim_engine(speedup),
        )
        for i in range(2)
    ]
    router = await start_router(
        RouterConfig(
            cluster=name, etcd_endpoints=endpoints, drain_grace_s=1.0, metrics_refresh_s=0.2
        )
    )
    try:
        yield router, workers
    finally:
        await router.stop()
        for w in workers:
            await w.stop()


@pytest.fixture
async def mesh(etcd, request):
    async with sim_mesh(etcd, f"metrics{abs(hash(request.node.name)) % 10**6}") as (router, _):
        yield router


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


def worker_requests(workers: list[RunningWorker], code: str) -> float:
    return sum(
        w.metrics.registry.get_sample_value("kvmesh_worker_requests_total", {"code": code}) or 0.0
        for w in workers
    )


async def test_http_requests_that_finish_count_as_ok(etcd):
    """Finished requests through the OpenAI front door (which calls the router's gRPC API) are
    OK on the router and on the worker, streamed or not; none is CANCELLED."""
    async with sim_mesh(etcd, "metrics-http-ok") as (router, workers):
        assert router.http is not None and router.metrics_server is not None
        async with RouterClient(router.address) as grpc_client:
            await grpc_client.wait_for_models()
        prompt = list(range(1, 65))
        async with openai.AsyncOpenAI(
            base_url=router.http.base_url, api_key="none", max_retries=0
        ) as c:
            for _ in range(3):
                done = await c.completions.create(model="sim", prompt=prompt, max_tokens=4)
                assert done.choices[0].finish_reason == "length"
            for _ in range(3):
                stream = await c.completions.create(
                    model="sim", prompt=prompt, max_tokens=4, stream=True
                )
                reasons = [ch.choices[0].finish_reason async for ch in stream if ch.choices]
                assert reasons[-1] == "length"
        await asyncio.sleep(0.3)  # the last request's status reaches the router's metrics
        m = await asyncio.to_thread(scrape, router.metrics_server.url)
    assert total(m, "kvmesh_router_requests_total", model="sim", code="OK") == 6
    assert total(m, "kvmesh_router_requests_total", code="CANCELLED") == 0
    assert total(m, "kvmesh_router_http_requests_total", code="200") == 6
    assert worker_requests(workers, "OK") == 6
    assert worker_requests(workers, "CANCELLED") == 0


async def test_http_client_leaving_mid_stream_is_cancelled_and_aborts(etcd):
    """A streaming client that hangs up mid-answer: CANCELLED on the router and on the worker,
    and the engine request is gone long before it could have finished."""
    async with sim_mesh(etcd, "metrics-http-cancel", speedup=1.0) as (router, workers):
        assert router.http is not None and router.metrics_server is not None
        async with RouterClient(router.address) as grpc_client:
            await grpc_client.wait_for_models()
        body = {
            "model": "sim",
            "prompt": list(range(1, 65)),
            "max_tokens": 3000,  # ~18 s of simulated decoding at 6 ms a step
            "stream": True,
        }
        async with aiohttp.ClientSession() as s:
            resp = await s.post(router.http.base_url + "/completions", json=body)
            assert resp.status == 200
            for _ in range(3):
                await resp.content.readline()
            resp.close()
        deadline = time.monotonic() + 5.0
        while router.servicer.in_flight or any(w.servicer.in_flight for w in workers):
            assert time.monotonic() < deadline, "the request is still in flight"
            await asyncio.sleep(0.05)
        assert all(w.engine.load().running_requests == 0 for w in workers)
        await asyncio.sleep(0.3)
        m = await asyncio.to_thread(scrape, router.metrics_server.url)
    assert total(m, "kvmesh_router_requests_total", model="sim", code="CANCELLED") == 1
    assert total(m, "kvmesh_router_requests_total", code="OK") == 0
    assert worker_requests(workers, "CANCELLED") == 1
    assert worker_requests(workers, "OK") == 0


async def test_grpc_client_hanging_up_after_the_last_message_counts_as_ok(etcd):
    """A gRPC client that stops at the finished message and cancels the call (as the front door
    did): the router ends its RPC with that message, so the request is OK on the router and on
    the worker."""
    async with sim_mesh(etcd, "metrics-grpc-hangup") as (router, workers):
        assert router.metrics_server is not None
        async with RouterClient(router.address) as client:
            await client.wait_for_models()
            for _ in range(3):
                call = client.stream(make_request(list(range(1, 65)), max_tokens=4))
                async for chunk in call:
                    if chunk.HasField("finished"):
                        break
                call.cancel()
        await asyncio.sleep(0.3)
        m = await asyncio.to_thread(scrape, router.metrics_server.url)
    assert total(m, "kvmesh_router_requests_total", model="sim", code="OK") == 3
    assert total(m, "kvmesh_router_requests_total", code="CANCELLED") == 0
    assert worker_requests(workers, "OK") == 3
    assert worker_requests(workers, "CANCELLED") == 0
