"""Prefill/decode disaggregation with data-parallel ranks, on simulated ranks (each a simulated
engine with its own cache; the KV hand-off through the simulated node store, sim/handoff.py)
behind the real worker gRPC service, a real etcd, a real kvmanager and a real router: a long
prompt is prefilled on one rank of the prefill worker, handed off through the kvmanagers and
decoded on one rank of the decode worker, which reports the handed-over blocks as cached; each
stage ran on the rank the router named."""

from __future__ import annotations

import functools

import pytest

from kvmesh.client import RouterClient, make_request
from kvmesh.discovery.keys import Role, WorkerId, split_target
from kvmesh.kv.hashing import HashConfig, block_hashes
from kvmesh.v1 import kvmanager_pb2
from services.kvmanager.config import KvManagerConfig
from services.kvmanager.main import start_kvmanager
from services.kvmanager.servicer import layout_from_pb
from services.router.config import RouterConfig
from services.router.core.disagg import DisaggConfig
from services.router.main import start_router
from services.worker.config import WorkerConfig
from services.worker.server import start_worker
from services.worker.sim.engine import SimEngineConfig, SimulatedEngine
from services.worker.sim.handoff import HandoffConfig, SimKvStores
from services.worker.sim.model import SimWorkerConfig
from services.worker.sim.ranks import RankedSimEngine
from tests.support import eventually

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

BLOCK = 32
KEY = layout_from_pb(
    kvmanager_pb2.KvLayout(
        model="sim", block_size=BLOCK, num_layers=2, num_kv_heads=2, head_size=32, dtype="float32"
    )
).key
KVM = "kvm-1"
LONG = list(range(1, 20 * BLOCK + 8))  # 20 full blocks


def rank(stores: SimKvStores) -> SimulatedEngine:
    return SimulatedEngine(
        SimEngineConfig(
            worker=SimWorkerConfig(capacity_blocks=1024, block_size=BLOCK),
            model="sim",
            max_model_len=4096,
            vocab_size=1000,
            speedup=20.0,
        ),
        hasher=functools.partial(block_hashes, cfg=HashConfig(block_size=BLOCK)),
        kv_stores=stores,
        kvmanager_id=KVM,
    )


async def test_a_prefill_rank_hands_off_to_a_decode_rank(etcd, request):
    cluster = f"dpd{abs(hash(request.node.name)) % 10**6}"
    endpoints = tuple(etcd.endpoints)
    stores = SimKvStores(HandoffConfig(save_delay_s=0.1, wait_s=2.0))
    kvm = await start_kvmanager(
        KvManagerConfig(
            kvmanager_id=KVM, node="n1", cluster=cluster, etcd_endpoints=endpoints,
            drain_grace_s=1.0, metrics_port=-1,
        )
    )  # fmt: skip
    engines = {w: RankedSimEngine([rank(stores), rank(stores)]) for w in ("p0", "d0")}
    workers = [
        await start_worker(
            WorkerConfig(
                worker_id=wid, role=role, node="n1", kv_layout=KEY, cluster=cluster,
                etcd_endpoints=endpoints, drain_grace_s=1.0,
            ),
            engines[wid],
        )
        for wid, role in (("p0", Role.PREFILL), ("d0", Role.DECODE))
    ]  # fmt: skip
    router = await start_router(
        RouterConfig(
            cluster=cluster,
            etcd_endpoints=endpoints,
            policy="precise-prefix",
            disagg=DisaggConfig(threshold_tokens=256, prefill_timeout_s=5.0),
            drain_grace_s=1.0,
        )
    )
    targets = ("p0#r0", "p0#r1", "d0#r0", "d0#r1")
    try:
        await eventually(lambda: all(router.index.linked(WorkerId(t)) for t in targets), 15.0)
        async with RouterClient(router.address) as client:
            await client.wait_for_models()
            done = await client.complete(make_request(LONG, max_tokens=6), timeout_s=30)
    finally:
        await router.stop()
        for w in workers:
            await w.stop()
        await kvm.stop()
        stores.close()
    assert done.usage is not None
    wid, decode_rank = split_target(done.usage.worker_id)
    assert wid == "d0" and decode_rank is not None
    assert done.usage.cached_prompt_tokens == 20 * BLOCK  # handed off, not recomputed
    decode = engines["d0"].ranks[decode_rank]
    ((_rid, loaded, _waited),) = decode.handoffs  # the named decode rank loaded them
    assert loaded == 20 and not engines["d0"].ranks[1 - decode_rank].handoffs
    prefilled = [r.load().prefill_computed_tokens for r in engines["p0"].ranks]
    assert sorted(prefilled)[0] == 0 and sorted(prefilled)[1] >= len(LONG) - BLOCK  # one rank
