"""Prefill/decode disaggregation on simulated engines (services/worker/sim: a simulator, not an
engine, with a simulated KV hand-off, sim/handoff.py) behind the real worker gRPC service, a
real etcd, a real kvmanager (it gives the router the workers' node store: the hand-off target)
and a real router: the threshold, the role of each stage, the hand-off (the decode worker
reports the handed-over blocks as cached, even when the saves land late), and each failure path:
prefill worker unavailable or hanging -> aggregated; decode worker unavailable before its first
token -> another decode worker; after tokens -> resumed on another decode worker, and
UNAVAILABLE when none is left."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import time
import urllib.request
from collections.abc import AsyncIterator
from typing import ClassVar

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvmesh import errors
from kvmesh.client import RouterClient, make_request
from kvmesh.discovery.keys import Role, WorkerId
from kvmesh.kv.hashing import HashConfig, block_hashes
from kvmesh.v1 import kvmanager_pb2
from services.kvmanager.config import KvManagerConfig
from services.kvmanager.main import start_kvmanager
from services.kvmanager.servicer import layout_from_pb
from services.router.config import RouterConfig
from services.router.core.disagg import DisaggConfig
from services.router.main import start_router
from services.worker.config import WorkerConfig
from services.worker.core import GenerateRequest, KvSource, OutputDelta
from services.worker.server import start_worker
from services.worker.sim.engine import SimEngineConfig, SimulatedEngine, fake_token_ids
from services.worker.sim.handoff import HandoffConfig, SimKvStores
from services.worker.sim.model import SimWorkerConfig
from tests.support import eventually

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

BLOCK = 32
KEY = layout_from_pb(
    kvmanager_pb2.KvLayout(
        model="sim", block_size=BLOCK, num_layers=2, num_kv_heads=2, head_size=32, dtype="float32"
    )
).key
KVM = "kvm-1"
THRESHOLD = 256
LONG = list(range(1, 20 * BLOCK + 8))  # 647 tokens: 20 full blocks, all loadable
SHORT = list(range(1, 101))  # 100 tokens < THRESHOLD


class SimWorker(SimulatedEngine):
    """The simulator with a switchable failure: ``fail`` = "unavailable" (refuses every
    request), "hang" (never answers), "after-tokens" (dies after its first tokens),
    "after-tokens-once" (the same, once per request id across the workers of the test) or
    "before-final" (sends every token, then dies instead of sending the final message)."""

    died_once: ClassVar[set[str]] = set()  # "after-tokens-once": the request ids that did

    def __init__(self, stores: SimKvStores) -> None:
        super().__init__(
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
        self.seen: list[GenerateRequest] = []
        self.fail = ""
        self.calls: list[list[float]] = []  # [started, ended] per call, time.monotonic()

    async def generate(self, request: GenerateRequest) -> AsyncIterator[OutputDelta]:
        self.seen.append(request)
        self.calls.append(span := [time.monotonic(), 0.0])
        try:
            async for delta in self._generate(request):
                yield delta
        finally:
            span[1] = time.monotonic()

    async def _generate(self, request: GenerateRequest) -> AsyncIterator[OutputDelta]:
        if self.fail == "unavailable":
            raise errors.Unavailable("simulated worker failure")
        if self.fail == "hang":
            await asyncio.sleep(3600)
        n = 0
        async for delta in super().generate(request):
            if self.fail == "before-final" and delta.finish is not None:
                yield dataclasses.replace(delta, finish=None, timing=None)
                raise errors.Unavailable("simulated worker died before its final message")
            yield delta
            n += len(delta.token_ids)
            if self.fail == "after-tokens" and n >= 2:
                raise errors.Unavailable("simulated worker died mid-stream")
            if (
                self.fail == "after-tokens-once"
                and n >= 2
                and request.request_id not in (died := SimWorker.died_once)
            ):
                died.add(request.request_id)
                raise errors.Unavailable("simulated worker died mid-stream")


@pytest.fixture
async def mesh(etcd, request):
    cluster = f"disagg{abs(hash(request.node.name)) % 10**6}"
    endpoints = tuple(etcd.endpoints)
    stores = SimKvStores(HandoffConfig(save_delay_s=0.3, wait_s=2.0))
    kvm = await start_kvmanager(
        KvManagerConfig(
            kvmanager_id=KVM,
            node="n1",
            cluster=cluster,
            etcd_endpoints=endpoints,
            drain_grace_s=1.0,
            metrics_port=-1,
        )
    )
    engines: dict[str, SimWorker] = {}
    workers = []
    for wid, role in (("p0", Role.PREFILL), ("d0", Role.DECODE), ("d1", Role.DECODE)):
        engines[wid] = SimWorker(stores)
        workers.append(
            await start_worker(
                WorkerConfig(
                    worker_id=wid,
                    role=role,
                    node="n1",
                    kv_layout=KEY,
                    cluster=cluster,
                    etcd_endpoints=endpoints,
                    drain_grace_s=1.0,
                ),
                engines[wid],
            )
        )
    router = await start_router(
        RouterConfig(
            cluster=cluster,
            etcd_endpoints=endpoints,
            policy="precise-prefix",
            disagg=DisaggConfig(
                threshold_tokens=THRESHOLD,
                prefill_timeout_s=1.5,
                overlap=getattr(request, "param", True),
            ),
            drain_grace_s=1.0,
            metrics_refresh_s=0.1,
            first_token_timeout_s=2.0,
        )
    )
    try:
        await eventually(lambda: all(router.index.linked(WorkerId(w)) for w in engines), 15.0)
        async with RouterClient(router.address) as client:
            await client.wait_for_models()
            yield router, client, engines
    finally:
        await router.stop()
        for w in workers:
            await w.stop()
        await kvm.stop()
        stores.close()


def counter(router, name: str, **labels: str) -> float:
    assert router.metrics_server is not None
    with urllib.request.urlopen(router.metrics_server.url, timeout=5) as resp:
        text = resp.read().decode()
    return sum(
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    )


async def metric(router, name: str, **labels: str) -> float:
    return await asyncio.to_thread(counter, router, name, **labels)


@pytest.mark.parametrize("mesh", [True, False], ids=["overlapped", "sequential"], indirect=True)
async def test_long_prompt_is_prefilled_apart_and_handed_over(mesh):
    router, client, engines = mesh
    overlapped = router._config.disagg.overlap
    done = await client.complete(make_request(LONG, max_tokens=6), timeout_s=30)
    assert done.usage is not None
    decode = done.usage.worker_id
    assert decode in ("d0", "d1")
    assert len(done.token_ids) == 6
    # the prefill worker computed the prompt and one token, nobody saw it
    (pre,) = engines["p0"].seen
    assert pre.sampling.max_tokens == 1 and pre.prompt_token_ids == tuple(LONG)
    # the decode worker got the whole request, naming the prefill node's kvmanager, and loaded
    # all 20 blocks though the saves landed 0.3 s after the prefill's first token
    seen = engines[decode].seen[-1]
    # overlapped: sent with the prefill, told to wait up to past the prefill's deadline
    assert seen.kv_source == KvSource(KVM, 20, 2.5 if overlapped else 0.0)
    (prefill_call,) = engines["p0"].calls
    decode_call = engines[decode].calls[-1]
    if overlapped:  # the decode request reached its worker while the prefill still ran
        assert decode_call[0] < prefill_call[1]
    else:
        assert decode_call[0] >= prefill_call[1]
    assert seen.sampling.max_tokens == 6
    assert done.usage.cached_prompt_tokens == 20 * BLOCK
    ((_rid, loaded, waited),) = engines[decode].handoffs
    assert loaded == 20 and waited > 0.05
    assert await metric(router, "kvmesh_router_disagg_decisions_total", reason="disaggregated") == 1


async def test_short_prompt_is_served_on_one_decode_worker(mesh):
    router, client, engines = mesh
    done = await client.complete(make_request(SHORT, max_tokens=3), timeout_s=30)
    assert done.usage is not None and done.usage.worker_id in ("d0", "d1")
    assert engines["p0"].seen == []
    assert engines[done.usage.worker_id].seen[-1].kv_source is None
    assert (
        await metric(router, "kvmesh_router_disagg_decisions_total", reason="below-threshold") == 1
    )


@pytest.mark.parametrize(
    ("failure", "reason"),
    [("unavailable", "prefill-unavailable"), ("hang", "prefill-timeout")],
    ids=["prefill-unavailable", "prefill-hangs"],
)
async def test_prefill_failure_is_served_aggregated(mesh, failure, reason):
    router, client, engines = mesh
    engines["p0"].fail = failure
    started = time.monotonic()
    done = await client.complete(make_request(LONG, max_tokens=4), timeout_s=30)
    assert time.monotonic() - started < 10
    assert done.usage is not None and done.usage.worker_id in ("d0", "d1")
    assert len(done.token_ids) == 4
    assert len(engines["p0"].seen) == 1
    seen = engines[done.usage.worker_id].seen[-1]
    assert seen.kv_source is None  # recomputed: nothing was handed over
    assert done.usage.cached_prompt_tokens == 0
    assert await metric(router, "kvmesh_router_disagg_fallbacks_total", reason=reason) == 1
    # Overlapped: the decode request went out with the prefill, waiting for its blocks; when the
    # prefill fell back the router withdrew it and sent it again without the hint, at once (not
    # after the hint's 2.5 s wait ran out).
    hinted = [s for w in ("d0", "d1") for s in engines[w].seen if s.kv_source is not None]
    assert [s.kv_source.handoff_wait_s for s in hinted if s.kv_source] == [2.5]
    calls = sorted(c for w in ("d0", "d1") for c in engines[w].calls)
    assert len(calls) == 2 and calls[0][1] <= calls[1][0] + 0.05
    prefill_ended = engines["p0"].calls[0][1]
    assert calls[1][0] - prefill_ended < 0.5


async def test_decode_unavailable_before_first_token_goes_to_another(mesh):
    router, client, engines = mesh
    engines["d0"].fail = "unavailable"
    for i in range(20):  # the two idle decode workers tie; d0 is picked at random
        prompt = [999 - i, *LONG[1:]]  # a new prefix each time
        done = await client.complete(make_request(prompt, max_tokens=3), timeout_s=30)
        assert done.usage is not None and done.usage.worker_id == "d1"
        assert len(done.token_ids) == 3
        if engines["d0"].seen:
            break
    assert engines["d0"].seen, "d0 was never picked"
    # d0 got the hand-off and failed; d1 got the same hand-off and loaded it
    assert engines["d0"].seen[-1].kv_source == engines["d1"].seen[-1].kv_source
    assert done.usage.cached_prompt_tokens == 20 * BLOCK
    assert await metric(router, "kvmesh_router_retries_total") >= 1


async def test_a_hung_decode_worker_is_given_up_after_the_first_token_timeout(mesh):
    """A decode worker that accepts the call and never answers (hung, SIGSTOPped) costs the
    request the first-token timeout (2 s here, plus the overlapped hand-off's wait), not its
    whole deadline: the other decode worker serves it."""
    router, client, engines = mesh
    engines["d0"].fail = "hang"
    for i in range(20):  # the two idle decode workers tie; d0 is picked at random
        prompt = [900 - i, *SHORT[1:]]  # short: no prefill, so only the 2 s timeout
        started = time.monotonic()
        done = await client.complete(make_request(prompt, max_tokens=3), timeout_s=30)
        took = time.monotonic() - started
        assert done.usage is not None and done.usage.worker_id == "d1"
        if engines["d0"].seen:
            break
    assert engines["d0"].seen, "d0 was never picked"
    assert 1.9 < took < 6.0
    assert await metric(router, "kvmesh_router_retries_total") >= 1


async def test_decode_failure_after_tokens_resumes_on_the_other_decode_worker(mesh):
    router, client, engines = mesh
    for e in (engines["d0"], engines["d1"]):
        e.fail = "after-tokens-once"
    # 64 tokens: the worker dies after its first ones, always with some left to resume.
    done = await client.complete(
        make_request(LONG, max_tokens=64, ignore_eos=True, request_id="pd-resume"), timeout_s=30
    )
    assert done.token_ids == fake_token_ids("pd-resume", 64, 1000)  # no gap, no repeat
    assert done.usage is not None
    assert (done.usage.resumes, done.usage.completion_tokens) == (1, 64)
    assert done.usage.prompt_tokens == len(LONG)
    decoded = [w for w in ("d0", "d1") if engines[w].seen]
    assert sorted(decoded) == ["d0", "d1"]  # a decode worker each, the prefill worker not
    resumed = next(
        r for w in decoded for r in engines[w].seen if len(r.prompt_token_ids) > len(LONG)
    )
    assert resumed.kv_source is None or resumed.kv_source.handoff_wait_s == 0  # no hand-off
    assert await metric(router, "kvmesh_router_resumes_total") == 1


async def test_a_worker_lost_after_its_last_token_still_completes_the_answer(mesh):
    # Every max_tokens token reached the client; only the final message was lost: nothing is
    # left to generate, so the router ends the answer itself instead of failing it.
    router, client, engines = mesh
    for e in (engines["d0"], engines["d1"]):
        e.fail = "before-final"
    done = await client.complete(
        make_request(LONG, max_tokens=8, ignore_eos=True, request_id="lost-end"), timeout_s=30
    )
    assert done.token_ids == fake_token_ids("lost-end", 8, 1000)
    assert done.finish_reason == "FINISH_REASON_LENGTH"
    assert done.usage is not None
    assert (done.usage.completion_tokens, done.usage.resumes) == (8, 0)
    assert done.usage.prompt_tokens == len(LONG)
    assert sum(len(engines[w].seen) for w in ("d0", "d1")) == 1  # nothing was resumed
    assert await metric(router, "kvmesh_router_resumes_total") == 0


async def test_decode_failure_after_tokens_with_no_decode_worker_left_is_unavailable(mesh):
    _router, client, engines = mesh
    for e in (engines["d0"], engines["d1"]):
        e.fail = "after-tokens"
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await client.complete(make_request(LONG, max_tokens=64, ignore_eos=True), timeout_s=30)
    assert info.value.code() is grpc.StatusCode.UNAVAILABLE
    details = info.value.details() or ""
    assert "failed after" in details and "retry the request" in details
    assert "no other serving worker to try" in details  # the prefill worker cannot decode
