"""The OpenAI front door's CORS, /metrics, /health and /version, over real HTTP (aiohttp client)
against a real router (its in-process HTTP server) in front of simulated workers behind the
real worker service, on a real etcd."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvmesh import __version__
from kvmesh.client import RouterClient
from services.router.config import RouterConfig
from services.router.http.cors import CorsPolicy
from services.router.main import RunningRouter, start_router
from services.worker.config import WorkerConfig
from services.worker.server import RunningWorker, start_worker

from .test_router_metrics import sim_engine

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

APP = "https://app.example"
PROMPT = list(range(1, 65))


@contextlib.asynccontextmanager
async def router_with_cors(
    etcd, cluster: str, cors: CorsPolicy, workers: int = 1
) -> AsyncIterator[tuple[RunningRouter, list[RunningWorker]]]:
    """A router with ``cors`` before ``workers`` simulated workers (the test may stop some:
    it pops them off the list)."""
    endpoints = tuple(etcd.endpoints)
    started = [
        await start_worker(
            WorkerConfig(
                worker_id=f"sim-{i}", cluster=cluster, etcd_endpoints=endpoints, drain_grace_s=1.0
            ),
            sim_engine(),
        )
        for i in range(workers)
    ]
    router = await start_router(
        RouterConfig(cluster=cluster, etcd_endpoints=endpoints, drain_grace_s=1.0, cors=cors)
    )
    try:
        yield router, started
    finally:
        await router.stop()
        while started:
            await started.pop().stop()


def http_root(router: RunningRouter) -> str:
    assert router.http is not None
    return f"http://{router.http.host}:{router.http.port}"


async def test_preflight_from_allowed_and_disallowed_origins(etcd):
    async with (
        router_with_cors(etcd, "httpcors", CorsPolicy((APP,))) as (router, _),
        aiohttp.ClientSession() as http,
    ):
        url = http_root(router) + "/v1/chat/completions"
        ask = {
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type",
        }
        async with http.options(url, headers={"Origin": APP, **ask}) as ok:
            assert ok.status == 200
            assert ok.headers["Access-Control-Allow-Origin"] == APP
            assert "POST" in ok.headers["Access-Control-Allow-Methods"]
            assert ok.headers["Access-Control-Allow-Headers"] == "authorization, content-type"
        async with http.options(url, headers={"Origin": "https://evil.example", **ask}) as bad:
            assert bad.status == 400
            assert "Access-Control-Allow-Origin" not in bad.headers
            assert (await bad.json())["error"]["message"].startswith("CORS preflight refused")
        # The actual request from the allowed origin carries the allow header, streamed too.
        async with RouterClient(router.address) as client:
            await client.wait_for_models()
        body = {"model": "sim", "prompt": PROMPT, "max_tokens": 2}
        completions = http_root(router) + "/v1/completions"
        async with http.post(completions, json=body, headers={"Origin": APP}) as done:
            assert done.status == 200
            assert done.headers["Access-Control-Allow-Origin"] == APP
        stream = {**body, "stream": True}
        async with http.post(completions, json=stream, headers={"Origin": APP}) as sse:
            assert sse.status == 200 and sse.headers["Access-Control-Allow-Origin"] == APP
            assert (await sse.text()).endswith("data: [DONE]\n\n")
        async with http.post(
            completions, json=body, headers={"Origin": "https://evil.example"}
        ) as other:
            assert other.status == 200 and "Access-Control-Allow-Origin" not in other.headers


async def test_no_cors_headers_by_default(etcd):
    async with (
        router_with_cors(etcd, "httpnocors", CorsPolicy()) as (router, _),
        aiohttp.ClientSession() as http,
    ):
        headers = {"Origin": APP, "Access-Control-Request-Method": "GET"}
        async with http.options(http_root(router) + "/v1/models", headers=headers) as pre:
            assert pre.status == 400 and "Access-Control-Allow-Origin" not in pre.headers
        async with http.get(http_root(router) + "/v1/models", headers={"Origin": APP}) as got:
            assert got.status == 200 and "Access-Control-Allow-Origin" not in got.headers


def parse(text: str) -> dict[str, tuple[str, dict[tuple[str, tuple], float]]]:  # type: ignore[type-arg]
    out = {}
    for f in text_string_to_metric_families(text):
        out[f.name] = (
            f.type,
            {(s.name, tuple(sorted(s.labels.items()))): s.value for s in f.samples},
        )
    return out


async def test_metrics_health_and_version_on_the_http_port(etcd):
    async with (
        router_with_cors(etcd, "httpextras", CorsPolicy(), workers=2) as (router, workers),
        aiohttp.ClientSession() as http,
    ):
        root = http_root(router)
        async with RouterClient(router.address) as client:
            await client.wait_for_models()
        async with http.get(root + "/health") as health:
            assert health.status == 200
            assert await health.json() == {"status": "ok", "models": 1, "workers": 2}
        body = {"model": "sim", "prompt": PROMPT, "max_tokens": 3}
        for _ in range(3):
            async with http.post(root + "/v1/completions", json=body) as done:
                assert done.status == 200
        async with http.get(root + "/metrics") as scrape:
            assert scrape.status == 200
            assert scrape.headers["Content-Type"].startswith("text/plain; version=0.0.4")
            fams = parse(await scrape.text())
        # The router's own registry: what its metrics port serves, the same samples.
        assert router.metrics_server is not None
        async with http.get(router.metrics_server.url) as other:
            port_fams = parse(await other.text())
        assert set(fams) == set(port_fams)
        requests = fams["kvmesh_router_requests"]
        assert requests[0] == "counter"
        assert (
            requests[1][("kvmesh_router_requests_total", (("code", "OK"), ("model", "sim")))] == 3
        )
        success = fams["kvmesh_router_request_success"][1]
        key = (
            "kvmesh_router_request_success_total",
            (("finished_reason", "length"), ("model", "sim")),
        )
        assert success[key] == 3
        gen = fams["kvmesh_router_generation_tokens"][1]
        assert gen[("kvmesh_router_generation_tokens_total", (("model", "sim"),))] == 9
        for hist in (
            "kvmesh_router_e2e_request_latency_seconds",
            "kvmesh_router_request_queue_time_seconds",
            "kvmesh_router_request_prefill_time_seconds",
            "kvmesh_router_request_decode_time_seconds",
        ):
            kind, samples = fams[hist]
            assert kind == "histogram"
            assert samples[(f"{hist}_count", (("model", "sim"),))] == 3, hist
        # The simulated engine is not vLLM: no vLLM version is known.
        async with http.get(root + "/version") as version:
            assert version.status == 200
            assert await version.json() == {"version": __version__, "vllm_versions": []}
        # No serving worker left: /health says the router cannot serve.
        while workers:
            await workers.pop().stop()
        for _ in range(100):
            async with http.get(root + "/health") as health:
                if health.status == 503:
                    break
            await asyncio.sleep(0.1)
        assert health.status == 503
