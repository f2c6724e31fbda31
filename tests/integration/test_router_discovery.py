"""The router against a real etcd: it learns workers from their registrations within a second,
forgets them when their lease goes, and fails fast and clearly when nobody can serve."""

from __future__ import annotations

import time

import grpc
import pytest

from kvmesh.client import RouterClient, make_request
from kvmesh.discovery.etcd import Registrar
from kvmesh.discovery.keys import Role, WorkerId, WorkerRecord, WorkerState, worker_key
from services.router.config import RouterConfig
from services.router.main import start_router
from tests.support import eventually

pytestmark = pytest.mark.integration


def record(
    wid: str, address: str = "127.0.0.1:9", state: WorkerState = WorkerState.SERVING
) -> WorkerRecord:
    return WorkerRecord(
        worker_id=WorkerId(wid),
        address=address,  # nothing listens on port 9 (discard)
        model="m",
        model_path="/nonexistent",
        state=state,
        max_model_len=128,
        block_size=32,
        vocab_size=100,
    )


@pytest.fixture
async def router(etcd, request):
    cluster = f"c{abs(hash(request.node.name)) % 10**8}"
    r = await start_router(
        RouterConfig(cluster=cluster, etcd_endpoints=tuple(etcd.endpoints), drain_grace_s=1.0)
    )
    yield r
    await r.stop()


async def test_no_worker_is_unavailable_promptly(router):
    async with RouterClient(router.address) as client:
        start = time.monotonic()
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await client.complete(make_request([1, 2, 3], max_tokens=2), timeout_s=30)
    assert err.value.code() is grpc.StatusCode.UNAVAILABLE
    assert "no worker is registered" in err.value.details()
    assert time.monotonic() - start < 2.0


async def test_new_worker_is_seen_within_a_second_and_leaves_on_revoke(router, etcd):
    cluster = router.servicer._config.cluster
    reg = Registrar(
        etcd.endpoints, worker_key(cluster, Role.BOTH, "w1"), record("w1").to_json(), ttl_s=5
    )
    await reg.start()
    try:
        seen_after_s = await eventually(lambda: router.workers.get(WorkerId("w1")) is not None, 1.0)
        assert seen_after_s < 1.0
        await reg.update(record("w1", state=WorkerState.DRAINING).to_json())
        await eventually(lambda: not router.workers.candidates("m"), 1.0)
    finally:
        await reg.close(revoke=True)
    await eventually(lambda: router.workers.get(WorkerId("w1")) is None, 1.0)


async def test_dead_worker_disappears_within_its_ttl(router, etcd):
    cluster = router.servicer._config.cluster
    ttl_s = 2.0
    reg = Registrar(
        etcd.endpoints, worker_key(cluster, Role.BOTH, "w2"), record("w2").to_json(), ttl_s=ttl_s
    )
    await reg.start()
    await eventually(lambda: router.workers.get(WorkerId("w2")) is not None, 1.0)
    await reg.close(revoke=False)  # the process "dies": no revoke, no more keepalives
    gone_after_s = await eventually(lambda: router.workers.get(WorkerId("w2")) is None, ttl_s + 2.0)
    assert gone_after_s <= ttl_s + 1.5


async def test_unreachable_worker_is_unavailable_not_a_hang(router, etcd):
    cluster = router.servicer._config.cluster
    reg = Registrar(
        etcd.endpoints, worker_key(cluster, Role.BOTH, "w3"), record("w3").to_json(), ttl_s=5
    )
    await reg.start()
    try:
        await eventually(lambda: router.workers.get(WorkerId("w3")) is not None, 1.0)
        async with RouterClient(router.address) as client:
            start = time.monotonic()
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await client.complete(make_request([1, 2, 3], max_tokens=2), timeout_s=30)
        assert err.value.code() is grpc.StatusCode.UNAVAILABLE
        assert "w3" in err.value.details()
        assert time.monotonic() - start < 10.0
    finally:
        await reg.close(revoke=True)
