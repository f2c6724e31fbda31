"""The worker's Prometheus /metrics, scraped over HTTP from the real worker service
(start_worker) serving a simulated engine (services/worker/sim) and registered in a real etcd:
requests by status, tokens, TTFT and inter-token latency, load, KV events and the etcd session."""

from __future__ import annotations

import asyncio
import functools
import urllib.request

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvmesh.kv.hashing import HashConfig, block_hashes
from kvmesh.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from services.worker.config import WorkerConfig
from services.worker.server import start_worker
from services.worker.sim.engine import SimEngineConfig, SimulatedEngine
from services.worker.sim.model import SimWorkerConfig

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def sim_engine() -> SimulatedEngine:
    return SimulatedEngine(
        SimEngineConfig(
            worker=SimWorkerConfig(capacity_blocks=512, block_size=32),
            model="sim",
            max_model_len=4096,
            vocab_size=1000,
            speedup=50.0,
        ),
        hasher=functools.partial(block_hashes, cfg=HashConfig(block_size=32)),
    )


def scrape(url: str) -> Samples:
    with urllib.request.urlopen(url, timeout=5) as resp:
        assert resp.status == 200
        text = resp.read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(samples: Samples, name: str, **labels: str) -> float | None:
    return samples.get((name, tuple(sorted(labels.items()))))


def request(rid: str, prompt: list[int], max_tokens: int) -> worker_pb2.WorkerGenerateRequest:
    return worker_pb2.WorkerGenerateRequest(
        request_id=rid,
        prompt_token_ids=prompt,
        sampling=common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0),
    )


async def test_metrics_count_requests_tokens_latency_load_kv_events_and_etcd(etcd):
    worker = await start_worker(
        WorkerConfig(
            worker_id="sim-m",
            cluster="workermetrics",
            etcd_endpoints=tuple(etcd.endpoints),
            drain_grace_s=1.0,
            metrics_refresh_s=0.1,
        ),
        sim_engine(),
    )
    try:
        assert worker.metrics_server is not None
        url = worker.metrics_server.url
        assert f" metrics={url}" in worker.ready_line()
        async with grpc.aio.insecure_channel(worker.address) as channel:
            stub = worker_pb2_grpc.WorkerStub(channel)
            watch = stub.WatchKvEvents(worker_pb2.WatchKvEventsRequest(), timeout=30)
            await watch.read()  # the snapshot: one subscriber from here on
            prompt = [(7 * i) % 1000 for i in range(200)]
            token_msgs: list[int] = []
            for rid, max_tokens in (("m1", 12), ("m2", 3)):
                msgs = [m async for m in stub.Generate(request(rid, prompt, max_tokens))]
                token_msgs.append(sum(1 for m in msgs if m.token_ids))
            assert msgs[-1].finished.usage.cached_prompt_tokens == 192  # 6 full blocks
            with pytest.raises(grpc.aio.AioRpcError) as bad:
                [m async for m in stub.Generate(request("m3", [], 3))]
            assert bad.value.code() is grpc.StatusCode.INVALID_ARGUMENT
            long = stub.Generate(request("m4", [1, 2, 3], 4000), timeout=30)
            await long.read()
            long.cancel()
            for _ in range(100):  # the servicer sees the cancel, then the gauges refresh
                await asyncio.sleep(0.1)
                m = await asyncio.to_thread(scrape, url)
                done = value(m, "kvmesh_worker_requests_total", code="CANCELLED") == 1
                if done and value(m, "kvmesh_worker_in_flight_requests") == 0:
                    break
            load = worker.engine.load()
            seq = worker.kv_events.log.seq
            watch.cancel()

        assert value(m, "kvmesh_worker_requests_total", code="OK") == 2
        assert value(m, "kvmesh_worker_requests_total", code="INVALID_ARGUMENT") == 1
        assert value(m, "kvmesh_worker_requests_total", code="CANCELLED") == 1
        assert value(m, "kvmesh_worker_prompt_tokens_total") == 400
        assert value(m, "kvmesh_worker_cached_prompt_tokens_total") == 192
        # no KV connector here: every cached token is the engine's own prefix cache
        assert value(m, "kvmesh_worker_cached_prompt_tokens_by_tier_total", tier="gpu") == 192
        assert value(m, "kvmesh_worker_cached_prompt_tokens_by_tier_total", tier="cpu") is None
        completion = value(m, "kvmesh_worker_completion_tokens_total")
        assert completion is not None and completion >= 15  # + the cancelled request's tokens
        assert value(m, "kvmesh_worker_time_to_first_token_seconds_count") == 3
        itl = value(m, "kvmesh_worker_inter_token_latency_seconds_count")
        assert itl is not None and itl >= sum(n - 1 for n in token_msgs)
        assert value(m, "kvmesh_worker_in_flight_requests") == 0
        assert value(m, "kvmesh_worker_running_requests") == load.running_requests == 0
        assert value(m, "kvmesh_worker_waiting_requests") == 0
        assert value(m, "kvmesh_worker_kv_cache_usage_ratio") == pytest.approx(load.kv_cache_usage)
        hits = value(m, "kvmesh_worker_prefix_cache_hit_tokens_total")
        assert hits == load.prefix_cache_hit_tokens and hits is not None and hits >= 192
        assert value(m, "kvmesh_worker_prefix_cache_queried_tokens_total") == (
            load.prefix_cache_queried_tokens
        )
        kv_seq = value(m, "kvmesh_worker_kv_event_seq")
        assert kv_seq is not None and 0 < kv_seq <= seq
        assert value(m, "kvmesh_worker_kv_event_subscribers") == 1
        assert value(m, "kvmesh_worker_kv_event_subscribers_cut_off_total") == 0
        blocks = value(m, "kvmesh_worker_kv_blocks")
        assert blocks is not None and blocks >= 6
        assert value(m, "kvmesh_worker_etcd_connected") == 1
        assert value(m, "kvmesh_worker_etcd_registered") == 1
        assert value(m, "kvmesh_worker_draining") == 0
    finally:
        await worker.stop()
    # Stopped: the lease is revoked (the gauge would read 0) and the endpoint is closed.
    worker.refresh_metrics()
    assert worker.metrics.registry.get_sample_value("kvmesh_worker_etcd_registered") == 0
    with pytest.raises(OSError, match=r"(?i)refused"):
        await asyncio.to_thread(scrape, url)


async def test_standalone_worker_has_no_etcd_gauges_and_metrics_can_be_off():
    worker = await start_worker(WorkerConfig(worker_id="sim-alone"), sim_engine())
    try:
        assert worker.metrics_server is not None
        m = await asyncio.to_thread(scrape, worker.metrics_server.url)
        assert value(m, "kvmesh_worker_requests_total", code="OK") is None
        assert value(m, "kvmesh_worker_in_flight_requests") == 0
        assert not any(name.startswith("kvmesh_worker_etcd_") for name, _ in m)
    finally:
        await worker.stop()
    off = await start_worker(WorkerConfig(worker_id="sim-off", metrics_port=-1), sim_engine())
    try:
        assert off.metrics_server is None
        assert "metrics=" not in off.ready_line()
    finally:
        await off.stop()


def test_metrics_flags():
    from services.worker.main import parse_args

    assert parse_args(["--engine", "simulated"]).metrics_port == 0
    a = parse_args(["--engine", "simulated", "--metrics-port", "-1", "--metrics-host", "0.0.0.0"])
    assert (a.metrics_port, a.metrics_host) == (-1, "0.0.0.0")
