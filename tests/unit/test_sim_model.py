"""The simulated worker (virtual time): prefix cache (LRU of unreferenced blocks, tail first,
pinning), admission and FIFO waiting, the timing model, and KV events that match the cache."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvmesh.kv.events import BlockHash, BlockRemoved, BlockStored, KvEvent
from services.worker.sim.model import SimRequest, SimResult, SimulatedWorker, SimWorkerConfig

# Only prefill costs time (1 ms per token): timings are easy to state exactly.
PREFILL_ONLY = SimWorkerConfig(
    capacity_blocks=8,
    block_size=4,
    step_s=0.0,
    decode_s_per_seq=0.0,
    decode_s_per_context_token=0.0,
    prefill_s_per_token=1e-3,
    attention_s_per_token_pair=0.0,
)


def h(*xs: int) -> tuple[BlockHash, ...]:
    return tuple(BlockHash(x) for x in xs)


def req(rid: str, blocks: tuple[int, ...], prompt: int, output: int = 1) -> SimRequest:
    return SimRequest(rid, h(*blocks), prompt, output)


class Recorder:
    def __init__(self) -> None:
        self.batches: list[list[KvEvent]] = []

    def __call__(self, events) -> None:
        self.batches.append(list(events))

    def take(self) -> list[KvEvent]:
        out = [e for b in self.batches for e in b]
        self.batches.clear()
        return out


def run(w: SimulatedWorker, at: float, *requests: SimRequest) -> list[SimResult]:
    """Advances to ``at``, submits ``requests`` there, then runs until idle."""
    done = w.advance_to(at)
    for r in requests:
        w.submit(r)
    return done + w.drain()


def test_evicts_least_recently_released_tail_first():
    ev = Recorder()
    w = SimulatedWorker(PREFILL_ONLY, kv_sink=ev)
    run(w, 0, req("a", (1, 2, 3), 13))  # 4 blocks while running: 3 full + the partial one
    assert ev.take() == [BlockStored(h(1, 2, 3), None, block_size=4)]
    assert w.eviction_order() == list(h(3, 2, 1))  # tail first: the prefix outlives it
    run(w, 1, req("b", (11, 12, 13), 13))  # 5 free blocks: no eviction
    assert w.eviction_order() == list(h(3, 2, 1, 13, 12, 11))
    run(w, 2, req("c", (1, 2), 9))  # hits 1, 2: pinned, then released: most recent now
    assert w.eviction_order() == list(h(3, 13, 12, 11, 2, 1))
    ev.take()
    run(w, 3, req("d", (21, 22, 23), 13))  # needs 4, 2 free: evicts the two oldest
    assert ev.take() == [BlockRemoved(h(3, 13)), BlockStored(h(21, 22, 23), None, block_size=4)]
    assert w.cached_blocks() == set(h(1, 2, 12, 11, 21, 22, 23))


def test_blocks_of_running_requests_are_pinned_and_the_next_request_waits():
    ev = Recorder()
    cfg = replace(PREFILL_ONLY, step_s=0.01)
    w = SimulatedWorker(cfg, kv_sink=ev)
    w.submit(req("a", (1, 2, 3), 13, output=8))  # 6 blocks: 3 full, partial, output
    w.advance_to(0.02)
    w.submit(req("b", (5, 6, 7, 8, 9), 21, output=3))  # 6 blocks; 2 free, 0 evictable
    w.advance_to(0.05)
    assert (w.load().running, w.load().waiting) == (1, 1)
    assert w.pinned_blocks() == set(h(1, 2, 3))
    assert not any(isinstance(e, BlockRemoved) for e in ev.take())
    done = w.drain()
    a, b = sorted(done, key=lambda r: r.finish_s)
    assert (a.request_id, b.request_id) == ("a", "b")
    assert b.admitted_s == pytest.approx(a.finish_s)  # admitted as soon as a released its blocks
    removed = [e for e in ev.take() if isinstance(e, BlockRemoved)]
    assert removed == [BlockRemoved(h(3))]  # a's tail block made room


def test_ttft_is_proportional_to_uncached_tokens():
    w = SimulatedWorker(replace(PREFILL_ONLY, capacity_blocks=100))
    (a,) = run(w, 0, req("a", tuple(range(1, 26)), 100))
    assert (a.cached_tokens, a.ttft_s) == (0, pytest.approx(0.100))
    shared = tuple(range(1, 16)) + tuple(range(100, 110))  # 15 blocks (60 tokens) shared
    (b,) = run(w, 1, req("b", shared, 100))
    assert (b.cached_tokens, b.ttft_s) == (60, pytest.approx(0.040))
    # Chunked prefill spreads the same work over steps: same total when steps cost nothing else.
    w2 = SimulatedWorker(replace(PREFILL_ONLY, capacity_blocks=100, max_batched_tokens=16))
    (c,) = run(w2, 0, req("c", tuple(range(1, 26)), 100))
    assert c.ttft_s == pytest.approx(0.100)


def test_step_timing_decode_and_attention_terms():
    cfg = SimWorkerConfig(
        capacity_blocks=100,
        block_size=4,
        step_s=0.01,
        decode_s_per_seq=0.001,
        decode_s_per_context_token=1e-5,
        prefill_s_per_token=1e-4,
        attention_s_per_token_pair=1e-6,
    )
    w = SimulatedWorker(cfg)
    (r,) = run(w, 0, req("r", (1, 2), 10, output=4))
    prefill = 0.01 + 1e-4 * 10 + 1e-6 * (10 * 11 // 2)
    assert r.ttft_s == pytest.approx(prefill)
    decode = sum(0.01 + 0.001 + 1e-5 * (10 + g) for g in (1, 2, 3))  # context grows per token
    assert r.finish_s == pytest.approx(prefill + decode)
    # Its decode timing, as vLLM's per-request stats give it: 3 tokens after the first, in
    # the three decode steps' time.
    load = w.load()
    assert (load.decode_tokens, load.decode_s) == (3, pytest.approx(decode))


def test_batch_limit_queues_fifo():
    cfg = replace(PREFILL_ONLY, capacity_blocks=100, max_running=2, step_s=0.01)
    w = SimulatedWorker(cfg)
    outs = {"a": 3, "b": 10, "c": 2, "d": 2}
    for i, (rid, n) in enumerate(outs.items()):
        w.submit(req(rid, (10 * i + 1,), 5, output=n))
    w.advance_to(0.0)  # same-instant arrivals start together
    assert (w.load().running, w.load().waiting) == (2, 2)
    done = {r.request_id: r for r in w.drain()}
    assert done["c"].admitted_s == pytest.approx(done["a"].finish_s)  # first slot to free up
    assert done["d"].admitted_s == pytest.approx(done["c"].finish_s)  # b still runs: FIFO
    assert done["d"].admitted_s < done["b"].finish_s


def test_priority_scheduling_orders_the_queue_by_priority_then_arrival():
    cfg = replace(PREFILL_ONLY, capacity_blocks=100, max_running=1, step_s=0.01)
    order = [("low1", 0), ("low2", 0), ("high1", 5), ("mid", 2), ("high2", 5)]
    admitted = {}
    for policy in (False, True):
        w = SimulatedWorker(replace(cfg, priority_scheduling=policy))
        w.submit(req("running", (99,), 5, output=3))
        w.advance_to(0.0)
        for i, (rid, prio) in enumerate(order):
            w.submit(replace(req(rid, (10 * i + 1,), 5), priority=prio))
        done = sorted(w.drain(), key=lambda r: r.admitted_s)
        admitted[policy] = [r.request_id for r in done if r.request_id != "running"]
    assert admitted[False] == [rid for rid, _ in order]  # fcfs: as they came
    assert admitted[True] == ["high1", "high2", "mid", "low1", "low2"]


def test_a_full_hit_still_computes_the_last_token():
    w = SimulatedWorker(PREFILL_ONLY)
    run(w, 0, req("a", (1, 2, 3, 4), 16))
    (b,) = run(w, 1, req("b", (1, 2, 3, 4), 16))
    assert b.cached_tokens == 12  # as vLLM: at most prompt_tokens - 1, whole blocks
    assert b.ttft_s == pytest.approx(0.004)


def test_chunked_prefill_stores_blocks_as_chunks_complete():
    ev = Recorder()
    cfg = replace(PREFILL_ONLY, capacity_blocks=100, max_batched_tokens=8)
    w = SimulatedWorker(cfg, kv_sink=ev)
    run(w, 0, req("a", (1, 2, 3, 4, 5), 22))
    assert ev.batches == [
        [BlockStored(h(1, 2), None, block_size=4)],
        [BlockStored(h(3, 4), BlockHash(2), block_size=4)],
        [BlockStored(h(5), BlockHash(4), block_size=4)],  # the 2-token tail is not cached
    ]


def test_concurrent_identical_prompts_share_blocks():
    ev = Recorder()
    w = SimulatedWorker(replace(PREFILL_ONLY, capacity_blocks=100), kv_sink=ev)
    done = run(w, 0, req("a", (1, 2, 3), 13), req("b", (1, 2, 3), 13))
    assert [r.cached_tokens for r in done] == [0, 0]  # admitted together: neither could hit
    assert ev.take() == [BlockStored(h(1, 2, 3), None, block_size=4)]  # stored once
    assert w.load().kv_usage == 0.0 and w.cached_blocks() == set(h(1, 2, 3))


def test_abort_releases_and_reports():
    w = SimulatedWorker(replace(PREFILL_ONLY, capacity_blocks=100, step_s=0.01))
    w.submit(req("a", (1, 2, 3), 13, output=50))
    w.submit(req("b", (4,), 5, output=2))
    w.advance_to(0.1)
    res = w.abort("a")
    assert res is not None and res.aborted and res.first_token_s is not None
    assert w.abort("a") is None
    assert not w.is_active("a") and w.pinned_blocks() <= set(h(4))
    w.drain()
    assert w.load().kv_usage == 0.0 and w.idle


def test_rejects_requests_that_can_never_fit():
    w = SimulatedWorker(PREFILL_ONLY)
    with pytest.raises(ValueError, match="needs 9 KV blocks"):
        w.submit(req("big", (1, 2, 3, 4, 5, 6, 7, 8), 33))


# ---- properties over random workloads --------------------------------------------------------

workloads = st.lists(
    st.tuples(
        st.integers(0, 4),  # which chain
        st.integers(1, 40),  # prompt tokens
        st.integers(1, 6),  # output tokens
        st.floats(0, 0.05),  # gap to the previous arrival
        st.booleans(),  # abort it a bit later
    ),
    min_size=1,
    max_size=25,
)


def chain(c: int, n: int) -> tuple[BlockHash, ...]:
    """Prefix-chained blocks: chains 0-1 and 2-3 share their first blocks."""
    root = c // 2 * 1000
    return tuple(BlockHash(root + i if i < 3 else (c + 1) * 100_000 + i) for i in range(n))


def drive(cfg: SimWorkerConfig, work, check=None) -> list[SimResult]:
    w = SimulatedWorker(cfg, kv_sink=check.on_events if check else None)
    if check:
        check.worker = w
    t = 0.0
    done: list[SimResult] = []
    aborts: list[tuple[float, str]] = []
    for i, (c, prompt, out, gap, abort) in enumerate(work):
        t += gap
        for at, rid in [a for a in aborts if a[0] <= t]:
            done += w.advance_to(at)
            if (res := w.abort(rid)) is not None:
                done.append(res)
            aborts.remove((at, rid))
        done += w.advance_to(t)
        if check:
            check.verify(exact=False)
        w.submit(SimRequest(f"r{i}", chain(c, prompt // cfg.block_size), prompt, out))
        if abort:
            aborts.append((t + gap / 2, f"r{i}"))
    for at, rid in aborts:
        done += w.advance_to(at)
        if (res := w.abort(rid)) is not None:
            done.append(res)
    done += w.drain()
    if check:
        check.verify()
    return done


class Check:
    """Applies the worker's events and compares them with its cache after every step."""

    def __init__(self) -> None:
        self.held: set[BlockHash] = set()
        self.worker: SimulatedWorker | None = None

    def on_events(self, events) -> None:
        for e in events:
            if isinstance(e, BlockStored):
                assert not set(e.block_hashes) & self.held, "stored twice"
                self.held.update(e.block_hashes)
            elif isinstance(e, BlockRemoved):
                assert set(e.block_hashes) <= self.held
                self.held.difference_update(e.block_hashes)
        self.verify()

    def verify(self, exact: bool = True) -> None:
        """``exact``: at a step's end. Mid-step, blocks evicted by the step's admissions are
        announced only at its end (as vLLM does), so the events may still list them."""
        w = self.worker
        assert self.held == w.cached_blocks() if exact else self.held >= w.cached_blocks()
        assert all(rc >= 0 for rc in w._cached.values())
        assert set(w.eviction_order()) == w.cached_blocks() - w.pinned_blocks()
        assert len(w._cached) + w._private <= w.config.capacity_blocks and w._private >= 0
        assert 0.0 <= w.load().kv_usage <= 1.0
        for c in range(5):  # prefix-closed, so the binary search is exact
            blocks = chain(c, 10)
            linear = next((i for i, b in enumerate(blocks) if b not in w._cached), 10)
            assert w.prefix_hit_blocks(blocks) == linear


SMALL = SimWorkerConfig(
    capacity_blocks=24, block_size=4, max_running=3, max_batched_tokens=16, step_s=0.001
)


@settings(max_examples=150, deadline=None)
@given(workloads)
def test_events_always_match_the_cache(work):
    done = drive(SMALL, work, Check())
    assert sorted(r.request_id for r in done) == sorted(f"r{i}" for i in range(len(work)))


@settings(max_examples=100, deadline=None)
@given(workloads)
def test_coalesced_decode_steps_change_no_outcome(work):
    a = drive(SMALL, work)
    b = drive(replace(SMALL, coalesce_decode_steps=False), work)
    key = lambda r: r.request_id  # noqa: E731
    for x, y in zip(sorted(a, key=key), sorted(b, key=key), strict=True):
        assert (x.request_id, x.cached_tokens, x.output_tokens, x.aborted) == (
            y.request_id,
            y.cached_tokens,
            y.output_tokens,
            y.aborted,
        )
        assert x.finish_s == pytest.approx(y.finish_s)


@pytest.mark.parametrize("chunk", [0, 100, 1_000], ids=["no-prefill", "100", "1000"])
def test_a_decode_step_shared_with_a_prefill_chunk_lasts_longer(chunk: int):
    """The interference disaggregation removes: a decoding request's next token waits for the
    whole step, and the step's time grows with the prefill tokens batched into it."""
    cfg = SimWorkerConfig(
        capacity_blocks=1_000,
        block_size=4,
        step_s=0.01,
        decode_s_per_seq=0.0,
        decode_s_per_context_token=0.0,
        prefill_s_per_token=1e-4,
        attention_s_per_token_pair=0.0,
        max_batched_tokens=4_096,
        coalesce_decode_steps=False,
    )
    times: list[float] = []
    w = SimulatedWorker(cfg, token_sink=lambda rid, n, t: times.append(t) if rid == "d" else None)
    w.submit(req("d", (1,), 4, output=4))
    w.advance_to(0.0)
    w.advance_to(w.next_event_time())  # "d" prefilled: its first token; decoding from here
    if chunk:
        w.submit(req("p", (), chunk, output=1))
    w.drain()
    # The step planned when "d" got its first token was already under way when "p" arrived:
    # "p" joins the next one, and the token after it waits for its chunk.
    gap = times[2] - times[1]
    assert gap == pytest.approx(0.01 + 1e-4 * chunk)


def test_long_prefill_tokens_cap_each_request_chunk_so_a_short_one_is_not_held():
    """vLLM's long_prefill_token_threshold: a 400-token prompt prefills 100 tokens a step, so a
    short prompt arriving with it gets its first token after one step of 100 + its own tokens,
    not after the long prompt's whole 400."""
    cfg = replace(PREFILL_ONLY, capacity_blocks=200, step_s=0.001)
    for cap, short_ttft in ((0, 0.001 + 0.400 + 0.008), (100, 0.001 + 0.100 + 0.008)):
        w = SimulatedWorker(replace(cfg, long_prefill_tokens=cap))
        done = run(w, 0, req("long", tuple(range(1, 101)), 400), req("short", (500, 501), 8))
        by = {r.request_id: r for r in done}
        assert by["short"].ttft_s == pytest.approx(short_ttft)
        # The long one's prefill costs the same tokens either way, over more steps when capped.
        steps = 1 if cap == 0 else 4
        assert by["long"].ttft_s == pytest.approx(0.400 + 0.008 + steps * 0.001)
    with pytest.raises(ValueError, match="long_prefill_tokens"):
        SimWorkerConfig(long_prefill_tokens=-1)


def test_load_counts_the_output_tokens_emitted():
    """``generation_tokens``: cumulative output, as vLLM's counter, also mid-way through a run
    of coalesced decode steps once the run is cut (an arrival settles it)."""
    w = SimulatedWorker(replace(PREFILL_ONLY, capacity_blocks=64, step_s=1e-3))
    w.submit(req("a", (1, 2), 8, output=50))
    w.advance_to(0.02)  # prefilled (first token) and decoding
    w.submit(req("b", (3,), 4, output=5))  # settles the decode run in progress
    mid = w.load().generation_tokens
    assert 1 < mid < 50
    w.drain()
    assert w.load().generation_tokens == 55


def test_decode_timing_counts_finished_requests_that_decoded():
    """``decode_tokens`` / ``decode_s``: tokens after the first and first -> last token time,
    summed when a request finishes (a one-token request decoded nothing)."""
    w = SimulatedWorker(replace(PREFILL_ONLY, capacity_blocks=64, step_s=1e-3))
    run(w, 0, req("one", (1,), 4, output=1))
    assert (w.load().decode_tokens, w.load().decode_s) == (0, 0.0)
    w.submit(req("a", (2, 3), 8, output=20))
    w.advance_to(0.015)
    assert w.load().decode_tokens == 0  # decoding, not finished: not counted yet
    (a,) = w.drain()
    assert a.first_token_s is not None
    assert w.load().decode_tokens == 19
    assert w.load().decode_s == pytest.approx(a.finish_s - a.first_token_s)
    assert w.load().decode_s / 19 == pytest.approx(1e-3)  # a decode step: step_s alone here
