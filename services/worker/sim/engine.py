"""``SimulatedEngine``: the worker's ``Engine`` protocol over a ``SimulatedWorker``, in asyncio
real time (optionally sped up). It computes nothing: it streams made-up token ids (a deterministic
function of the request id) at the times the simulated server would produce them, reports the
cached prompt tokens the simulated prefix cache would serve, and publishes the KV events a vLLM
server would. Lets the real worker service, router and index run at cluster scale without GPUs.

Prompt token ids are turned into block hashes by the injected ``hasher`` (pass vLLM-exact
hashing to make the events comparable with a real engine's); the default,
``simple_block_hashes``, is a deterministic chained hash that is NOT vLLM-compatible.

A prompt that ends with the start of the request's own made-up output (a request resumed after
its worker failed mid-stream) gets the rest of it: the output continues, as a model's would.

Not simulated: text (each token's text is `` t<id>``), stop strings (only ``stop_token_ids``,
``max_tokens``, the context length and an optional simulated end of sequence end a request),
sampling parameters (ignored, except ``min_tokens``). A structured output, log probabilities,
logit bias and penalties are refused (INVALID_ARGUMENT naming the field): made-up tokens
cannot honour a schema and have no probabilities or logits, and ignoring any of them would
answer with output that breaks the request.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import logging
import math
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field, replace

from kvmesh import errors
from kvmesh.kv.events import BlockHash, BlockStored, KvEvent
from kvmesh.sampling import STRUCTURED_FIELD

from ..core import (
    CachedTokens,
    EngineInfo,
    EngineLoad,
    Finish,
    FinishReason,
    GenerateRequest,
    KvEventSink,
    OutputDelta,
    Sampling,
    Timing,
)
from .handoff import SimKvStores
from .model import SimRequest, SimResult, SimulatedWorker, SimWorkerConfig

log = logging.getLogger(__name__)

Hasher = Callable[[Sequence[int]], Sequence[BlockHash]]
"""Token ids -> hashes of the prompt's full blocks, prefix-chained."""

SaltedHasher = Callable[[Sequence[int], str], Sequence[BlockHash]]
"""Token ids and a request's cache salt -> its block hashes (vLLM puts the salt in the first
block's hash, so every block of the chain differs)."""

_MASK = (1 << 64) - 1
HASH_IN_THREAD_TOKENS = 8_192  # prompts longer than this are hashed off the event loop


def simple_block_hashes(block_size: int) -> Hasher:
    """A deterministic prefix-chained block hash (the same in every process). NOT vLLM's: use
    it only where nothing compares the hashes with a real engine's."""

    def hasher(token_ids: Sequence[int]) -> list[BlockHash]:
        out: list[BlockHash] = []
        parent = 0
        for i in range(0, len(token_ids) - block_size + 1, block_size):
            parent = hash((parent, *token_ids[i : i + block_size])) & _MASK
            out.append(BlockHash(parent))
        return out

    return hasher


def salted_fallback(hasher: Hasher) -> SaltedHasher:
    """``hasher``'s blocks, each hash mixed with the salt: per-salt blocks as an engine keeps
    them, though not vLLM's values (give the engine a ``salted_hasher`` where they matter)."""

    def salted(token_ids: Sequence[int], cache_salt: str) -> list[BlockHash]:
        salt = cache_salt.encode()
        return [
            BlockHash(int.from_bytes(hashlib.sha256(salt + h.to_bytes(8, "big")).digest()[:8]))
            for h in hasher(token_ids)
        ]

    return salted


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


def _seed(request_id: str) -> int:
    return int.from_bytes(hashlib.blake2b(request_id.encode(), digest_size=8).digest(), "big")


def fake_token_ids(request_id: str, count: int, vocab_size: int, start: int = 0) -> list[int]:
    """The made-up output of ``request_id``: the same ids for the same request id everywhere
    (``start``: from its start-th token on)."""
    seed = _seed(request_id)
    return [_splitmix64(seed + i) % vocab_size for i in range(start, start + count)]


def replayed_tokens(request_id: str, prompt: Sequence[int], vocab_size: int) -> int:
    """How many of ``request_id``'s made-up output tokens end ``prompt``: a request resumed on
    another worker sends its prompt plus the tokens the client has (docs/failover.md), and the
    made-up output goes on after them, as a model continues its own text. 0: none."""
    seed = _seed(request_id)
    first = _splitmix64(seed) % vocab_size
    n, at = len(prompt), 0
    while True:
        try:
            i = prompt.index(first, at)
        except ValueError:
            return 0
        if all(prompt[i + j] == _splitmix64(seed + j) % vocab_size for j in range(1, n - i)):
            return n - i
        at = i + 1


def _check_simulated(s: Sampling) -> None:
    """The made-up output has no logits to bias or penalize: such requests are refused rather
    than answered as if the controls had applied (temperature, top_p and top_k are ignored,
    as the module says; min_tokens is simulated)."""
    unsupported = [
        ("presence_penalty", s.presence_penalty not in (None, 0.0)),
        ("frequency_penalty", s.frequency_penalty not in (None, 0.0)),
        ("repetition_penalty", s.repetition_penalty not in (None, 1.0)),
        ("logit_bias", bool(s.logit_bias)),
    ]
    for name, used in unsupported:
        if used:
            raise errors.InvalidArgument(
                f"the simulated engine does not support sampling.{name} (its tokens are made "
                "up, without logits); omit it or use a vLLM worker",
                f"sampling.{name}",
            )


def _no_stops_before(output: list[int], stops: set[int], min_tokens: int, vocab: int) -> None:
    """Like vLLM's min_tokens: no stop token id among the first ``min_tokens`` outputs (each
    made-up one is replaced by the next id that is not a stop token)."""
    for i in range(min(min_tokens, len(output))):
        t = output[i]
        for _ in range(len(stops) + 1):
            if t not in stops:
                break
            t = (t + 1) % vocab
        output[i] = t


@dataclass(frozen=True, slots=True)
class SimEngineConfig:
    worker: SimWorkerConfig = field(default_factory=SimWorkerConfig)
    model: str = "simulated"  # served model name
    max_model_len: int = 0  # context length in tokens; 0: what the KV capacity holds
    vocab_size: int = 32_000  # token ids must be < this
    speedup: float = 1.0  # virtual seconds per real second
    eos_after_tokens: int = 0  # > 0: the "model" ends with STOP after this many tokens unless
    # the request sets ignore_eos (0: every request runs to max_tokens)


class _Stream:
    __slots__ = ("done", "from_peer", "output", "queue", "request", "stop_reason")

    def __init__(self, request: SimRequest, output: list[int], stop_reason: str | None) -> None:
        self.request = request
        self.output = output  # the token ids it will produce
        self.stop_reason = stop_reason  # None: it ends by length
        self.queue: asyncio.Queue[int | SimResult] = asyncio.Queue()  # new tokens, or the end
        self.done = False
        self.from_peer = False  # its external blocks came from another node's store


class SimulatedEngine:
    """Implements ``services.worker.core.Engine`` on a simulated server. Construct, serve, then
    ``await close()``; its clock task starts with the first request."""

    def __init__(
        self,
        config: SimEngineConfig | None = None,
        *,
        hasher: Hasher | None = None,
        salted_hasher: SaltedHasher | None = None,
        clock: Callable[[], float] = time.monotonic,
        kv_stores: SimKvStores | None = None,
        kvmanager_id: str = "",
    ) -> None:
        """``kv_stores`` and ``kvmanager_id``: the simulated node kvmanagers and this engine's
        own (see ``handoff.py``): computed prompt blocks are saved there, and a request's
        ``kv_source`` is loaded from there. None: no hand-off (``kv_source`` is ignored).
        ``salted_hasher`` hashes requests that carry a ``cache_salt`` (default: ``hasher``'s
        hashes mixed with the salt, ``salted_fallback``)."""
        cfg = config or SimEngineConfig()
        if cfg.speedup <= 0:
            raise ValueError("speedup must be > 0")
        self._config = cfg
        wcfg = replace(cfg.worker, coalesce_decode_steps=False)  # stream every step's token
        capacity_tokens = wcfg.capacity_blocks * wcfg.block_size
        max_len = cfg.max_model_len or capacity_tokens - wcfg.block_size
        if max_len > capacity_tokens - wcfg.block_size:
            raise ValueError(
                f"max_model_len {max_len} does not fit the simulated KV capacity "
                f"({capacity_tokens} tokens, one block kept for the partial block)"
            )
        self._info = EngineInfo(
            model=cfg.model,
            model_path="(simulated)",
            max_model_len=max_len,
            block_size=wcfg.block_size,
            vocab_size=cfg.vocab_size,
            max_running_requests=wcfg.max_running,
        )
        self._hasher = hasher or simple_block_hashes(wcfg.block_size)
        self._salted_hasher = salted_hasher or salted_fallback(self._hasher)
        self._kv_stores = kv_stores
        self._kvmanager_id = kvmanager_id
        self.handoffs: list[tuple[str, int, float]] = []  # (request id, blocks loaded, waited s)
        self._clock = clock
        self._t0 = clock()
        self._worker = SimulatedWorker(wcfg, kv_sink=self._on_kv, token_sink=self._on_tokens)
        self._streams: dict[str, _Stream] = {}
        self._listeners: list[Callable[[], None]] = []
        self._kv_sink: KvEventSink | None = None
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._closed = False
        # Requests submitted since the clock last ran the server's steps: no step has looked at
        # them yet, so the load does not count them as waiting (see ``load``).
        self._unstepped = 0

    # ---- Engine protocol -------------------------------------------------------------------
    @property
    def info(self) -> EngineInfo:
        return self._info

    @property
    def worker(self) -> SimulatedWorker:
        """The simulated server (tests look at its cache)."""
        return self._worker

    def is_running(self, request_id: str) -> bool:
        return request_id in self._streams

    def load(self) -> EngineLoad:
        """As vLLM reports it, from its steps: a request that arrived since the last step is
        in flight (the servicer counts it) but not yet waiting. Counting it as waiting made the
        report pushed at each arrival say "queued" for up to a load interval after the request
        had been admitted, or had even finished (docs/failover.md, active-active)."""
        s = self._worker.load()
        return EngineLoad(
            running_requests=s.running,
            waiting_requests=max(0, s.waiting - self._unstepped),
            kv_cache_usage=s.kv_usage,
            prefix_cache_queried_tokens=s.prefix_queried_tokens,
            prefix_cache_hit_tokens=s.prefix_hit_tokens,
            prefill_computed_tokens=s.prefill_computed_tokens,
            # Wall seconds, as an engine measures them (the model counts virtual ones).
            prefill_s=s.prefill_s / self._config.speedup,
            generation_tokens=s.generation_tokens,
            decode_tokens=s.decode_tokens,
            decode_s=s.decode_s / self._config.speedup,  # simulated, in wall seconds
        )

    def add_load_listener(self, listener: Callable[[], None]) -> None:
        self._listeners.append(listener)

    def set_kv_event_sink(self, sink: KvEventSink) -> None:
        self._kv_sink = sink

    async def abort(self, request_id: str) -> None:
        stream = self._streams.get(request_id)
        if stream is None or stream.done:
            raise errors.NotFound(f"request {request_id!r} is not running on this worker")
        self._abort(stream)

    async def generate(self, request: GenerateRequest) -> AsyncIterator[OutputDelta]:
        rid = request.request_id
        if self._closed:
            raise errors.Unavailable("the simulated engine is closed")
        if rid in self._streams:
            raise errors.InvalidArgument(
                f"request_id {rid!r} is already running on this worker; use a unique id"
            )
        if request.sampling.structured_output is not None:
            raise errors.InvalidArgument(
                "the simulated engine does not support sampling.structured_output (its tokens "
                "are made up and cannot follow a schema); serve it with a vLLM worker",
                STRUCTURED_FIELD,
            )
        for name in ("logprobs", "prompt_logprobs"):  # made-up tokens have no probabilities
            if getattr(request.sampling, name) is not None:
                raise errors.InvalidArgument(
                    f"sampling.{name} is not supported by the simulated engine (its tokens are "
                    "made up, without probabilities); leave it unset",
                    f"sampling.{name}",
                )
        arrived = time.monotonic()
        prompt = request.prompt_token_ids
        hash_prompt: Callable[[], Sequence[BlockHash]]
        if request.cache_salt:
            hash_prompt = functools.partial(self._salted_hasher, prompt, request.cache_salt)
        else:
            hash_prompt = functools.partial(self._hasher, prompt)
        if len(prompt) > HASH_IN_THREAD_TOKENS:
            hashes = await asyncio.to_thread(hash_prompt)
        else:
            hashes = hash_prompt()
        if len(hashes) != len(prompt) // self._info.block_size:
            raise ValueError(
                f"the hasher gave {len(hashes)} block hashes for {len(prompt)} tokens; it must "
                f"hash full blocks of {self._info.block_size} tokens (the engine's block size)"
            )
        external = 0
        source = request.kv_source
        if source is not None and self._kv_stores is not None:
            external, waited = await self._kv_stores.load(
                source.kvmanager_id,
                self._kvmanager_id,
                hashes,
                source.blocks,
                source.handoff_wait_s,
            )
            self.handoffs.append((rid, external, waited))
        stream = self._new_stream(request, tuple(hashes), external)
        stream.from_peer = source is not None and source.kvmanager_id != self._kvmanager_id
        if rid in self._streams:  # another call with this id won the race while we hashed
            raise errors.InvalidArgument(
                f"request_id {rid!r} is already running on this worker; use a unique id"
            )
        self._ensure_task()
        self._streams[rid] = stream
        try:
            # Catch the simulated server up to now before the arrival; requests that finish in
            # that catch-up must get their results (dropping them left their streams hanging).
            self._deliver(self._worker.advance_to(self._virtual_now()))
            self._unstepped = 0
            self._worker.submit(stream.request)
            self._unstepped += 1
            self._changed()
            async for delta in self._deltas(stream, arrived):
                yield delta
        finally:
            if not stream.done:  # the consumer went away (closed early, cancelled)
                self._abort(stream)
            self._streams.pop(rid, None)

    async def close(self) -> None:
        self._closed = True
        for stream in list(self._streams.values()):
            if not stream.done:
                self._abort(stream)
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    # ---- internals -------------------------------------------------------------------------
    def _new_stream(
        self, request: GenerateRequest, hashes: tuple[BlockHash, ...], external: int = 0
    ) -> _Stream:
        s = request.sampling
        info = self._info
        n_prompt = len(request.prompt_token_ids)
        limit = min(s.max_tokens, max(info.max_model_len - n_prompt, 0))
        if limit <= 0:
            raise errors.InvalidArgument(
                f"the prompt has {n_prompt} tokens; the model's context is {info.max_model_len}"
            )
        _check_simulated(s)
        eos = self._config.eos_after_tokens
        if eos > 0:
            eos = max(eos, s.min_tokens)  # no end of sequence before min_tokens
        if eos > 0 and not s.ignore_eos:
            limit = min(limit, eos)
        start = replayed_tokens(request.request_id, request.prompt_token_ids, info.vocab_size)
        output = fake_token_ids(request.request_id, limit, info.vocab_size, start)
        stop_reason: str | None = None
        if eos > 0 and not s.ignore_eos and limit == eos:
            stop_reason = ""
        if s.stop_token_ids:
            stops = set(s.stop_token_ids)
            _no_stops_before(output, stops, s.min_tokens, info.vocab_size)
            hit = next((i for i, t in enumerate(output) if t in stops), None)
            if hit is not None:
                output = output[: hit + 1]
                stop_reason = str(output[hit])
        sim = SimRequest(
            request.request_id, hashes, n_prompt, len(output), external, request.priority
        )
        if self._worker.blocks_needed(sim) > self._worker.config.capacity_blocks:
            raise errors.InvalidArgument(
                f"prompt ({n_prompt} tokens) + output ({len(output)} tokens) exceeds the "
                "simulated KV capacity; lower max_tokens or shorten the prompt"
            )
        return _Stream(sim, output, stop_reason)

    async def _deltas(self, stream: _Stream, arrived: float) -> AsyncIterator[OutputDelta]:
        rid = stream.request.request_id
        prompt_tokens = stream.request.prompt_tokens
        completion = 0
        first_token_s: float | None = None
        while True:
            items = [await stream.queue.get()]
            while not stream.queue.empty():
                items.append(stream.queue.get_nowait())
            new = sum(i for i in items if isinstance(i, int))
            end = next((i for i in items if isinstance(i, SimResult)), None)
            now = time.monotonic()
            token_ids = tuple(stream.output[completion : completion + new])
            completion += len(token_ids)
            if token_ids and first_token_s is None:
                first_token_s = now
            finish = timing = split = None
            cached = self._cached_tokens(rid, end)
            if end is not None:
                # Handed-over blocks were loaded from the node's store (fetched there from the
                # prefill worker's node when that is another); the rest is the engine's own.
                loaded = min(end.loaded_tokens, cached)
                split = CachedTokens(
                    gpu=cached - loaded,
                    cpu=0 if stream.from_peer else loaded,
                    peer=loaded if stream.from_peer else 0,
                )
                stream.done = True
                if end.aborted:
                    finish = Finish(FinishReason.ABORT)
                elif stream.stop_reason is not None:
                    finish = Finish(FinishReason.STOP, stream.stop_reason)
                else:
                    finish = Finish(FinishReason.LENGTH)
                timing = Timing(
                    arrived_s=arrived,
                    scheduled_s=self._wall(end.admitted_s),
                    first_token_s=first_token_s,
                    finished_s=now,
                )
            elif not token_ids:
                continue
            yield OutputDelta(
                request_id=rid,
                token_ids=token_ids,
                text="".join(f" t{t}" for t in token_ids),
                prompt_tokens=prompt_tokens,
                cached_tokens=cached,
                completion_tokens=completion,
                finish=finish,
                timing=timing,
                cached_by_tier=split,
            )
            if end is not None:
                return

    def _cached_tokens(self, rid: str, end: SimResult | None) -> int:
        if end is not None:
            return end.cached_tokens
        return self._worker.cached_tokens_of(rid)

    def _abort(self, stream: _Stream) -> None:
        rid = stream.request.request_id
        result = self._worker.abort(rid)
        if result is not None:
            stream.queue.put_nowait(result)
        stream.done = True
        self._changed()

    def _on_tokens(self, request_id: str, count: int, _t: float) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            stream.queue.put_nowait(count)

    def _on_kv(self, events: Sequence[KvEvent]) -> None:
        stores = self._kv_stores
        if stores is not None and self._kvmanager_id:  # the connector's saves
            for e in events:
                if isinstance(e, BlockStored):
                    stores.put(self._kvmanager_id, e.block_hashes)
        sink = self._kv_sink
        if sink is not None:
            try:
                sink(events)
            except Exception:
                log.exception("KV event sink failed")

    def _virtual_now(self) -> float:
        return (self._clock() - self._t0) * self._config.speedup

    def _wall(self, virtual_s: float | None) -> float | None:
        return None if virtual_s is None else self._t0 + virtual_s / self._config.speedup

    def _changed(self) -> None:
        self._wake.set()
        for listener in self._listeners:
            try:
                listener()
            except Exception:
                log.exception("load listener failed")

    def _ensure_task(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="sim-engine")

    def _deliver(self, results: list[SimResult]) -> None:
        for result in results:
            stream = self._streams.get(result.request_id)
            if stream is not None:
                stream.queue.put_nowait(result)

    async def _run(self) -> None:
        """The clock: runs the simulated server's steps as real time reaches them."""
        worker = self._worker
        speedup = self._config.speedup
        due = 0.0  # a step end the timer woke us for (the clock may read a hair early)
        while True:
            self._wake.clear()
            now = max(self._virtual_now(), due)
            before = worker.next_event_time()
            results = worker.advance_to(now)
            self._unstepped = 0
            self._deliver(results)
            nxt = worker.next_event_time()
            if results or nxt != before:
                for listener in self._listeners:
                    try:
                        listener()
                    except Exception:
                        log.exception("load listener failed")
            due = 0.0
            if nxt == math.inf:
                await self._wake.wait()
                continue
            fired: list[bool] = []
            timer = asyncio.get_running_loop().call_later(
                max(0.0, (nxt - now) / speedup), self._on_timer, fired
            )
            try:
                await self._wake.wait()
            finally:
                timer.cancel()
            if fired:
                due = nxt

    def _on_timer(self, fired: list[bool]) -> None:
        fired.append(True)
        self._wake.set()
