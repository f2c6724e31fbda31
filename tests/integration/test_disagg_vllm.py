"""Prefill/decode disaggregation on real vLLM engines (the tiny model, float32) behind the real
worker service, a real etcd, the node's real kvmanager and a real router, with the decode side
running data-parallel ranks or speculative decoding:

- a decode worker with ``--data-parallel-size 2``: each long prompt is prefilled on the prefill
  worker, handed off through the kvmanager and decoded on the rank of the decode worker that the
  router picked (that rank's own KV events hold the prompt, the other rank's do not), which
  reports every full block as loaded from the kvmanager; greedy output equals plain vLLM's;
- a decode worker that speculates (ngram prompt lookup; a draft model, the built-in tiny-draft,
  with the prefill worker running the same drafter, since a drafter's KV travels with the
  target's): the same hand-off and greedy output, drafts counted. With the drafter, a plain
  prefill worker is registered too: the router pairs the decode worker with the prefill worker
  of its KV layout only.

The prefill engine and the kvmanager serve the whole module; each test starts its own decode
engine(s) and router (engine starts dominate: a DP=2 engine takes a minute or more)."""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import pytest

from kvmesh.client import RouterClient, make_request
from kvmesh.discovery.keys import Role, WorkerId, routing_targets, split_target
from kvmesh.kv.hashing import HashConfig, block_hashes
from services.kvmanager.config import KvManagerConfig
from services.kvmanager.core.config import StoreConfig
from services.kvmanager.main import start_kvmanager
from services.router.config import RouterConfig
from services.router.core.disagg import DisaggConfig
from services.router.main import start_router
from services.worker.config import EngineConfig, SpeculativeConfig, WorkerConfig
from tests.support import eventually, tiny_engine_config

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

BLOCK = 32
VOCAB = 1024
MAX_TOKENS = 12
NUM_SPEC = 3
NODE = "n1"
CLUSTER = "pdvllm"
THRESHOLD = 256


def random_prompt(salt: int, n: int = 300) -> list[int]:
    rng = random.Random(salt)
    return [rng.randrange(10, VOCAB) for _ in range(n)]


def looping_prompt(salt: int, n: int = 300, period: int = 11) -> list[int]:
    """A pattern repeating every ``period`` tokens: what ngram's prompt lookup drafts from."""
    base = random_prompt(salt, period)
    return [base[i % period] for i in range(n)]


DP_PROMPTS = [random_prompt(100 + i) for i in range(4)]
SPEC_PROMPTS = {
    "ngram": [looping_prompt(200 + i) for i in range(2)],
    "draft_model": [random_prompt(300 + i) for i in range(2)],
}


def full_blocks(prompt: Sequence[int]) -> int:
    """Prompt tokens a hand-off can supply: every full block but the last token's."""
    return (len(prompt) - 1) // BLOCK * BLOCK


@pytest.fixture(scope="module")
async def reference(tiny_model: Path, vllm_env: object) -> dict[tuple[int, ...], list[int]]:
    """Plain vLLM's greedy output (no connector, no speculation, one rank) of every prompt."""
    from services.worker.core import GenerateRequest, Sampling
    from services.worker.engine import VllmEngine

    engine = await VllmEngine.start(tiny_engine_config(tiny_model))
    out = {}
    try:
        for i, p in enumerate([*DP_PROMPTS, *(q for ps in SPEC_PROMPTS.values() for q in ps)]):
            request = GenerateRequest(
                request_id=f"ref-{i}",
                prompt_token_ids=tuple(p),
                sampling=Sampling(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True),
            )
            out[tuple(p)] = [t async for d in engine.generate(request) for t in d.token_ids]
    finally:
        await engine.close()
    return out


@pytest.fixture(scope="module")
async def kvm(etcd, reference):  # type: ignore[no-untyped-def]
    """The node's kvmanager (started after the reference engine is gone)."""
    server = await start_kvmanager(
        KvManagerConfig(
            kvmanager_id="kvm-1",
            node=NODE,
            cluster=CLUSTER,
            etcd_endpoints=tuple(etcd.endpoints),
            store=StoreConfig(cpu_bytes=64 << 20, disk_bytes=0),
            drain_grace_s=1.0,
            metrics_port=-1,
        )
    )
    try:
        yield server
    finally:
        await server.stop()


@pytest.fixture(scope="module")
async def prefill_engine(tiny_model: Path, kvm):  # type: ignore[no-untyped-def]
    """A plain prefill engine with the connector, one rank."""
    from services.worker.engine import VllmEngine

    engine = await VllmEngine.start(tiny_engine_config(tiny_model, kvmanager=kvm.address))
    try:
        yield engine
    finally:
        await engine.close()


@contextlib.asynccontextmanager
async def mesh(etcd, workers: Sequence[tuple[str, Role, object]]):  # type: ignore[no-untyped-def]
    """The workers (id, role, engine) on the node, and a router that disaggregates prompts of
    THRESHOLD tokens or more; engines stay open (their owners close them)."""
    from services.worker.server import start_worker

    endpoints = tuple(etcd.endpoints)
    running = []
    router = None
    try:
        for wid, role, engine in workers:
            config = WorkerConfig(
                worker_id=wid, role=role, node=NODE, cluster=CLUSTER, etcd_endpoints=endpoints,
                drain_grace_s=1.0,
            )  # fmt: skip
            running.append(await start_worker(config, engine))
        router = await start_router(
            RouterConfig(
                cluster=CLUSTER,
                etcd_endpoints=endpoints,
                disagg=DisaggConfig(threshold_tokens=THRESHOLD, prefill_timeout_s=60.0),
                drain_grace_s=1.0,
            )
        )
        targets = [t.worker_id for w in running for t in routing_targets(w.record)]
        await eventually(lambda: all(router.index.linked(t) for t in targets), 30.0)
        await eventually(lambda: not router.kv_sync.not_live(targets), 30.0)
        yield router
    finally:
        if router is not None:
            await router.stop()
        for w in running:
            await w.stop(close_engine=False)


async def complete_all(router, prompts: Sequence[list[int]]):  # type: ignore[no-untyped-def]
    """The prompts sent at once through the router (greedy)."""
    async with RouterClient(router.address) as client:
        await client.wait_for_models()
        return await asyncio.gather(
            *(
                client.complete(
                    make_request(p, max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True), 300
                )
                for p in prompts
            )
        )


async def test_a_prefill_worker_hands_off_to_the_decode_rank_the_router_picked(
    tiny_model: Path, etcd, kvm, prefill_engine, reference
) -> None:
    from services.worker.engine import VllmEngine

    decode = await VllmEngine.start(tiny_engine_config(tiny_model, kvmanager=kvm.address, ranks=2))
    try:
        assert decode.info.data_parallel_size == 2
        assert decode.info.connector_layout == prefill_engine.info.connector_layout
        prefilled = prefill_engine.load().prefill_computed_tokens
        workers = [("p0", Role.PREFILL, prefill_engine), ("d0", Role.DECODE, decode)]
        async with mesh(etcd, workers) as router:
            done = await complete_all(router, DP_PROMPTS)
            ranks = []
            for p, c in zip(DP_PROMPTS, done, strict=True):
                assert c.token_ids == reference[tuple(p)], "the same greedy output as plain vLLM"
                wid, rank = split_target(c.usage.worker_id)
                assert wid == "d0" and rank is not None, c.usage
                ranks.append(rank)
                # The decode rank never saw the prompt: every full block was handed off
                # through the kvmanager (its CPU tier), none recomputed.
                assert c.usage.cached_prompt_tokens == full_blocks(p), c.usage
                assert c.usage.cached_cpu_tokens == c.usage.cached_prompt_tokens, c.usage
            # The blocks went into the picked rank's own KV cache: its KV events (indexed under
            # its routing target) hold the prompt, the other rank's do not.
            for p, rank in zip(DP_PROMPTS, ranks, strict=True):
                hashes = block_hashes(p, HashConfig(block_size=BLOCK))

                def on_rank(hashes=hashes, rank=rank) -> bool:  # type: ignore[no-untyped-def]
                    m = router.index.match(hashes)
                    mine, other = m.get(WorkerId(f"d0#r{rank}")), m.get(WorkerId(f"d0#r{1 - rank}"))
                    return (
                        mine is not None
                        and mine.gpu_blocks == len(hashes)
                        and (other is None or other.gpu_blocks == 0)
                    )

                await eventually(on_rank, 10.0, what=f"the prompt on rank {rank} only")
            assert set(ranks) == {0, 1}, ranks  # both ranks served
        # The prefill worker computed the prompts (all four, once each).
        assert prefill_engine.load().prefill_computed_tokens - prefilled >= sum(
            full_blocks(p) for p in DP_PROMPTS
        )
    finally:
        await decode.close()


@pytest.fixture
async def drafter_spec(request, tmp_path: Path) -> SpeculativeConfig:  # type: ignore[no-untyped-def]
    if request.param == "ngram":
        return SpeculativeConfig(
            "ngram", NUM_SPEC, prompt_lookup_min=2, prompt_lookup_max=4
        )  # fmt: skip
    from kvmesh.models.tiny import ensure_tiny_draft

    return SpeculativeConfig("draft_model", NUM_SPEC, draft_model=str(ensure_tiny_draft(tmp_path)))


@contextlib.asynccontextmanager
async def engines(configs: Sequence[EngineConfig]) -> AsyncIterator[list[object]]:
    from services.worker.engine import VllmEngine

    started: list[VllmEngine] = []
    try:
        for c in configs:
            started.append(await VllmEngine.start(c))
        yield started
    finally:
        for e in started:
            await e.close()


@pytest.mark.parametrize("drafter_spec", ["ngram", "draft_model"], indirect=True)
async def test_a_speculating_decode_worker_decodes_the_handed_off_prompt(
    tiny_model: Path, etcd, kvm, prefill_engine, reference, drafter_spec: SpeculativeConfig
) -> None:
    method = drafter_spec.method
    prompts = SPEC_PROMPTS[method]
    # ngram adds no KV layers: the plain prefill worker's blocks fit. A draft model's layers
    # share the target's blocks: the prefill worker runs the same drafter (so its blocks carry
    # the drafter's KV too), and the plain one, registered beside it, must not be paired.
    own_prefill = method != "ngram"
    configs = [tiny_engine_config(tiny_model, kvmanager=kvm.address, spec=drafter_spec)] * (
        2 if own_prefill else 1
    )
    async with engines(configs) as started:
        decode = started[0]
        workers = [("d0", Role.DECODE, decode), ("p-plain", Role.PREFILL, prefill_engine)]
        if own_prefill:
            prefill = started[1]
            assert decode.info.connector_layout == prefill.info.connector_layout
            assert decode.info.connector_layout != prefill_engine.info.connector_layout
            workers.append(("p-draft", Role.PREFILL, prefill))
        else:
            prefill = prefill_engine
            assert decode.info.connector_layout == prefill_engine.info.connector_layout
        prefilled = prefill.load().prefill_computed_tokens
        async with mesh(etcd, workers) as router:
            done = await complete_all(router, prompts)
        for p, c in zip(prompts, done, strict=True):
            assert c.token_ids == reference[tuple(p)], "the same greedy output as plain vLLM"
            assert c.usage.worker_id == "d0"
            assert c.usage.cached_prompt_tokens == full_blocks(p), c.usage
            assert c.usage.cached_cpu_tokens == c.usage.cached_prompt_tokens, c.usage
        assert prefill.load().prefill_computed_tokens - prefilled >= sum(map(full_blocks, prompts))
        total = MAX_TOKENS * len(prompts)
        await eventually(lambda: decode.load().generation_tokens == total, what="tokens counted")
        spec = decode.load().spec
        assert spec.drafts > 0 and spec.draft_tokens > 0, spec  # the decode worker speculated
        assert spec.accepted_tokens > 0, spec  # looping prompts / the target's first layer
