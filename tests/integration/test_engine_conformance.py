"""The ``Engine`` protocol's contract (``services/worker/core.py``), one suite run against both
implementations: ``VllmEngine`` on the tiny model (float32; one engine started for the module),
``SimulatedEngine`` and ``RankedSimEngine`` (two simulated data-parallel ranks). What the servicer relies on: deltas ending with exactly one finish,
abort and early close ending a running request, ``is_running``, the ``info`` and ``load()``
fields, load listeners, and the KV event sink getting ``BlockStored`` for a prompt's blocks."""

from __future__ import annotations

import contextlib
import os
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from kvmesh import errors
from kvmesh.kv.events import BlockHash, BlockStored, KvEvent, Tier
from kvmesh.sampling import Sampling
from services.worker.core import Engine, FinishReason, GenerateRequest, OutputDelta
from services.worker.sim.engine import SimEngineConfig, SimulatedEngine
from services.worker.sim.model import SimWorkerConfig
from tests.support import eventually

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

BLOCK_SIZE = 32
PROMPT_TOKENS = 100  # three full blocks and a partial one
SIM = SimEngineConfig(
    worker=SimWorkerConfig(capacity_blocks=256, block_size=BLOCK_SIZE),
    model="tiny",
    vocab_size=1024,
    speedup=50.0,
)


@dataclass
class Subject:
    name: str  # "vllm", "sim" or "sim-ranks"
    engine: Engine
    events: list[KvEvent] = field(default_factory=list)  # everything its sink was given
    load_changes: list[int] = field(default_factory=lambda: [0])  # [calls of its listener]
    salt: int = 0

    def prompt(self, n: int = PROMPT_TOKENS) -> list[int]:
        """``n`` token ids no earlier prompt of the module starts with (a cold prefix cache)."""
        self.salt += 1
        vocab = min(self.engine.info.vocab_size, 1024)
        return [10 + (self.salt * 7919 + i * 31 + (i * i) % 7) % (vocab - 10) for i in range(n)]


def request(rid: str, prompt: Sequence[int], max_tokens: int = 8) -> GenerateRequest:
    sampling = Sampling(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return GenerateRequest(request_id=rid, prompt_token_ids=tuple(prompt), sampling=sampling)


async def run(engine: Engine, req: GenerateRequest) -> list[OutputDelta]:
    return [d async for d in engine.generate(req)]


@contextlib.contextmanager
def vllm_environment() -> Iterator[None]:
    from services.worker.main import VLLM_ENVIRONMENT

    with pytest.MonkeyPatch.context() as mp:
        for key, value in VLLM_ENVIRONMENT.items():
            mp.setenv(key, os.environ.get(key, value))
        yield


async def start(name: str, tiny_model: Path) -> Engine:
    if name == "sim":
        return SimulatedEngine(SIM)
    if name == "sim-ranks":  # two data-parallel ranks, the engine picking one per request
        from services.worker.sim.ranks import RankedSimEngine

        return RankedSimEngine([SimulatedEngine(SIM), SimulatedEngine(SIM)])
    from services.worker.config import EngineConfig
    from services.worker.engine import VllmEngine

    config = EngineConfig(
        model=str(tiny_model),
        served_model_name="tiny",
        dtype="float32",
        max_model_len=1024,
        block_size=BLOCK_SIZE,
        kv_cache_bytes=8 << 20,
    )
    return await VllmEngine.start(config)


@pytest.fixture(scope="module", params=["sim", "sim-ranks", "vllm"])
async def subject(request: pytest.FixtureRequest, tiny_model: Path) -> AsyncIterator[Subject]:
    name: str = request.param
    with vllm_environment() if name == "vllm" else contextlib.nullcontext():
        engine = await start(name, tiny_model)
        s = Subject(name, engine)
        engine.set_kv_event_sink(s.events.extend)

        def changed() -> None:
            s.load_changes[0] += 1

        engine.add_load_listener(changed)
        try:
            yield s
        finally:
            await engine.close()


def longest_chain(events: Sequence[KvEvent]) -> list[BlockHash]:
    """The longest prefix chain (from a root block) the ``BlockStored`` events add up to."""
    stored = [e for e in events if isinstance(e, BlockStored)]
    best: list[BlockHash] = []
    for i, root in enumerate(stored):
        if root.parent_hash is not None:
            continue
        chain = list(root.block_hashes)
        for e in stored[i + 1 :]:
            if e.parent_hash == chain[-1]:
                chain += e.block_hashes
        best = max(best, chain, key=len)
    return best


def test_info_describes_what_it_serves(subject: Subject) -> None:
    info = subject.engine.info
    assert info.model == "tiny" and info.model_path
    assert info.block_size == BLOCK_SIZE
    assert info.max_model_len > PROMPT_TOKENS and info.vocab_size > 0
    assert info.max_running_requests >= 0 and info.max_logprobs >= 0
    assert bool(info.vllm_version) is (subject.name == "vllm")  # "" for an engine not vLLM


async def test_generate_streams_deltas_ending_with_one_finish(subject: Subject) -> None:
    engine = subject.engine
    prompt = subject.prompt()
    deltas = await run(engine, request("gen-1", prompt, max_tokens=8))
    assert deltas
    assert all(d.finish is None and d.timing is None for d in deltas[:-1])
    last = deltas[-1]
    assert last.finish is not None and last.finish.reason is FinishReason.LENGTH
    tokens = [t for d in deltas for t in d.token_ids]
    assert len(tokens) == last.completion_tokens == 8  # ignore_eos: exactly max_tokens
    assert all(0 <= t < engine.info.vocab_size for t in tokens)
    running_total = 0
    for d in deltas:
        running_total += len(d.token_ids)
        assert (d.request_id, d.prompt_tokens, d.completion_tokens) == (
            "gen-1",
            PROMPT_TOKENS,
            running_total,
        )
    assert last.timing is not None and last.timing.first_token_s is not None
    assert last.timing.finished_s is not None
    assert last.timing.arrived_s <= last.timing.first_token_s <= last.timing.finished_s
    assert not engine.is_running("gen-1")
    # The same prompt again: its full blocks come from the prefix cache.
    again = (await run(engine, request("gen-2", prompt, max_tokens=2)))[-1]
    full_blocks_tokens = PROMPT_TOKENS // BLOCK_SIZE * BLOCK_SIZE
    assert again.cached_tokens == full_blocks_tokens
    assert again.cached_split().total == again.cached_tokens


async def test_kv_event_sink_gets_block_stored_for_a_prompt(subject: Subject) -> None:
    seen = len(subject.events)
    await run(subject.engine, request("kv-1", subject.prompt(), max_tokens=2))
    blocks = PROMPT_TOKENS // BLOCK_SIZE
    await eventually(lambda: len(longest_chain(subject.events[seen:])) >= blocks, 15.0)
    stored = [e for e in subject.events[seen:] if isinstance(e, BlockStored)]
    assert all(e.tier is Tier.GPU and e.block_size == BLOCK_SIZE for e in stored)


async def test_abort_ends_a_running_request_with_abort(subject: Subject) -> None:
    engine = subject.engine
    max_tokens = 800
    stream = engine.generate(request("abort-1", subject.prompt(), max_tokens=max_tokens))
    first = await anext(stream)
    assert engine.is_running("abort-1")
    await engine.abort("abort-1")
    deltas = [first, *[d async for d in stream]]
    last = deltas[-1]
    assert last.finish is not None and last.finish.reason is FinishReason.ABORT
    assert sum(len(d.token_ids) for d in deltas) < max_tokens
    assert not engine.is_running("abort-1")
    with pytest.raises(errors.NotFound):
        await engine.abort("abort-1")


async def test_abort_of_a_request_it_does_not_run_is_not_found(subject: Subject) -> None:
    with pytest.raises(errors.NotFound):
        await subject.engine.abort("never-sent")


async def test_closing_the_stream_early_ends_the_request(subject: Subject) -> None:
    engine = subject.engine
    stream = engine.generate(request("close-1", subject.prompt(), max_tokens=800))
    await anext(stream)
    assert engine.is_running("close-1")
    await stream.aclose()
    assert not engine.is_running("close-1")
    await eventually(lambda: engine.load().running_requests == 0, 15.0, "running drops to 0")


async def test_a_running_request_id_is_not_reused(subject: Subject) -> None:
    engine = subject.engine
    stream = engine.generate(request("dup-1", subject.prompt(), max_tokens=800))
    await anext(stream)
    try:
        with pytest.raises(errors.InvalidArgument):
            await run(engine, request("dup-1", subject.prompt()))
        assert engine.is_running("dup-1")  # the refusal did not touch the running one
    finally:
        await stream.aclose()


async def test_a_prompt_past_the_context_is_invalid(subject: Subject) -> None:
    engine = subject.engine
    prompt = subject.prompt(engine.info.max_model_len + 1)
    with pytest.raises(errors.InvalidArgument):
        await run(engine, request("long-1", prompt))
    assert not engine.is_running("long-1")


async def test_load_counts_a_request_and_tells_its_listeners(subject: Subject) -> None:
    engine = subject.engine
    before, calls = engine.load(), subject.load_changes[0]
    await run(engine, request("load-1", subject.prompt(), max_tokens=4))
    await eventually(
        lambda: (
            engine.load().prefix_cache_queried_tokens
            >= before.prefix_cache_queried_tokens + PROMPT_TOKENS
        ),
        15.0,
        "the prompt counted as queried",
    )
    await eventually(lambda: engine.load().running_requests == 0, 15.0, "running drops to 0")
    after = engine.load()
    assert subject.load_changes[0] > calls
    assert after.waiting_requests == 0
    assert 0.0 <= after.kv_cache_usage <= 1.0
    assert after.prefix_cache_hit_tokens >= before.prefix_cache_hit_tokens
    assert after.prefill_computed_tokens >= before.prefill_computed_tokens
    assert after.prefill_s >= before.prefill_s >= 0.0
    # The engine's decode timing: 3 tokens after the first (ignore_eos), and their time.
    assert after.decode_tokens >= before.decode_tokens + 3
    assert after.decode_s > before.decode_s >= 0.0
    assert after.preemptions >= 0
