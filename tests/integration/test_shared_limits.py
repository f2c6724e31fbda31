"""Per-tenant rate limits shared by two routers (``--admission-redis-url``) on one real
redis-server, a real etcd and a simulated worker behind the real worker service, every call real
gRPC: a tenant allowed 3 requests a minute gets 3 over both routers together, not 3 on each; the
refusal is RESOURCE_EXHAUSTED with a Retry-After from the shared bucket. With Redis gone, a
router falls back to its own buckets (each enforces the limit over what it sees) and no request
fails for it."""

from __future__ import annotations

import functools
import os
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
import yaml

from kvmesh.client import make_request
from kvmesh.etcd_server import free_port
from kvmesh.kv.hashing import HashConfig, block_hashes
from kvmesh.v1 import router_pb2_grpc
from services.router.config import RouterConfig
from services.router.core.admission import AdmissionConfig
from services.router.core.auth import hash_key
from services.router.core.ratelimit import Limits, RateLimiter
from services.router.main import RunningRouter, start_router
from services.router.shared_limits import SharedRateLimiter
from services.worker.config import WorkerConfig
from services.worker.server import start_worker
from services.worker.sim.engine import SimEngineConfig, SimulatedEngine
from services.worker.sim.model import SimWorkerConfig
from tests.support import eventually

from .local_redis import LocalRedis

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

RPM = 3


def engine() -> SimulatedEngine:
    return SimulatedEngine(
        SimEngineConfig(
            worker=SimWorkerConfig(capacity_blocks=4096, block_size=32),
            model="sim",
            max_model_len=4096,
            vocab_size=1000,
            speedup=10.0,
        ),
        hasher=functools.partial(block_hashes, cfg=HashConfig(block_size=32)),
    )


@pytest.fixture
async def routers(
    etcd, redis_server: LocalRedis, tmp_path: Path
) -> AsyncIterator[tuple[RunningRouter, RunningRouter]]:
    cluster = f"shared-limits-{os.getpid()}"
    key_file = tmp_path / "keys.yaml"
    tree = {
        "tenants": {
            "metered": {"keys": [hash_key("sk-metered")], "requests_per_minute": RPM},
            "free": {"keys": [hash_key("sk-free")]},
        }
    }
    key_file.write_text(yaml.safe_dump(tree))
    endpoints = tuple(etcd.endpoints)
    worker = await start_worker(
        WorkerConfig(worker_id="w0", cluster=cluster, etcd_endpoints=endpoints), engine()
    )
    out: list[RunningRouter] = []
    try:
        for name in ("router-a", "router-b"):
            out.append(
                await start_router(
                    RouterConfig(
                        cluster=cluster,
                        etcd_endpoints=endpoints,
                        router_id=name,
                        http_port=-1,
                        metrics_port=-1,
                        drain_grace_s=1.0,
                        api_keys_file=key_file,
                        admission=AdmissionConfig(enabled=True, redis_url=redis_server.url),
                    )
                )
            )
        for r in out:
            await eventually(lambda r=r: len(r.workers) > 0, what="the worker is known")
        yield out[0], out[1]
    finally:
        for r in out:
            await r.stop()
        await worker.stop()


async def generate(router: RunningRouter, key: str, i: int) -> grpc.StatusCode:
    """The call's status; a refusal must say why and when to come back."""
    refusal: grpc.aio.AioRpcError | None = None
    async with grpc.aio.insecure_channel(router.address) as ch:
        call = router_pb2_grpc.RouterStub(ch).Generate(
            make_request([i % 900 + 1, 2, 3, 4], max_tokens=2, ignore_eos=True),
            metadata=(("authorization", f"Bearer {key}"),),
            timeout=20,
        )
        try:
            async for _ in call:
                pass
        except grpc.aio.AioRpcError as exc:
            refusal = exc
    if refusal is None:
        return grpc.StatusCode.OK
    if refusal.code() is grpc.StatusCode.RESOURCE_EXHAUSTED:
        trailers = {k: v for k, v in refusal.trailing_metadata() or ()}
        assert 1 <= int(trailers["retry-after"]) <= 60 // RPM + 1
        assert "over its rate limit (3 requests per minute)" in (refusal.details() or "")
    return refusal.code()


async def test_a_rate_limit_holds_over_two_routers_together(routers) -> None:
    a, b = routers
    codes = [await generate((a, b)[i % 2], "sk-metered", i) for i in range(2 * RPM)]
    ok = codes.count(grpc.StatusCode.OK)
    assert ok == RPM, codes  # per router it would be 2 * RPM
    assert codes[RPM:] == [grpc.StatusCode.RESOURCE_EXHAUSTED] * RPM
    # An unlimited tenant goes through either router.
    assert await generate(a, "sk-free", 99) is grpc.StatusCode.OK
    assert await generate(b, "sk-free", 98) is grpc.StatusCode.OK


async def test_without_redis_a_router_falls_back_to_its_own_buckets() -> None:
    dead = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    local = RateLimiter()
    shared = SharedRateLimiter(dead, "gone", timeout_s=0.5, fallback=local)
    limits = Limits(requests_per_minute=2)
    try:
        waits = [await shared.check("t", limits) for _ in range(3)]
    finally:
        await shared.close()
    assert waits[:2] == [0.0, 0.0] and waits[2] > 0.0  # the local bucket: 2 a minute


async def test_two_limiters_on_one_redis_share_one_bucket(redis_server: LocalRedis) -> None:
    limits = Limits(requests_per_minute=60, tokens_per_minute=100)
    cluster = f"bucket-{os.getpid()}"
    x = SharedRateLimiter(redis_server.url, cluster, timeout_s=2.0)
    y = SharedRateLimiter(redis_server.url, cluster, timeout_s=2.0)
    try:
        assert await x.check("t", limits, prompt_tokens=60) == 0.0
        # 40 tokens left in the shared bucket: 50 must wait (~10 tokens at 100/min: ~6 s).
        wait = await y.check("t", limits, prompt_tokens=50)
        assert 5.0 < wait < 7.0
        await x.refund("t", limits, prompt_tokens=60)  # the first was refused after all
        assert await y.check("t", limits, prompt_tokens=50) == 0.0
        await x.charge("t", limits, output_tokens=100)  # output into debt: everyone waits
        assert await y.check("t", limits, prompt_tokens=1) > 30.0
    finally:
        await x.close()
        await y.close()
