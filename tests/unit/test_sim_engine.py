"""SimulatedEngine on its own (asyncio, no grpc): deltas, finish reasons, cached tokens, abort,
early close, KV events and load, at a high speed-up so simulated seconds pass in milliseconds."""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import replace

import pytest

from kvmesh import errors
from kvmesh.kv.events import BlockStored
from kvmesh.sampling import Sampling
from services.worker.core import FinishReason, GenerateRequest
from services.worker.sim.engine import (
    SimEngineConfig,
    SimulatedEngine,
    fake_token_ids,
    replayed_tokens,
    simple_block_hashes,
)
from services.worker.sim.model import SimWorkerConfig

FAST = SimEngineConfig(worker=SimWorkerConfig(capacity_blocks=256), vocab_size=1000, speedup=50.0)


def gen(rid: str, prompt: list[int], max_tokens: int = 8, **kw: object) -> GenerateRequest:
    return GenerateRequest(rid, tuple(prompt), Sampling(max_tokens=max_tokens, **kw))


async def collect(engine: SimulatedEngine, request: GenerateRequest):
    return [d async for d in engine.generate(request)]


@pytest.fixture
async def engine():
    e = SimulatedEngine(FAST)
    yield e
    await e.close()


async def test_streams_deterministic_tokens_and_reports_cache_hits(engine):
    events = []
    engine.set_kv_event_sink(events.append)
    prompt = list(range(100))
    first = await collect(engine, gen("r1", prompt, 6))
    tokens = [t for d in first for t in d.token_ids]
    assert tokens == fake_token_ids("r1", 6, 1000)
    last = first[-1]
    assert last.finish.reason is FinishReason.LENGTH and last.completion_tokens == 6
    assert (last.prompt_tokens, last.cached_tokens) == (100, 0)
    assert last.timing.first_token_s >= last.timing.arrived_s
    assert last.timing.finished_s >= last.timing.first_token_s
    assert [d.completion_tokens for d in first] == sorted(d.completion_tokens for d in first)
    hashes = simple_block_hashes(32)(prompt)
    assert [e for batch in events for e in batch] == [
        BlockStored(tuple(hashes), None, block_size=32)
    ]
    second = await collect(engine, gen("r2", prompt, 2))
    assert second[-1].cached_tokens == 96  # 3 full blocks of 32; the tail is recomputed
    load = engine.load()
    assert (load.running_requests, load.waiting_requests, load.kv_cache_usage) == (0, 0, 0.0)
    assert (load.prefix_cache_queried_tokens, load.prefix_cache_hit_tokens) == (200, 96)


async def test_salted_requests_share_blocks_only_with_their_salt(engine):
    events = []
    engine.set_kv_event_sink(events.append)
    prompt = list(range(100))
    cached = {}
    for rid, salt in [("a1", "salt-a"), ("a2", "salt-a"), ("b1", "salt-b"), ("u1", "")]:
        out = await collect(engine, replace(gen(rid, prompt, 2), cache_salt=salt))
        cached[rid] = out[-1].cached_tokens
    assert cached == {"a1": 0, "a2": 96, "b1": 0, "u1": 0}
    stored = [set(e.block_hashes) for batch in events for e in batch]
    assert len(stored) == 3 and not (stored[0] & stored[1] or stored[0] & stored[2])
    assert stored[2] == set(simple_block_hashes(32)(prompt))  # unsalted: as before


async def test_stop_token_ids_and_simulated_eos():
    e = SimulatedEngine(replace(FAST, eos_after_tokens=3))
    try:
        stop = fake_token_ids("s1", 8, 1000)[4]
        out = await collect(e, gen("s1", [1, 2, 3], 8, stop_token_ids=(stop,), ignore_eos=True))
        assert out[-1].finish.reason is FinishReason.STOP
        assert out[-1].finish.stop_reason == str(stop) and out[-1].completion_tokens == 5
        out = await collect(e, gen("s2", [1, 2, 3], 8))
        assert (out[-1].finish.reason, out[-1].completion_tokens) == (FinishReason.STOP, 3)
        out = await collect(e, gen("s3", [1, 2, 3], 8, ignore_eos=True))
        assert (out[-1].finish.reason, out[-1].completion_tokens) == (FinishReason.LENGTH, 8)
    finally:
        await e.close()


async def test_abort_ends_the_stream_with_abort(engine):
    stream = engine.generate(gen("a1", list(range(50)), 10_000))
    first = await anext(stream)
    assert engine.is_running("a1") and first.token_ids
    await engine.abort("a1")
    rest = [d async for d in stream]
    assert rest[-1].finish.reason is FinishReason.ABORT
    assert not engine.is_running("a1")
    with pytest.raises(errors.NotFound):
        await engine.abort("a1")
    assert engine.load().running_requests == 0


async def test_closing_the_stream_early_aborts_in_the_simulator(engine):
    stream = engine.generate(gen("c1", list(range(50)), 10_000))
    await anext(stream)
    await stream.aclose()
    assert not engine.is_running("c1") and not engine.worker.is_active("c1")


async def test_cancelling_the_consumer_aborts(engine):
    async def consume():
        async with contextlib.aclosing(engine.generate(gen("x1", [5] * 40, 10_000))) as s:
            async for _ in s:
                pass

    task = asyncio.create_task(consume())
    for _ in range(1000):
        if engine.worker.is_active("x1"):
            break
        await asyncio.sleep(0.001)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert not engine.worker.is_active("x1") and not engine.is_running("x1")


async def test_rejects_duplicates_and_oversized_requests(engine):
    stream = engine.generate(gen("d1", [1, 2], 10_000))
    await anext(stream)
    with pytest.raises(errors.InvalidArgument, match="already running"):
        await anext(engine.generate(gen("d1", [1, 2], 4)))
    await stream.aclose()
    with pytest.raises(errors.InvalidArgument):
        await anext(engine.generate(gen("d2", [1] * 8200, 10)))  # over 256 blocks of 32


async def test_load_listeners_and_concurrent_requests():
    # A frozen clock: all five arrive before simulated time moves, however busy the machine.
    now = [0.0]
    engine = SimulatedEngine(FAST, clock=lambda: now[0])
    try:
        calls = []
        engine.add_load_listener(lambda: calls.append(engine.load()))
        tasks = [
            asyncio.ensure_future(collect(engine, gen(f"p{i}", [i + 1] * 64, 4))) for i in range(5)
        ]
        for _ in range(100):
            if calls and calls[-1].running_requests + calls[-1].waiting_requests == 5:
                break
            await asyncio.sleep(0)
        assert max(c.running_requests + c.waiting_requests for c in calls) == 5  # all at once
        now[0] += 1000.0  # then let them all run to the end
        outs = await asyncio.wait_for(asyncio.gather(*tasks), timeout=10.0)
        assert all(o[-1].completion_tokens == 4 for o in outs)
        assert calls[-1].running_requests == 0
    finally:
        await engine.close()


async def test_simulated_timing_follows_the_speedup():
    cfg = SimEngineConfig(
        worker=SimWorkerConfig(
            capacity_blocks=64, step_s=0.01, decode_s_per_seq=0.0, prefill_s_per_token=0.0
        ),
        speedup=2.0,
    )
    e = SimulatedEngine(cfg)
    try:
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        out = await collect(e, gen("t1", [1, 2, 3], 10))
        took = loop.time() - t0
        # 10 steps of ~10 ms (plus a little context term) at 2x: ~50 ms of real time.
        assert 0.045 <= took < 0.5
        assert out[-1].completion_tokens == 10
    finally:
        await e.close()


async def test_a_request_that_finishes_while_another_arrives_still_completes():
    """A new arrival catches the simulated server up to now; a request that finishes in that
    catch-up (because the engine's own clock task has not run yet, as on a busy machine) must
    still get its final delta instead of hanging until its deadline."""
    now = [0.0]
    engine = SimulatedEngine(replace(FAST, speedup=1.0), clock=lambda: now[0])
    try:
        a = engine.generate(gen("a", list(range(64)), 2))
        first = await a.__anext__()
        assert first.finish is None
        now[0] += 1000.0  # far past a's end, before the engine's clock task wakes up
        b = engine.generate(gen("b", list(range(100, 164)), 1))
        b_first = asyncio.ensure_future(b.__anext__())
        rest = await asyncio.wait_for(_drain(a), timeout=5.0)
        assert rest[-1].finish is not None and rest[-1].finish.reason is FinishReason.LENGTH
        await asyncio.wait_for(b_first, timeout=5.0)
        await asyncio.wait_for(_drain(b), timeout=5.0)
    finally:
        await engine.close()


async def _drain(stream):
    return [d async for d in stream]


@pytest.mark.parametrize(
    ("tail", "replayed"),
    [(0, 0), (1, 1), (5, 5), (12, 12)],
    ids=["fresh", "one-token", "five", "all-but-the-rest"],
)
def test_a_prompt_ending_with_its_own_output_is_replayed(tail: int, replayed: int) -> None:
    prompt = [*range(40), *fake_token_ids("rr", tail, 1000)]
    assert replayed_tokens("rr", prompt, 1000) == replayed
    assert replayed_tokens("other", prompt, 1000) == 0  # another request's output: a prompt


def test_a_stray_copy_of_the_first_token_is_not_a_replay() -> None:
    first, second = fake_token_ids("rr", 2, 1000)
    assert replayed_tokens("rr", [first, 7, 8, first, second], 1000) == 2
    assert replayed_tokens("rr", [first, 7, 8], 1000) == 0


async def test_a_resumed_request_continues_the_output(engine):
    replayed = fake_token_ids("rs", 5, 1000)
    deltas = await collect(engine, gen("rs", [*range(100), *replayed], 7))
    assert [t for d in deltas for t in d.token_ids] == fake_token_ids("rs", 7, 1000, start=5)


async def test_a_request_counts_as_waiting_only_once_a_step_has_passed_it_over():
    """As vLLM's load (from its steps' stats): a request that just arrived is not waiting, so
    the report pushed at its arrival does not say "queued" for a load interval after it ran.
    One that a step could not admit (max_running 1, another running) is waiting."""
    now = [0.0]
    cfg = replace(FAST, worker=replace(FAST.worker, max_running=1))
    engine = SimulatedEngine(cfg, clock=lambda: now[0])
    try:
        at_arrival = []
        engine.add_load_listener(lambda: at_arrival.append(engine.load()))
        first = asyncio.ensure_future(collect(engine, gen("a", [1] * 64, 4)))
        for _ in range(100):
            if engine.load().running_requests == 1:
                break
            await asyncio.sleep(0)
        assert at_arrival[0].waiting_requests == 0  # pushed at the arrival, before any step
        assert (engine.load().running_requests, engine.load().waiting_requests) == (1, 0)
        second = asyncio.ensure_future(collect(engine, gen("b", [2] * 64, 4)))
        for _ in range(100):
            if engine.load().waiting_requests == 1:
                break
            await asyncio.sleep(0)
        assert (engine.load().running_requests, engine.load().waiting_requests) == (1, 1)
        now[0] += 1000.0
        await asyncio.wait_for(asyncio.gather(first, second), timeout=10.0)
        assert (engine.load().running_requests, engine.load().waiting_requests) == (0, 0)
    finally:
        await engine.close()
