"""Speculation with the KV connector on real vLLM (the tiny models, float32), for ngram prompt
lookup and for the model-based drafters (draft_model: the built-in tiny-draft; eagle: the
built-in tiny-eagle head; mtp: the built-in tiny-mtp's own MTP layer): a speculating worker whose
KvmeshConnector talks to a real kvmanager saves its prompts' blocks there and publishes them as
KV events that the router's own index (KvEventSync into a KvIndex) holds; a fresh engine with the
same speculation then loads those prefixes from the kvmanager. Both give the greedy output of a
plain engine of the same model (no speculation, no connector), and both speculate (drafts
counted). ngram adds no KV layers, so the connector's layout is the plain model's; a drafter's
attention layers share the target's blocks, so the connector saves and loads their KV with the
target's (the layout counts their layers), and the fresh engine drafts exactly what the first
one drafted: the drafter's KV arrived too."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from kvmesh.discovery.keys import WorkerId, WorkerRecord
from kvmesh.kv.events import Tier
from kvmesh.kv.hashing import HashConfig, block_hashes
from kvmesh.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from services.kvmanager.config import KvManagerConfig
from services.kvmanager.core.config import StoreConfig
from services.kvmanager.main import start_kvmanager
from services.router.core.index import KvIndex
from services.router.core.workers import Change
from services.router.kvsync import KvEventSync
from services.worker.config import SpeculativeConfig, WorkerConfig
from services.worker.connector import parse_layout_key
from services.worker.connector.kvmanager_client import kv_layout
from tests.support import eventually, tiny_engine_config

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

BLOCK = 32
VOCAB = 1024
MAX_TOKENS = 16
NUM_SPEC = 3
TINY_LAYERS = 2


def prompt_of(n: int, salt: int, period: int) -> list[int]:
    """``n`` token ids repeating every ``period`` (what prompt lookup drafts from)."""
    base = [10 + (salt * 7919 + i * 31 + (i * i) % 7) % (VOCAB - 10) for i in range(period)]
    return [base[i % period] for i in range(n)]


PROMPTS = [prompt_of(200, 1, 12), prompt_of(150, 2, 9), prompt_of(100, 3, 7)]
NGRAM = SpeculativeConfig(
    method="ngram", num_speculative_tokens=NUM_SPEC, prompt_lookup_min=2, prompt_lookup_max=4
)


@dataclass(frozen=True)
class Setting:
    target: Path  # the model served
    spec: SpeculativeConfig
    drafter_layers: int  # attention layers the drafter adds to the target's KV cache


def setting_of(method: str, tiny: Path, root: Path) -> Setting:
    """The speculative setting of ``method`` on the tiny models, its drafter built under root."""
    if method == "ngram":
        return Setting(tiny, NGRAM, 0)
    if method == "mtp":  # the model's own MTP layer drafts: another target
        from kvmesh.models.tiny_mtp import MTP_LAYERS, ensure_tiny_mtp

        return Setting(ensure_tiny_mtp(root), SpeculativeConfig("mtp"), MTP_LAYERS)
    if method == "draft_model":
        from kvmesh.models.tiny import DRAFT_LAYERS, ensure_tiny_draft

        path, layers = ensure_tiny_draft(root), DRAFT_LAYERS
    else:
        from kvmesh.models.tiny_eagle import ensure_tiny_eagle

        path, layers = ensure_tiny_eagle(root), 1
    return Setting(tiny, SpeculativeConfig(method, NUM_SPEC, draft_model=str(path)), layers)


async def run_all(stub: worker_pb2_grpc.WorkerStub, tag: str) -> list[tuple[list[int], object]]:
    """(greedy output, usage) of each prompt, one after another."""
    out = []
    for i, p in enumerate(PROMPTS):
        req = worker_pb2.WorkerGenerateRequest(
            request_id=f"{tag}-{i}",
            prompt_token_ids=p,
            sampling=common_pb2.SamplingParams(
                max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True
            ),
        )
        msgs = [m async for m in stub.Generate(req, timeout=120)]
        assert msgs[-1].HasField("finished")
        out.append(([t for m in msgs for t in m.token_ids], msgs[-1].finished.usage))
    return out


@pytest.fixture(scope="module")
def references(vllm_env: object) -> Callable[[Path], Awaitable[list[list[int]]]]:
    """Greedy outputs of PROMPTS on a plain engine of a model (no speculation, no connector,
    closed after), once per model."""
    from services.worker.engine import VllmEngine
    from services.worker.server import start_worker

    done: dict[Path, list[list[int]]] = {}

    async def reference(model: Path) -> list[list[int]]:
        if model not in done:
            config = WorkerConfig(
                engine=tiny_engine_config(model),
                worker_id="plain",
                etcd_endpoints=(),
                drain_grace_s=2.0,
            )
            worker = await start_worker(config, await VllmEngine.start(config.engine))
            try:
                async with grpc.aio.insecure_channel(worker.address) as ch:
                    outs = await run_all(worker_pb2_grpc.WorkerStub(ch), "ref")
                done[model] = [t for t, _ in outs]
            finally:
                await worker.stop()
        return done[model]

    return reference


@pytest.mark.parametrize("method", ["ngram", "draft_model", "eagle", "mtp"])
async def test_speculating_worker_offloads_publishes_and_loads_through_the_kvmanager(
    tiny_model: Path, tmp_path: Path, references, method: str
) -> None:  # type: ignore[no-untyped-def]
    from services.worker.engine import VllmEngine
    from services.worker.server import start_worker

    setting = setting_of(method, tiny_model, tmp_path / "models")
    model, spec = setting.target, setting.spec
    reference = await references(model)
    kvm = await start_kvmanager(
        KvManagerConfig(
            kvmanager_id="node-1",
            node="node-1",
            etcd_endpoints=(),
            store=StoreConfig(cpu_bytes=32 << 20, disk_bytes=64 << 20, disk_dir=tmp_path / "kv"),
            metrics_port=-1,
        )
    )
    index = KvIndex()
    sync = KvEventSync(
        on_batch=lambda batch: index.apply(batch).needs_resync,
        on_lost=index.mark_degraded,
        on_live=index.mark_live,
        backoff_s=(0.1,),
    )
    try:
        # 1. A speculating worker with the connector: computes, saves, publishes.
        config = WorkerConfig(
            engine=tiny_engine_config(model, spec=spec, kvmanager=kvm.address),
            worker_id="spec-a",
            etcd_endpoints=(),
            drain_grace_s=2.0,
        )
        engine = await VllmEngine.start(config.engine)
        worker = await start_worker(config, engine)
        try:
            assert engine.info.speculative_method == method
            layout_key = engine.info.connector_layout
            assert layout_key, "the connector is on"
            # The drafter's attention layers are in the target's KV cache group: their KV is
            # saved and loaded with the target's, and the layout says so.
            assert parse_layout_key(layout_key).num_layers == TINY_LAYERS + setting.drafter_layers
            record = WorkerRecord(
                worker_id=WorkerId("spec-a"),
                address=worker.address,
                model="tiny",
                model_path=str(model),
                max_model_len=1024,
                block_size=BLOCK,
                vocab_size=engine.info.vocab_size,
            )
            sync.apply(Change(added=(record,)))
            async with grpc.aio.insecure_channel(worker.address) as ch:
                first = await run_all(worker_pb2_grpc.WorkerStub(ch), "a")
            assert [t for t, _ in first] == reference, "speculation + connector: same output"
            assert all(u.cached_prompt_tokens == 0 for _, u in first)
            total = MAX_TOKENS * len(PROMPTS)
            await eventually(lambda: engine.load().generation_tokens == total, what="counted")
            spec_a = engine.load().spec
            assert spec_a.draft_tokens > 0, "drafts counted"
            # KV events with speculation on: the router's index holds each prompt's full blocks
            # on this worker's GPU tier (as vLLM hashes them).
            for p in PROMPTS:
                hashes = block_hashes(p, HashConfig(block_size=BLOCK))

                def held(hashes=hashes) -> bool:  # type: ignore[no-untyped-def]
                    m = index.match(hashes).get(WorkerId("spec-a"))
                    return m is not None and m.gpu_blocks == len(hashes)

                await eventually(held, what="the prompt's blocks in the router's index")
        finally:
            sync.apply(Change(removed=(WorkerId("spec-a"),)))
            await worker.stop()
        # Offloaded: every full block of every prompt reached the kvmanager.
        layout = kv_layout(layout_key)
        for p in PROMPTS:
            hashes = block_hashes(p, HashConfig(block_size=BLOCK))
            assert len(kvm.store.lookup(layout, hashes)) == len(hashes), "prompt blocks saved"

        # 2. A fresh engine with the same speculation (empty GPU cache) loads them.
        hits_before = kvm.store.stats.hits_cpu
        config2 = WorkerConfig(
            engine=tiny_engine_config(model, spec=spec, kvmanager=kvm.address),
            worker_id="spec-b",
            etcd_endpoints=(),
            drain_grace_s=2.0,
        )
        engine2 = await VllmEngine.start(config2.engine)
        worker2 = await start_worker(config2, engine2)
        try:
            assert engine2.info.connector_layout == layout_key
            async with grpc.aio.insecure_channel(worker2.address) as ch:
                second = await run_all(worker_pb2_grpc.WorkerStub(ch), "b")
            assert [t for t, _ in second] == reference, "loaded KV + speculation: same output"
            for (_, usage), p in zip(second, PROMPTS, strict=True):
                assert usage.cached_prompt_tokens == (len(p) - 1) // BLOCK * BLOCK
                assert usage.cached_cpu_tokens == usage.cached_prompt_tokens, usage
            await eventually(lambda: engine2.load().generation_tokens == total, what="counted")
            # The same drafts, accepted at the same positions, as the engine that computed the
            # prompts: a drafter's KV of the loaded blocks is the one it computed there (had it
            # not been loaded, the draft model and the EAGLE head would attend to garbage).
            assert engine2.load().spec == spec_a
        finally:
            await worker2.stop()
        assert kvm.store.stats.hits_cpu - hits_before >= sum(len(p) // BLOCK for p in PROMPTS)
        assert kvm.store.usage(Tier.CPU).blocks > 0
    finally:
        await sync.close()
        await kvm.stop()
