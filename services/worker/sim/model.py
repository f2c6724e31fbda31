"""A simulated inference server, in virtual time: a block-level prefix cache and a step-based
timing model shaped like vLLM's scheduler. NOT an engine: it computes no tokens; it only says when
tokens would come out, which prompt blocks would be served from the cache, and which KV events a
vLLM server would publish.

Pure and deterministic: no asyncio, no wall clock, no grpc or vllm. ``engine.SimulatedEngine``
puts it behind the worker's ``Engine`` protocol in real time; ``benchmarks/replay`` runs hundreds
of them in one virtual clock. docs/simulator.md describes the model and its default parameters.

What it models (vLLM v1 with prefix caching and chunked prefill):

- **Blocks.** ``capacity_blocks`` KV blocks of ``block_size`` tokens. A prompt's full blocks are
  identified by prefix-chained hashes (equal hash = equal content *and* equal prefix). A block is
  cached (can be hit) from the end of the step that computed it; a finished request's blocks stay
  cached, unreferenced, until evicted. The partial last prompt block and the output blocks are
  never cached. Eviction takes the least recently released unreferenced block; a request releases
  its blocks tail first (vLLM's free-queue order), so a prefix outlives its continuations and the
  cache stays prefix-closed. Blocks referenced by an admitted request are pinned.
- **Admission.** FIFO. A waiting request is admitted when fewer than ``max_running`` run, the
  step has token budget left, and its whole KV (prompt and output blocks, minus the blocks it
  hits) fits in free plus evictable blocks; it is never preempted. The head of the queue blocks
  the rest (vLLM's FCFS policy). The cache is looked up at admission; at most
  ``(prompt_tokens - 1) // block_size`` blocks can hit (vLLM recomputes the last prompt token).
- **Steps.** Each engine step decodes one token for every request past its prefill and spends the
  remaining ``max_batched_tokens`` on prefill chunks, oldest request first (at most
  ``long_prefill_tokens`` per request and step when set). A step lasts
  ``step_s + decode_s_per_seq * decoding + decode_s_per_context_token * their context tokens +
  prefill_s_per_token * chunk tokens + attention_s_per_token_pair * (query, key) pairs``. The
  step that completes a prompt also yields its first token. Identical decode-only steps are
  coalesced into one event (an arrival or abort cuts the run short at the step in progress).
- **KV events**, one batch per step at its end, like vLLM's: ``BlockRemoved`` for blocks evicted
  by that step's admissions, then ``BlockStored`` runs (with parent chaining) for the blocks its
  prefill chunks completed. A block another request stored meanwhile is shared, not stored twice.
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from itertools import islice

from kvmesh.kv.events import BlockHash, BlockRemoved, BlockStored, KvEvent, Tier

KvSink = Callable[[Sequence[KvEvent]], None]
TokenSink = Callable[[str, int, float], None]  # (request_id, new tokens, virtual time)

INFINITY = math.inf


@dataclass(frozen=True, slots=True)
class SimWorkerConfig:
    """One simulated server. Defaults: an 8B model (Llama-3-8B shapes: 128 KiB of KV per token)
    on an H100-class GPU; see docs/simulator.md for how they were estimated. Assumptions, not
    measurements."""

    capacity_blocks: int = 16_384  # KV blocks (16,384 x 32 tokens = 512K tokens, 64 GiB)
    block_size: int = 32  # tokens per block
    max_running: int = 256  # most requests admitted at once (vLLM max_num_seqs)
    max_batched_tokens: int = 8_192  # tokens per step, decodes + prefill chunks
    step_s: float = 0.006  # fixed cost of one forward pass (weight reads, launches), seconds
    decode_s_per_seq: float = 0.000_1  # extra per decoding request per step, seconds
    decode_s_per_context_token: float = 4e-8  # KV read per context token per decode step, s
    prefill_s_per_token: float = 5e-5  # linear (MLP/projection) cost per prefilled token, s
    attention_s_per_token_pair: float = 1e-9  # per (query, earlier key) pair in prefill, s
    # Loading a handed-over block (SimRequest.external_blocks) into the KV cache, per token, s:
    # charged to the step that admits the request (2e-6: ~64 GB/s for 128 KiB per token).
    load_s_per_token: float = 2e-6
    coalesce_decode_steps: bool = True  # one event for a run of identical decode steps
    # vLLM's priority scheduling: the queue ordered by SimRequest.priority (higher first, then
    # arrival); off: FIFO (vLLM's fcfs). Running requests are never pre-empted either way.
    priority_scheduling: bool = False
    # vLLM's long_prefill_token_threshold: most prompt tokens one request prefills per step
    # (its prompt is cut into chunks of at most this), so a long prefill does not make one step
    # long for every other request in it; 0: no cap (the step's budget).
    long_prefill_tokens: int = 0

    def __post_init__(self) -> None:
        if self.capacity_blocks <= 0 or self.block_size <= 0:
            raise ValueError("capacity_blocks and block_size must be > 0")
        if self.max_running <= 0 or self.max_batched_tokens <= 0:
            raise ValueError("max_running and max_batched_tokens must be > 0")
        if self.long_prefill_tokens < 0:
            raise ValueError("long_prefill_tokens must be >= 0 (0: no cap)")
        times = (
            self.step_s,
            self.decode_s_per_seq,
            self.decode_s_per_context_token,
            self.prefill_s_per_token,
            self.attention_s_per_token_pair,
            self.load_s_per_token,
        )
        if min(times) < 0:
            raise ValueError("timing parameters must be >= 0")


@dataclass(frozen=True, slots=True)
class SimRequest:
    request_id: str
    block_hashes: tuple[BlockHash, ...] = field(repr=False)  # the prompt's full blocks, chained
    prompt_tokens: int
    output_tokens: int  # tokens to generate (>= 1)
    # Leading prompt blocks whose KV is loaded from outside the engine at admission (a KV
    # hand-off from a prefill worker through the node kvmanager), as vLLM's KV connector would:
    # they count as cached, cost ``load_s_per_token``, and are not prefilled.
    external_blocks: int = 0
    priority: int = 0  # higher first, with ``SimWorkerConfig.priority_scheduling``


@dataclass(frozen=True, slots=True)
class SimResult:
    """What happened to one request, in virtual seconds."""

    request_id: str
    arrival_s: float
    admitted_s: float | None  # None: aborted while waiting
    first_token_s: float | None  # None: aborted before its prefill completed
    finish_s: float
    prompt_tokens: int
    cached_tokens: int  # prompt tokens served from the cache at admission
    output_tokens: int  # tokens generated
    aborted: bool = False
    loaded_tokens: int = 0  # of cached_tokens, those loaded from outside (external_blocks)

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.arrival_s


@dataclass(frozen=True, slots=True)
class SimLoad:
    running: int  # admitted, not finished
    waiting: int  # submitted, not admitted
    kv_usage: float  # fraction of blocks referenced by admitted requests, [0, 1]
    in_flight_tokens: int  # prompt + output tokens of every unfinished request
    # Prompt tokens still to prefill: exact for admitted requests; for waiting ones, the prompt
    # less the prefix the cache held when it arrived (an estimate: the cache may change).
    pending_prefill_tokens: int
    prefix_queried_tokens: int = 0  # cumulative prompt tokens looked up at admission
    prefix_hit_tokens: int = 0  # cumulative prompt tokens served from the cache
    # Cumulative over completed prefills, as vLLM's per-request stats: prompt tokens computed
    # (not served from a cache) and the seconds from admission to the first token.
    prefill_computed_tokens: int = 0
    prefill_s: float = 0.0
    generation_tokens: int = 0  # cumulative output tokens emitted (vLLM's generation tokens)
    # Cumulative over finished requests, as vLLM's per-request stats (decode_time,
    # num_generation_tokens): their tokens after the first and the simulated seconds from their
    # first token to their last.
    decode_tokens: int = 0
    decode_s: float = 0.0


class _Run:
    """A request's mutable state inside the worker."""

    __slots__ = (
        "admitted_s",
        "arrival_s",
        "backlog",
        "computed",
        "done",
        "external",
        "first_token_s",
        "generated",
        "hit_blocks",
        "loaded",
        "n_full",
        "private",
        "req",
        "stored",
    )

    def __init__(self, req: SimRequest, arrival_s: float, block_size: int) -> None:
        self.req = req
        self.arrival_s = arrival_s
        self.admitted_s: float | None = None
        self.first_token_s: float | None = None
        self.n_full = min(len(req.block_hashes), req.prompt_tokens // block_size)
        self.hit_blocks = 0
        self.loaded = 0  # tokens loaded from outside at admission, not yet charged to a step
        self.external = 0  # tokens loaded from outside at admission
        self.computed = 0  # prompt tokens whose KV exists
        self.stored = 0  # leading prompt blocks this request references in the cache
        self.private = 0  # blocks it holds outside the cache (uncomputed, partial, output)
        self.generated = 0
        self.done = False
        self.backlog = 0  # while waiting: the prompt tokens it counts in pending_prefill_tokens


class _Step:
    """One engine step, or a run of ``count`` decode-only steps: the k-th (from 0) lasts
    ``first + growth * k`` (each step adds a token to every decoding request's context)."""

    __slots__ = ("chunks", "count", "decoders", "end", "first", "growth", "start")

    def __init__(
        self,
        start: float,
        first: float,
        growth: float,
        count: int,
        chunks: list[tuple[_Run, int, int]],
        decoders: list[_Run],
    ) -> None:
        self.start = start
        self.first = first
        self.growth = growth
        self.chunks = chunks
        self.decoders = decoders
        self.count = count
        self.end = start + self.elapsed(count)

    def elapsed(self, steps: int) -> float:
        """Time the first ``steps`` steps take."""
        return steps * self.first + self.growth * (steps * (steps - 1) // 2)

    def steps_done(self, elapsed: float) -> int:
        """How many whole steps fit in ``elapsed`` seconds from the start."""
        a, b = self.growth / 2, self.first - self.growth / 2
        if a > 0:
            j = int((-b + math.sqrt(b * b + 4 * a * elapsed)) / (2 * a))
        elif b > 0:
            j = int(elapsed / b)
        else:
            return self.count
        while j > 0 and self.elapsed(j) > elapsed:
            j -= 1
        while self.elapsed(j + 1) <= elapsed:
            j += 1
        return j


class SimulatedWorker:
    """One simulated server in virtual time. Drive it with ``advance_to(t)`` (then ``submit``
    arrivals at ``now``); ``next_event_time()`` says when it next changes on its own."""

    def __init__(
        self,
        config: SimWorkerConfig | None = None,
        *,
        kv_sink: KvSink | None = None,
        token_sink: TokenSink | None = None,
    ) -> None:
        self.config = config or SimWorkerConfig()
        self.now = 0.0
        self._kv_sink = kv_sink
        self._token_sink = token_sink
        self._cached: dict[BlockHash, int] = {}  # block -> references by admitted requests
        self._evictable: OrderedDict[BlockHash, None] = OrderedDict()  # refcount 0, LRU first
        self._private = 0
        self._runs: dict[str, _Run] = {}  # every unfinished request
        self._waiting: deque[_Run] = deque()
        self._prefilling: list[_Run] = []  # admitted, prompt not complete; admission order
        self._decoding: list[_Run] = []
        self._step: _Step | None = None
        self._replan = False  # idle, and work arrived: plan a step at ``now``
        self._events: list[KvEvent] = []  # of the step in progress
        self._in_flight_tokens = 0
        self._waiting_tokens = 0
        self._queried_tokens = 0
        self._hit_tokens = 0
        self._prefill_tokens = 0
        self._prefill_s = 0.0
        self._generated = 0  # output tokens emitted, cumulative
        self._decode_tokens = 0  # finished requests' tokens after their first, cumulative
        self._decode_s = 0.0  # and their first -> last token times
        self._mem_version = 0  # bumped whenever blocks are released
        self._blocked: tuple[_Run, int] | None = None  # head that did not fit, at mem version

    # ---- driving -------------------------------------------------------------------------------
    def submit(self, request: SimRequest) -> None:
        """Queues ``request``, arriving now. Raises ``ValueError`` if it can never fit."""
        cfg = self.config
        if request.request_id in self._runs:
            raise ValueError(f"request {request.request_id!r} is already on this worker")
        if request.prompt_tokens <= 0 or request.output_tokens <= 0:
            raise ValueError("prompt_tokens and output_tokens must be > 0")
        need = self.blocks_needed(request)
        if need > cfg.capacity_blocks:
            raise ValueError(
                f"request {request.request_id!r} needs {need} KV blocks "
                f"({request.prompt_tokens} prompt + {request.output_tokens} output tokens); "
                f"this worker has {cfg.capacity_blocks}"
            )
        run = _Run(request, self.now, cfg.block_size)
        limit = min(run.n_full, (request.prompt_tokens - 1) // cfg.block_size)
        run.backlog = request.prompt_tokens - cfg.block_size * max(
            self.prefix_hit_blocks(request.block_hashes, limit),
            min(request.external_blocks, limit),
        )
        self._runs[request.request_id] = run
        self._enqueue(run)
        self._in_flight_tokens += request.prompt_tokens + request.output_tokens
        self._waiting_tokens += run.backlog
        self._settle()
        self._interrupt()

    def _enqueue(self, run: _Run) -> None:
        """FIFO, or behind the last waiting request of the same or a higher priority."""
        waiting = self._waiting
        if not self.config.priority_scheduling:
            waiting.append(run)
            return
        at = len(waiting)
        while at > 0 and waiting[at - 1].req.priority < run.req.priority:
            at -= 1
        waiting.insert(at, run)

    def abort(self, request_id: str) -> SimResult | None:
        """Drops a request (waiting or running); its blocks are released now. None if unknown."""
        run = self._runs.pop(request_id, None)
        if run is None:
            return None
        self._settle()
        run.done = True
        self._in_flight_tokens -= run.req.prompt_tokens + run.req.output_tokens
        if run.admitted_s is None:
            self._waiting.remove(run)
            self._waiting_tokens -= run.backlog
        else:
            (self._decoding if run.first_token_s is not None else self._prefilling).remove(run)
            self._release(run)
        self._interrupt()
        return self._result(run, aborted=True)

    def next_event_time(self) -> float:
        """When the worker next changes on its own: the end of the step in progress, or now if
        it was idle and got work (requests arriving at the same instant start together);
        ``math.inf``: idle."""
        if self._replan:
            return self.now
        return INFINITY if self._step is None else self._step.end

    def advance_to(self, t: float) -> list[SimResult]:
        """Runs every step that ends at or before ``t``; returns the requests that finished."""
        results: list[SimResult] = []
        if self._replan and t >= self.now:
            self._replan = False
            self._plan()
        step = self._step
        while step is not None and step.end <= t:
            self.now = step.end
            self._complete(step, results)
            self._plan()
            step = self._step
        if t > self.now:
            self.now = t
        return results

    def drain(self) -> list[SimResult]:
        """Runs until idle; ``now`` is left at the last step's end."""
        results: list[SimResult] = []
        while (t := self.next_event_time()) < INFINITY:
            results += self.advance_to(t)
        return results

    # ---- looking -------------------------------------------------------------------------------
    def blocks_needed(self, request: SimRequest) -> int:
        return -(-(request.prompt_tokens + request.output_tokens) // self.config.block_size)

    def prefix_hit_blocks(self, block_hashes: Sequence[BlockHash], limit: int | None = None) -> int:
        """How many leading blocks of ``block_hashes`` (at most ``limit``) are cached now.
        O(log n): the cache is prefix-closed (see the module doc), so a binary search is exact."""
        n = len(block_hashes) if limit is None else min(limit, len(block_hashes))
        cached = self._cached
        if n <= 0 or block_hashes[0] not in cached:
            return 0
        if block_hashes[n - 1] in cached:
            return n
        lo, hi = 0, n - 1  # block lo is cached, block hi is not
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if block_hashes[mid] in cached:
                lo = mid
            else:
                hi = mid
        return hi

    def cached_blocks(self) -> frozenset[BlockHash]:
        return frozenset(self._cached)

    def pinned_blocks(self) -> frozenset[BlockHash]:
        return frozenset(h for h, rc in self._cached.items() if rc > 0)

    def eviction_order(self) -> list[BlockHash]:
        """Unreferenced cached blocks, next to be evicted first."""
        return list(self._evictable)

    def cached_tokens_of(self, request_id: str) -> int:
        """Prompt tokens an unfinished request got from the cache (0 until admitted)."""
        run = self._runs.get(request_id)
        return 0 if run is None else run.hit_blocks * self.config.block_size

    def is_active(self, request_id: str) -> bool:
        return request_id in self._runs

    def has_first_token(self, request_id: str) -> bool:
        """The request's prefill is done (or it is no longer here)."""
        run = self._runs.get(request_id)
        return run is None or run.first_token_s is not None

    @property
    def idle(self) -> bool:
        return self._step is None

    def load(self) -> SimLoad:
        cap = self.config.capacity_blocks
        used = len(self._cached) - len(self._evictable) + self._private
        pending = self._waiting_tokens
        for run in self._prefilling:
            pending += run.req.prompt_tokens - run.computed
        return SimLoad(
            running=len(self._prefilling) + len(self._decoding),
            waiting=len(self._waiting),
            kv_usage=min(1.0, used / cap),
            in_flight_tokens=self._in_flight_tokens,
            pending_prefill_tokens=pending,
            prefix_queried_tokens=self._queried_tokens,
            prefix_hit_tokens=self._hit_tokens,
            prefill_computed_tokens=self._prefill_tokens,
            prefill_s=self._prefill_s,
            generation_tokens=self._generated,
            decode_tokens=self._decode_tokens,
            decode_s=self._decode_s,
        )

    # ---- internals -----------------------------------------------------------------------------
    def _settle(self) -> None:
        """Mid-way through a run of decode-only steps: credits the steps already done and
        leaves only the one in progress, so a change now is seen at its end."""
        step = self._step
        if step is None or step.count == 1:
            return
        done = min(step.steps_done(self.now - step.start), step.count - 1)
        if done <= 0:
            step.count = 1
            step.end = step.start + step.first
            return
        at = step.start + step.elapsed(done)
        sink = self._token_sink
        for run in step.decoders:
            if not run.done:
                run.generated += done
                self._generated += done
                if sink is not None:
                    sink(run.req.request_id, done, at)
        step.start = at
        step.first += step.growth * done
        step.count = 1
        step.end = at + step.first

    def _interrupt(self) -> None:
        """Something changed between steps: if idle, plan a step at the next ``advance_to``."""
        if self._step is None:
            self._replan = bool(self._waiting)

    def _plan(self) -> None:
        """Schedules the next step, starting now (or goes idle)."""
        cfg = self.config
        decoding = self._decoding
        budget = cfg.max_batched_tokens - len(decoding)
        chunks: list[tuple[_Run, int, int]] = []
        cap = cfg.long_prefill_tokens or cfg.max_batched_tokens
        for run in self._prefilling:
            if budget <= 0:
                break
            n = min(run.req.prompt_tokens - run.computed, budget, cap)
            chunks.append((run, run.computed, run.computed + n))
            budget -= n
        waiting = self._waiting
        while (
            waiting
            and budget > 0
            and len(self._prefilling) + len(decoding) < cfg.max_running
            and self._admit(waiting[0])
        ):
            run = waiting.popleft()
            self._waiting_tokens -= run.backlog
            self._prefilling.append(run)
            n = min(run.req.prompt_tokens - run.computed, budget, cap)
            chunks.append((run, run.computed, run.computed + n))
            budget -= n
        if not chunks and not decoding:
            self._step = None
            return
        duration = cfg.step_s
        count = 1
        growth = 0.0
        if decoding:
            context = 0
            for run in decoding:
                context += run.req.prompt_tokens + run.generated
            duration += (
                cfg.decode_s_per_seq * len(decoding) + cfg.decode_s_per_context_token * context
            )
            if not chunks and cfg.coalesce_decode_steps:
                count = min(run.req.output_tokens - run.generated for run in decoding)
                growth = cfg.decode_s_per_context_token * len(decoding)
        pair_s = cfg.attention_s_per_token_pair
        for run, a, b in chunks:
            if run.loaded:
                duration += cfg.load_s_per_token * run.loaded
                run.loaded = 0
            duration += cfg.prefill_s_per_token * (b - a)
            if pair_s:
                duration += pair_s * ((b * (b + 1) - a * (a + 1)) // 2)
        self._step = _Step(self.now, duration, growth, count, chunks, list(decoding))

    def _admit(self, run: _Run) -> bool:
        """Looks the prompt up, pins its hits and reserves the rest; False if it does not fit."""
        if self._blocked is not None and self._blocked == (run, self._mem_version):
            return False  # nothing was released since it last did not fit
        cfg = self.config
        req = run.req
        bs = cfg.block_size
        hashes = req.block_hashes
        hit = self.prefix_hit_blocks(hashes, min(run.n_full, (req.prompt_tokens - 1) // bs))
        cached = self._cached
        reclaim = 0  # hits that are evictable now, so no longer available once pinned
        for h in islice(hashes, hit):
            if not cached[h]:
                reclaim += 1
        need = self.blocks_needed(req) - hit
        free = cfg.capacity_blocks - len(cached) - self._private
        if need > free + len(self._evictable) - reclaim:
            self._blocked = (run, self._mem_version)
            return False
        self._blocked = None
        evictable = self._evictable
        for h in islice(hashes, hit):
            rc = cached[h]
            if not rc:
                del evictable[h]
            cached[h] = rc + 1
        short = need - free
        if short > 0:
            removed = []
            for _ in range(short):
                h, _none = evictable.popitem(last=False)
                del cached[h]
                removed.append(h)
            if self._kv_sink is not None:
                self._events.append(BlockRemoved(tuple(removed), Tier.GPU))
        self._private += need
        run.private = need
        run.hit_blocks = run.stored = hit
        run.computed = hit * bs
        ext = min(req.external_blocks, run.n_full, (req.prompt_tokens - 1) // bs)
        if ext > hit:  # handed-over blocks: loaded now, cached from the admitting step on
            run.loaded = run.external = (ext - hit) * bs
            run.hit_blocks = ext
            run.computed = ext * bs
            self._store(run, ext)
        run.admitted_s = self.now
        self._queried_tokens += req.prompt_tokens
        self._hit_tokens += run.hit_blocks * bs
        return True

    def _store(self, run: _Run, upto: int) -> None:
        """``run`` computed its prompt blocks up to ``upto``: they enter the cache."""
        start = run.stored
        if upto <= start:
            return
        hashes = run.req.block_hashes
        cached = self._cached
        evictable = self._evictable
        emit = self._kv_sink is not None
        first = -1  # index where the current run of newly stored blocks began
        for i in range(start, upto):
            h = hashes[i]
            rc = cached.get(h)
            if rc is None:
                cached[h] = 1
                if first < 0:
                    first = i
            else:  # another request stored it meanwhile: share it, free our copy
                if not rc:
                    del evictable[h]
                cached[h] = rc + 1
                if emit and first >= 0:
                    self._emit_stored(hashes, first, i)
                first = -1
        if emit and first >= 0:
            self._emit_stored(hashes, first, upto)
        n = upto - start
        run.stored = upto
        run.private -= n
        self._private -= n
        if n:
            self._mem_version += 1

    def _emit_stored(self, hashes: Sequence[BlockHash], a: int, b: int) -> None:
        parent = hashes[a - 1] if a > 0 else None
        self._events.append(
            BlockStored(tuple(hashes[a:b]), parent, Tier.GPU, self.config.block_size)
        )

    def _release(self, run: _Run) -> None:
        """Unpins ``run``'s cached blocks, tail first (evicted before their prefix)."""
        hashes = run.req.block_hashes
        cached = self._cached
        evictable = self._evictable
        for i in range(run.stored - 1, -1, -1):
            h = hashes[i]
            rc = cached[h] - 1
            cached[h] = rc
            if not rc:
                evictable[h] = None
        self._private -= run.private
        run.private = 0
        self._mem_version += 1

    def _complete(self, step: _Step, results: list[SimResult]) -> None:
        now = self.now
        sink = self._token_sink
        count = step.count
        finished = False
        for run in step.decoders:
            if run.done:
                continue
            run.generated += count
            self._generated += count
            if sink is not None:
                sink(run.req.request_id, count, now)
            if run.generated >= run.req.output_tokens:
                self._finish(run, results)
                finished = True
        if finished:
            self._decoding = [r for r in self._decoding if not r.done]
        bs = self.config.block_size
        prefilled = False
        for run, _a, b in step.chunks:
            if run.done:
                continue
            run.computed = b
            self._store(run, min(b // bs, run.n_full))
            if b >= run.req.prompt_tokens:
                prefilled = True
                run.first_token_s = now
                self._prefill_tokens += run.req.prompt_tokens - run.hit_blocks * bs
                self._prefill_s += now - (run.admitted_s or now)
                run.generated = 1
                self._generated += 1
                if sink is not None:
                    sink(run.req.request_id, 1, now)
                if run.req.output_tokens <= 1:
                    self._finish(run, results)
                else:
                    self._decoding.append(run)
        if prefilled:
            self._prefilling = [r for r in self._prefilling if r.first_token_s is None]
        if self._events:
            events, self._events = self._events, []
            if self._kv_sink is not None:
                self._kv_sink(events)

    def _finish(self, run: _Run, results: list[SimResult]) -> None:
        run.done = True
        del self._runs[run.req.request_id]
        if run.generated > 1 and run.first_token_s is not None:  # it decoded: vLLM's timing
            self._decode_tokens += run.generated - 1
            self._decode_s += self.now - run.first_token_s
        self._in_flight_tokens -= run.req.prompt_tokens + run.req.output_tokens
        self._release(run)
        results.append(self._result(run))

    def _result(self, run: _Run, aborted: bool = False) -> SimResult:
        return SimResult(
            request_id=run.req.request_id,
            arrival_s=run.arrival_s,
            admitted_s=run.admitted_s,
            first_token_s=run.first_token_s,
            finish_s=self.now,
            prompt_tokens=run.req.prompt_tokens,
            cached_tokens=run.hit_blocks * self.config.block_size,
            output_tokens=run.generated,
            aborted=aborted,
            loaded_tokens=run.external,
        )
