"""Speculative decoding on real vLLM engines (tiny model, float32): greedy output is the same
with and without speculation, for ngram, for a draft model (the built-in tiny-draft), for eagle
and eagle3 (the built-in tiny-eagle and tiny-eagle3 heads) and for mtp (the built-in tiny-mtp,
a MiMo-style model with one MTP layer); the acceptance counters move and reach the load stream
(WorkerLoad) and /metrics with vLLM's own counts; with ngram on, prefix caching and KV events
still work. One engine per setting for the module: the plain one only computes the reference
and is closed before the others start."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import prometheus_client
import pytest

from kvmesh.kv.events import BlockStored, KvEventBatch
from kvmesh.kv_wire import kv_batch_from_pb
from kvmesh.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from services.worker.config import EngineConfig, SpeculativeConfig, WorkerConfig
from tests.support import eventually

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

BLOCK_SIZE = 32
VOCAB = 1024
MAX_TOKENS = 24
NUM_SPEC = 3


def prompt_of(n: int, salt: int, period: int = 0) -> list[int]:
    """``n`` token ids unique to ``salt``; with ``period``, a pattern repeating every ``period``
    tokens (what ngram's prompt lookup finds)."""
    span = period or n
    base = [10 + (salt * 7919 + i * 31 + (i * i) % 7) % (VOCAB - 10) for i in range(span)]
    return [base[i % span] for i in range(n)]


PROMPTS = [prompt_of(96, 1, period=12), prompt_of(70, 2, period=7), prompt_of(50, 3)]


def engine_config(model: Path, spec: SpeculativeConfig | None = None) -> EngineConfig:
    return EngineConfig(
        model=str(model),
        served_model_name="tiny",
        dtype="float32",
        max_model_len=1024,
        block_size=BLOCK_SIZE,
        kv_cache_bytes=8 << 20,
        speculative=spec or SpeculativeConfig(),
        vllm_prometheus=True,  # vLLM's own counters, to compare the worker's with
    )


@pytest.fixture(scope="module")
def draft_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from kvmesh.models.tiny import ensure_tiny_draft

    return ensure_tiny_draft(tmp_path_factory.mktemp("draft"))


async def greedy(engine, rid: str, prompt: list[int]) -> list[int]:  # type: ignore[no-untyped-def]
    from services.worker.core import GenerateRequest, Sampling

    request = GenerateRequest(
        request_id=rid,
        prompt_token_ids=tuple(prompt),
        sampling=Sampling(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True),
    )
    return [t async for d in engine.generate(request) for t in d.token_ids]


@pytest.fixture(scope="module")
async def reference(tiny_model: Path, vllm_env: object) -> list[list[int]]:
    """Greedy outputs of PROMPTS without speculation (the engine is closed afterwards)."""
    from services.worker.engine import VllmEngine

    engine = await VllmEngine.start(engine_config(tiny_model))
    try:
        assert engine.info.speculative_method == ""
        return [await greedy(engine, f"ref-{i}", p) for i, p in enumerate(PROMPTS)]
    finally:
        await engine.close()


@dataclass
class Harness:
    worker: object  # services.worker.server.RunningWorker
    engine: object  # services.worker.engine.VllmEngine
    stub: worker_pb2_grpc.WorkerStub


@pytest.fixture(scope="module")
async def ngram(tiny_model: Path, reference: list[list[int]]) -> AsyncIterator[Harness]:
    """A worker (gRPC, KV events) whose engine speculates with ngram prompt lookup."""
    from services.worker.engine import VllmEngine
    from services.worker.server import start_worker
    from services.worker.traced import TracedEngine

    spec = SpeculativeConfig(
        method="ngram", num_speculative_tokens=NUM_SPEC, prompt_lookup_min=2, prompt_lookup_max=4
    )
    config = WorkerConfig(
        engine=engine_config(tiny_model, spec), worker_id="spec-worker", drain_grace_s=2.0
    )
    engine = await VllmEngine.start(config.engine)
    worker = await start_worker(config, TracedEngine(engine))
    channel = grpc.aio.insecure_channel(worker.address)
    try:
        yield Harness(worker, engine, worker_pb2_grpc.WorkerStub(channel))
    finally:
        await channel.close()
        await worker.stop()


async def generate(stub: worker_pb2_grpc.WorkerStub, rid: str, prompt: list[int]):  # type: ignore[no-untyped-def]
    req = worker_pb2.WorkerGenerateRequest(
        request_id=rid,
        prompt_token_ids=prompt,
        sampling=common_pb2.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True),
    )
    msgs = [m async for m in stub.Generate(req, timeout=60)]
    assert msgs[-1].HasField("finished")
    return [t for m in msgs for t in m.token_ids], msgs[-1].finished


def vllm_counter(name: str) -> float:
    """vLLM's own Prometheus counter (its PrometheusStatLogger in this process), summed."""
    total = 0.0
    for family in prometheus_client.REGISTRY.collect():
        for sample in family.samples:
            if sample.name == name:
                total += sample.value
    return total


def worker_samples(h: Harness) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    h.worker.refresh_metrics()  # type: ignore[attr-defined]
    out = {}
    for family in h.worker.metrics.registry.collect():  # type: ignore[attr-defined]
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


async def test_ngram_greedy_output_is_unchanged_and_acceptance_is_reported(
    ngram: Harness, reference: list[list[int]]
) -> None:
    before = await ngram.stub.GetLoad(worker_pb2.GetLoadRequest(), timeout=5)
    outs = [(await generate(ngram.stub, f"ng-{i}", p))[0] for i, p in enumerate(PROMPTS)]
    assert outs == reference
    total = sum(len(o) for o in outs)
    await eventually(  # the last step's stats reach the front end after its output
        lambda: ngram.engine.load().generation_tokens - before.generation_tokens >= total,  # type: ignore[attr-defined]
        what="the emitted tokens counted",
    )
    load = await ngram.stub.GetLoad(worker_pb2.GetLoadRequest(), timeout=5)
    drafted = load.spec_draft_tokens - before.spec_draft_tokens
    assert drafted > 0  # the repeating prompts gave prompt lookup something to draft
    assert 0 <= load.spec_accepted_tokens <= load.spec_draft_tokens
    assert load.spec_drafts > 0 and load.spec_draft_tokens <= NUM_SPEC * load.spec_drafts
    assert len(load.spec_accepted_tokens_per_position) == NUM_SPEC
    assert sum(load.spec_accepted_tokens_per_position) == load.spec_accepted_tokens
    # Emitted tokens: every streamed token counted once, however many a step emitted.
    emitted = load.generation_tokens - before.generation_tokens
    assert emitted == total
    # /metrics: vLLM's names, and the counts of vLLM's own stat logger in this process.
    samples = worker_samples(ngram)
    labels = (("engine", "0"), ("model_name", "tiny"))
    for name, mine in (
        ("vllm:spec_decode_num_drafts_total", load.spec_drafts),
        ("vllm:spec_decode_num_draft_tokens_total", load.spec_draft_tokens),
        ("vllm:spec_decode_num_accepted_tokens_total", load.spec_accepted_tokens),
    ):
        assert samples[(name, labels)] == mine == vllm_counter(name), name
    for pos in range(NUM_SPEC):
        key = (
            "vllm:spec_decode_num_accepted_tokens_per_pos_total",
            (*labels, ("position", str(pos))),
        )
        assert samples[key] == load.spec_accepted_tokens_per_position[pos]
    assert samples[("kvmesh_worker_engine_generation_tokens_total", ())] == load.generation_tokens


async def test_ngram_keeps_prefix_caching_and_kv_events(ngram: Harness) -> None:
    from vllm.utils.hashing import sha256
    from vllm.v1.core import kv_cache_utils as kcu

    stream = ngram.stub.WatchKvEvents(worker_pb2.WatchKvEventsRequest())
    prompt = prompt_of(4 * BLOCK_SIZE + 5, 9, period=10)
    first, _ = await generate(ngram.stub, "kv-1", prompt)
    # The prompt's blocks are published with the hashes vLLM computes for them.
    kcu.init_none_hash(sha256)
    want, parent = [], None
    for i in range(len(prompt) // BLOCK_SIZE):
        parent = kcu.hash_block_tokens(
            sha256, parent, prompt[i * BLOCK_SIZE : (i + 1) * BLOCK_SIZE]
        )
        want.append(int.from_bytes(parent, "big") & (2**64 - 1))
    stored: list[int] = []
    while not set(want) <= set(stored):
        msg = await asyncio.wait_for(stream.read(), 20)
        assert msg is not grpc.aio.EOF
        batch: KvEventBatch = kv_batch_from_pb(msg)
        for ev in batch.events:
            if isinstance(ev, BlockStored):
                stored += [int(h) for h in ev.block_hashes]
    stream.cancel()
    again, finished = await generate(ngram.stub, "kv-2", prompt)
    assert again == first
    assert finished.usage.cached_prompt_tokens == 4 * BLOCK_SIZE  # its full blocks, from cache


@pytest.fixture(scope="module")
async def drafted(tiny_model: Path, draft_model: Path, reference: list[list[int]]):  # type: ignore[no-untyped-def]
    from services.worker.engine import VllmEngine

    spec = SpeculativeConfig(
        method="draft_model", num_speculative_tokens=NUM_SPEC, draft_model=str(draft_model)
    )
    engine = await VllmEngine.start(engine_config(tiny_model, spec))
    try:
        yield engine
    finally:
        await engine.close()


async def test_draft_model_greedy_output_is_unchanged_and_drafts_get_accepted(
    drafted, reference: list[list[int]]
) -> None:  # type: ignore[no-untyped-def]
    assert drafted.info.speculative_method == "draft_model"
    assert drafted.info.num_speculative_tokens == NUM_SPEC
    outs = [await greedy(drafted, f"dm-{i}", p) for i, p in enumerate(PROMPTS)]
    assert outs == reference
    total = sum(len(o) for o in outs)
    await eventually(lambda: drafted.load().generation_tokens >= total, what="tokens counted")
    load = drafted.load()
    assert load.spec.draft_tokens > 0
    # The draft is the target's first layer: it often guesses the target's next token.
    assert load.spec.accepted_tokens > 0
    assert load.generation_tokens == total
    rates = load.spec.acceptance_by_position()
    assert len(rates) == NUM_SPEC and all(0.0 <= r <= 1.0 for r in rates)
    assert list(rates) == sorted(
        rates, reverse=True
    )  # a later token is accepted only after earlier ones


@pytest.fixture(scope="module")
def mtp_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from kvmesh.models.tiny_mtp import ensure_tiny_mtp

    return ensure_tiny_mtp(tmp_path_factory.mktemp("mtp"))


async def test_mtp_greedy_output_is_unchanged_and_drafts_are_counted(
    mtp_model: Path, vllm_env: object
) -> None:
    """The model's own MTP layer (tiny-mtp: MiMo-style) drafts one token a step; with random
    weights it is never right, so only the draft counters move, and the output must not."""
    from services.worker.engine import VllmEngine

    plain = await VllmEngine.start(engine_config(mtp_model))
    try:
        want = [await greedy(plain, f"mref-{i}", p) for i, p in enumerate(PROMPTS)]
    finally:
        await plain.close()
    # No --spec-num-tokens: the model's MTP layer count (1) from its config.json.
    engine = await VllmEngine.start(engine_config(mtp_model, SpeculativeConfig(method="mtp")))
    try:
        assert (engine.info.speculative_method, engine.info.num_speculative_tokens) == ("mtp", 1)
        outs = [await greedy(engine, f"mtp-{i}", p) for i, p in enumerate(PROMPTS)]
        assert outs == want
        total = sum(len(o) for o in outs)
        await eventually(lambda: engine.load().generation_tokens >= total, what="tokens counted")
        load = engine.load()
        assert load.generation_tokens == total
        # One draft of one token per decode step after the first of each request.
        assert load.spec.drafts > 0 and load.spec.draft_tokens == load.spec.drafts
        assert load.spec.drafts >= total - 2 * len(PROMPTS) - load.spec.accepted_tokens
        assert 0 <= load.spec.accepted_tokens <= load.spec.draft_tokens
        assert len(load.spec.accepted_per_position) == 1
    finally:
        await engine.close()


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
async def test_eagle_head_greedy_output_is_unchanged_and_drafts_are_counted(
    tiny_model: Path, reference: list[list[int]], tmp_path: Path, method: str
) -> None:
    """The built-in tiny EAGLE head (EAGLE-1: the target's last hidden state; vLLM shares the
    target's embedding and LM head with it) or EAGLE-3 head (the hidden states of target layers
    0 and 1 fused, its own LM head) drafts NUM_SPEC tokens a step; the output must not move."""
    from kvmesh.models.tiny_eagle import ensure_tiny_eagle, ensure_tiny_eagle3
    from services.worker.engine import VllmEngine

    head = (ensure_tiny_eagle if method == "eagle" else ensure_tiny_eagle3)(tmp_path)
    spec = SpeculativeConfig(method=method, num_speculative_tokens=NUM_SPEC, draft_model=str(head))
    engine = await VllmEngine.start(engine_config(tiny_model, spec))
    try:
        assert (engine.info.speculative_method, engine.info.num_speculative_tokens) == (
            method,
            NUM_SPEC,
        )
        outs = [await greedy(engine, f"eg-{i}", p) for i, p in enumerate(PROMPTS)]
        assert outs == reference
        total = sum(len(o) for o in outs)
        await eventually(lambda: engine.load().generation_tokens >= total, what="tokens counted")
        load = engine.load()
        assert load.generation_tokens == total
        assert load.spec.drafts > 0 and load.spec.draft_tokens == NUM_SPEC * load.spec.drafts
        assert 0 <= load.spec.accepted_tokens <= load.spec.draft_tokens
        assert len(load.spec.accepted_per_position) == NUM_SPEC
    finally:
        await engine.close()
