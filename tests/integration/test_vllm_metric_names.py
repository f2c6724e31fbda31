"""The metrics a vLLM user graphs, from a real worker on a real vLLM engine (tiny model) behind a
real router (on a real etcd), after requests through the router's OpenAI HTTP API: the worker's
/metrics carry vLLM's names, labels (model_name, engine) and buckets with counts equal to vLLM's
own PrometheusStatLogger in this process (prometheus_client's global registry, which vLLM fills
with ``vllm_prometheus`` on and kvmesh does not serve); every ``*_total`` is a counter; the router's request metrics count
the same requests by model, with the engine's phases carried in the usage; /version names the
workers' vLLM."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import prometheus_client
import pytest
import vllm
from prometheus_client.parser import text_string_to_metric_families
from vllm.v1.metrics import buckets as vllm_buckets

from kvmesh import __version__
from kvmesh.client import RouterClient
from services.router.config import RouterConfig
from services.router.main import RunningRouter, start_router
from services.worker.config import EngineConfig, WorkerConfig
from services.worker.main import VLLM_ENVIRONMENT

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

CLUSTER = "vllmnames"
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


@dataclass
class Mesh:
    router: RunningRouter
    worker: object  # services.worker.server.RunningWorker
    http: str  # the router's HTTP root


@pytest.fixture(scope="module")
async def mesh(tiny_model: Path, etcd) -> AsyncIterator[Mesh]:
    with pytest.MonkeyPatch.context() as mp:
        for key, value in VLLM_ENVIRONMENT.items():
            mp.setenv(key, os.environ.get(key, value))
        from services.worker.engine import VllmEngine
        from services.worker.server import start_worker

        config = WorkerConfig(
            engine=EngineConfig(
                model=str(tiny_model),
                served_model_name="tiny",
                dtype="float32",
                max_model_len=1024,
                block_size=32,
                kv_cache_bytes=64 << 20,
                vllm_prometheus=True,  # vLLM's own counts, to compare with
            ),
            worker_id="names-worker",
            cluster=CLUSTER,
            etcd_endpoints=tuple(etcd.endpoints),
            drain_grace_s=2.0,
            metrics_refresh_s=0.1,
        )
        engine = await VllmEngine.start(config.engine)
        worker = await start_worker(config, engine)
        router = await start_router(
            RouterConfig(cluster=CLUSTER, etcd_endpoints=tuple(etcd.endpoints), drain_grace_s=1.0)
        )
        try:
            async with RouterClient(router.address) as client:
                await client.wait_for_models()
            assert router.http is not None
            yield Mesh(router, worker, f"http://{router.http.host}:{router.http.port}")
        finally:
            await router.stop()
            await worker.stop()


def parse(text: str) -> tuple[dict[str, str], Samples]:
    """(family name -> type, samples) of a scrape."""
    types, samples = {}, {}
    for f in text_string_to_metric_families(text):
        types[f.name] = f.type
        for s in f.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return types, samples


async def scrape(http: aiohttp.ClientSession, url: str) -> tuple[dict[str, str], Samples]:
    async with http.get(url) as resp:
        assert resp.status == 200
        return parse(await resp.text())


def get(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def vllms_own(name: str, **labels: str) -> float:
    """vLLM's own PrometheusStatLogger's value (global registry) for this engine."""
    value = prometheus_client.REGISTRY.get_sample_value(
        name, {"model_name": "tiny", "engine": "0", **labels}
    )
    return value or 0.0


ENGINE = {"model_name": "tiny", "engine": "0"}
PER_REQUEST = (
    "vllm:e2e_request_latency_seconds",
    "vllm:request_queue_time_seconds",
    "vllm:request_prefill_time_seconds",
    "vllm:request_decode_time_seconds",
    "vllm:request_inference_time_seconds",
    "vllm:time_to_first_token_seconds",
    "vllm:request_time_per_output_token_seconds",
)


async def test_worker_and_router_metrics_after_requests(mesh: Mesh):
    worker_url = mesh.worker.metrics_server.url  # type: ignore[attr-defined]
    router_url = mesh.http + "/metrics"
    async with aiohttp.ClientSession() as http:
        _, w0 = await scrape(http, worker_url)
        _, r0 = await scrape(http, router_url)
        own0 = {
            r: vllms_own("vllm:request_success_total", finished_reason=r)
            for r in ("length", "stop")
        }
        answers = []
        for i, max_tokens in enumerate((3, 5, 7, 2)):
            prompt = [10 + (i * 97 + j * 13) % 1000 for j in range(40 + i)]
            body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens}
            async with http.post(mesh.http + "/v1/completions", json=body) as resp:
                assert resp.status == 200, await resp.text()
                answers.append(await resp.json())
        reasons = [a["choices"][0]["finish_reason"] for a in answers]
        completion = sum(a["usage"]["completion_tokens"] for a in answers)
        prompt_tokens = sum(a["usage"]["prompt_tokens"] for a in answers)
        assert completion > 0
        await asyncio.sleep(0.5)  # the worker's gauges refresh every 0.1 s
        wtypes, w1 = await scrape(http, worker_url)
        rtypes, r1 = await scrape(http, router_url)

        def dw(name: str, **labels: str) -> float:
            return get(w1, name, **labels) - get(w0, name, **labels)

        def dr(name: str, **labels: str) -> float:
            return get(r1, name, **labels) - get(r0, name, **labels)

        # ---- the worker: vLLM's names and labels, counts of exactly these requests ----
        for reason in ("length", "stop"):
            n = reasons.count(reason)
            assert dw("vllm:request_success_total", **ENGINE, finished_reason=reason) == n
            # vLLM's own logger in this process counted the same
            mine = vllms_own("vllm:request_success_total", finished_reason=reason) - own0[reason]
            assert mine == n, reason
        assert dw("vllm:generation_tokens_total", **ENGINE) == completion
        assert dw("vllm:prompt_tokens_total", **ENGINE) == prompt_tokens
        for hist in PER_REQUEST:
            assert wtypes[hist] == "histogram", hist
            assert dw(f"{hist}_count", **ENGINE) == len(answers), hist
        assert dw("vllm:request_decode_time_seconds_sum", **ENGINE) > 0
        assert dw("vllm:request_prefill_time_seconds_sum", **ENGINE) > 0
        le = sorted(
            float(dict(lab)["le"])
            for (name, lab) in w1
            if name == "vllm:e2e_request_latency_seconds_bucket"
        )
        assert le[:-1] == list(vllm_buckets.REQUEST_LATENCY_BUCKETS)
        le = sorted(
            float(dict(lab)["le"])
            for (name, lab) in w1
            if name == "vllm:time_to_first_token_seconds_bucket"
        )
        assert le[:-1] == list(vllm_buckets.TIME_TO_FIRST_TOKEN_BUCKETS)
        for gauge in ("vllm:num_requests_running", "vllm:num_requests_waiting"):
            assert wtypes[gauge] == "gauge" and get(w1, gauge, **ENGINE) == 0
        assert ("vllm:kv_cache_usage_perc", tuple(sorted(ENGINE.items()))) in w1
        for counter in (
            "vllm:num_preemptions",
            "vllm:prefix_cache_queries",
            "vllm:prefix_cache_hits",
        ):
            assert wtypes[counter] == "counter", counter
        # the engine's own cumulative counters, mirrored: as vLLM's logger counted them
        assert get(w1, "vllm:num_preemptions_total", **ENGINE) == vllms_own(
            "vllm:num_preemptions_total"
        )
        queried = get(w1, "vllm:prefix_cache_queries_total", **ENGINE)
        assert queried >= prompt_tokens
        assert queried == vllms_own("vllm:prefix_cache_queries_total")
        # every *_total the worker exports is a counter (the engine's mirrored ones included)
        totals = {n.removesuffix("_total") for n, _ in w1 if n.endswith("_total")}
        assert totals and all(wtypes.get(n) == "counter" for n in totals), {
            n: wtypes.get(n) for n in totals
        }
        assert "kvmesh_worker_prefix_cache_queried_tokens" in totals

        # ---- the router: the same requests by model, with the engine's phases ----
        for reason in ("length", "stop"):
            n = reasons.count(reason)
            got = dr("kvmesh_router_request_success_total", model="tiny", finished_reason=reason)
            assert got == n, reason
        assert dr("kvmesh_router_generation_tokens_total", model="tiny") == completion
        for hist in (
            "kvmesh_router_e2e_request_latency_seconds",
            "kvmesh_router_request_queue_time_seconds",
            "kvmesh_router_request_prefill_time_seconds",
            "kvmesh_router_request_decode_time_seconds",
        ):
            assert rtypes[hist] == "histogram"
            assert dr(f"{hist}_count", model="tiny") == len(answers), hist
        # what the worker measured of the engine's phases reached the router (usage 12-14)
        for phase in ("prefill", "decode"):
            router_s = dr(f"kvmesh_router_request_{phase}_time_seconds_sum", model="tiny")
            worker_s = dw(f"vllm:request_{phase}_time_seconds_sum", **ENGINE)
            assert router_s == pytest.approx(worker_s, rel=1e-6), phase
        # the router's e2e covers the engine's (the router's hop on top)
        assert dr("kvmesh_router_e2e_request_latency_seconds_sum", model="tiny") >= dw(
            "vllm:e2e_request_latency_seconds_sum", **ENGINE
        )

        async with http.get(mesh.http + "/version") as resp:
            assert await resp.json() == {
                "version": __version__,
                "vllm_versions": [vllm.__version__],
            }
