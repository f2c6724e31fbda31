"""Values the worker works with, and the engine interface the servicer talks to.

Transport-free: no grpc, vllm or torch here. The servicer converts protobuf to and from these;
``engine.VllmEngine`` implements ``Engine`` on vLLM; tests may implement it with a fake.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Protocol, runtime_checkable

from kvmesh.kv.events import KvEvent
from kvmesh.sampling import Sampling

KvEventSink = Callable[[Sequence[KvEvent]], None]

__all__ = ["Sampling"]  # re-exported: the worker's values in one place


class FinishReason(StrEnum):
    STOP = "stop"  # end-of-sequence token, stop string or stop token id
    LENGTH = "length"  # max_tokens or the context length
    ABORT = "abort"  # client cancel, Abort RPC, deadline, drain


@dataclass(frozen=True, slots=True)
class KvSource:
    """A peer kvmanager the router says holds ``blocks`` leading blocks of the prompt (more than
    this worker's node): the KV connector may have its own kvmanager fetch them from it."""

    kvmanager_id: str
    blocks: int  # contiguous prefix of the prompt, in full blocks
    handoff_wait_s: float = 0.0  # may wait this long for them to land there; 0: the default
    # The router's estimate of recomputing what the fetch brings: wait no longer; 0: the default
    max_fetch_s: float = 0.0


@dataclass(frozen=True, slots=True)
class GenerateRequest:
    request_id: str
    prompt_token_ids: tuple[int, ...] = field(repr=False)
    sampling: Sampling
    kv_source: KvSource | None = None  # the router's peer hint, if any
    # vLLM's cache_salt (the tenant's, from the router): in every block hash of the prompt, so
    # blocks, kvmanager keys and KV events are per salt. "": unsalted.
    cache_salt: str = field(default="", repr=False)
    # The router's priority band (higher first); an engine with priority scheduling orders by it.
    priority: int = 0
    # The data-parallel rank to run it on (an engine with several, EngineInfo.data_parallel_size);
    # None: the engine chooses.
    data_parallel_rank: int | None = None
    # The router's count of the prompt's leading blocks the node kvmanager holds (None: unknown);
    # the KV connector skips its lookup when the engine's own cache covers them.
    store_prefix_blocks: int | None = None


@dataclass(frozen=True, slots=True)
class Timing:
    """When things happened to one request, in ``time.monotonic()`` seconds of this process.

    ``scheduled_s`` comes from vLLM's engine core (its SCHEDULED event: first time the scheduler
    picked the request); the core runs in a child process but reads the same system-wide
    monotonic clock. None when the request was never scheduled or produced no token.
    """

    arrived_s: float  # the engine adapter got the request
    scheduled_s: float | None = None
    first_token_s: float | None = None  # the first token reached this process
    finished_s: float | None = None

    @property
    def time_to_first_token_s(self) -> float:
        return 0.0 if self.first_token_s is None else self.first_token_s - self.arrived_s

    def phases(self) -> RequestPhases:
        """The request's time split as vLLM's ``FinishedRequestStats`` splits it: queued until
        first scheduled, prefill until the first token, decode until finished. A phase that
        never began is 0 (never scheduled: all of it queued); clock skew never makes one
        negative."""
        end = self.arrived_s if self.finished_s is None else self.finished_s
        e2e = max(0.0, end - self.arrived_s)
        if self.scheduled_s is None:
            return RequestPhases(e2e_s=e2e, queue_s=e2e)
        scheduled = min(max(self.scheduled_s, self.arrived_s), end)
        first = end if self.first_token_s is None else min(max(self.first_token_s, scheduled), end)
        return RequestPhases(
            e2e_s=e2e,
            queue_s=scheduled - self.arrived_s,
            prefill_s=first - scheduled,
            decode_s=end - first,
        )


@dataclass(frozen=True, slots=True)
class RequestPhases:
    """Where one finished request's time went, in seconds (``Timing.phases``)."""

    e2e_s: float = 0.0  # arrival to finish
    queue_s: float = 0.0  # arrival to first scheduled
    prefill_s: float = 0.0  # first scheduled to first token
    decode_s: float = 0.0  # first token to finish

    @property
    def inference_s(self) -> float:
        """Running (prefill and decode), as vLLM's request_inference_time."""
        return self.prefill_s + self.decode_s


@dataclass(frozen=True, slots=True)
class Finish:
    reason: FinishReason
    stop_reason: str = ""  # the stop string or stop token id (as text) that ended it


@dataclass(frozen=True, slots=True)
class CachedTokens:
    """A request's cached prompt tokens by where their KV came from (``total`` of them)."""

    gpu: int = 0  # the engine's own prefix cache
    cpu: int = 0  # loaded by the KV connector from the node kvmanager's CPU tier
    disk: int = 0  # ... from its disk tier
    peer: int = 0  # fetched for this request from another node's kvmanager, then loaded

    @property
    def total(self) -> int:
        return self.gpu + self.cpu + self.disk + self.peer

    @classmethod
    def split(
        cls, engine_cached: int, cpu: int = 0, disk: int = 0, peer: int = 0, failed: int = 0
    ) -> CachedTokens:
        """The split of an engine's ``engine_cached`` tokens (vLLM's ``num_cached_tokens``:
        its own prefix cache hit plus every token its KV connector planned to load) given what
        the connector really loaded by source and the planned tokens that ``failed`` to load
        (recomputed, so not cached). Never more loaded than the engine counted."""
        own = max(0, engine_cached - cpu - disk - peer - failed)
        room = max(0, engine_cached - own)  # the connector's part, at most what vLLM counted
        cpu = min(cpu, room)
        disk = min(disk, room - cpu)
        peer = min(peer, room - cpu - disk)
        return cls(gpu=own, cpu=cpu, disk=disk, peer=peer)


@dataclass(frozen=True, slots=True)
class TopLogprob:
    token_id: int
    logprob: float
    token: str  # decoded on its own by the engine's tokenizer


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """One token's log probability and the most likely tokens at its position (common.proto
    ``TokenLogprob``)."""

    token_id: int
    logprob: float | None  # None only for a prompt's first token
    token: str
    rank: int  # 1 = most likely; 0 when logprob is None
    top: tuple[TopLogprob, ...] = ()  # the asked-for number of most likely, most likely first


@dataclass(frozen=True, slots=True)
class OutputDelta:
    """New output of one request since the previous delta (one per engine step)."""

    request_id: str
    token_ids: tuple[int, ...]
    text: str  # detokenized text of token_ids (stop strings already cut by the engine)
    prompt_tokens: int
    cached_tokens: int  # prompt tokens whose KV came from the prefix cache
    completion_tokens: int  # all completion tokens so far, this delta included
    finish: Finish | None = None  # set on the last delta only
    timing: Timing | None = None  # set on the last delta only
    # The last delta only: cached_tokens by source (its total is that delta's cached_tokens).
    # None: the engine does not tell; its cache is all its own (gpu).
    cached_by_tier: CachedTokens | None = None
    # With sampling.logprobs: one per token_ids entry. None: not asked for.
    logprobs: tuple[TokenLogprob, ...] | None = None
    # With sampling.prompt_logprobs: one per prompt token, on the first delta that has them.
    prompt_logprobs: tuple[TokenLogprob, ...] | None = None

    def cached_split(self) -> CachedTokens:
        """``cached_by_tier``, or all of ``cached_tokens`` as the engine's own."""
        if self.cached_by_tier is not None:
            return self.cached_by_tier
        return CachedTokens(gpu=self.cached_tokens)


@dataclass(frozen=True, slots=True)
class SpecDecodeCounts:
    """Speculative decoding counters, cumulative since the engine started (vLLM's
    ``SpecDecodingStats`` summed; all 0 when speculation is off)."""

    drafts: int = 0  # drafts proposed: one per request per step that drafted
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_position: tuple[int, ...] = ()  # [i]: drafts whose token i was accepted

    @property
    def acceptance_rate(self) -> float | None:
        """Accepted over drafted tokens; None before any draft."""
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else None

    def acceptance_by_position(self) -> tuple[float, ...]:
        """Per draft position, the fraction of drafts whose token there was accepted."""
        d = self.drafts
        return tuple(n / d for n in self.accepted_per_position) if d else ()


@dataclass(frozen=True, slots=True)
class EngineLoad:
    """The engine's own counters, from its latest scheduler stats."""

    running_requests: int = 0
    waiting_requests: int = 0
    kv_cache_usage: float = 0.0  # fraction of KV blocks in use, [0, 1]
    prefix_cache_queried_tokens: int = 0  # cumulative since start
    prefix_cache_hit_tokens: int = 0  # cumulative since start
    preemptions: int = 0  # requests the scheduler preempted, cumulative since start
    # Prefill speed as the engine measured it, cumulative since start over requests whose
    # prefill completed: prompt tokens computed (not from a cache) and the seconds from their
    # scheduling to their first token (vLLM's per-request prefill_time). The router's cost
    # model divides one by the other (scheduler/rates.py).
    prefill_computed_tokens: int = 0
    prefill_s: float = 0.0
    generation_tokens: int = 0  # tokens emitted, cumulative since start
    # Decode time as the engine measured it, cumulative over finished requests: their tokens
    # after the first and the seconds from first to last token (vLLM's per-request decode_time).
    # The router's step-rate fit divides one by the other (scheduler/steps.py).
    decode_tokens: int = 0
    decode_s: float = 0.0
    spec: SpecDecodeCounts = SpecDecodeCounts()
    # The KV connector's counters (services/worker/connector/connector.py STAT_NAMES: lookups,
    # lookups_skipped, load_blocks, save_blocks, ...), cumulative since start, by name.
    kv_connector: tuple[tuple[str, int], ...] = ()


@dataclass(frozen=True, slots=True)
class EngineInfo:
    model: str  # served model name
    model_path: str
    max_model_len: int  # tokens, prompt + completion
    block_size: int  # tokens per KV block
    vocab_size: int  # token ids must be < this
    # The KV connector's layout key (services/worker/connector/layout.py) when the engine saves
    # blocks to a store; "" without a connector.
    connector_layout: str = ""
    # Most alternatives per token a request may ask for (sampling.logprobs); 0: no bound known.
    max_logprobs: int = 0
    vllm_version: str = ""  # the vLLM serving it; "" for an engine that is not vLLM
    # Most requests the engine runs at once (vLLM's max_num_seqs); more wait. 0: not known.
    max_running_requests: int = 0
    # Speculative decoding: vLLM's method (ngram, draft_model, eagle, eagle3, mtp) and tokens
    # drafted per step; "" and 0 when off.
    speculative_method: str = ""
    num_speculative_tokens: int = 0
    # Data-parallel ranks, each with its own KV cache (a ``RankedEngine``); 1: one.
    data_parallel_size: int = 1


class Engine(Protocol):
    """What the servicer needs from an inference engine."""

    @property
    def info(self) -> EngineInfo: ...

    def generate(self, request: GenerateRequest) -> AsyncIterator[OutputDelta]:
        """Streams deltas; the last one has ``finish``. Raises ``InvalidArgument`` for parameters
        the engine rejects, ``Unavailable`` when the engine cannot serve. Closing the iterator
        early aborts the request in the engine."""
        ...

    async def abort(self, request_id: str) -> None:
        """Aborts a running request (its stream ends with reason ABORT). ``NotFound`` if the
        engine is not running it."""
        ...

    def is_running(self, request_id: str) -> bool: ...

    def load(self) -> EngineLoad: ...

    def add_load_listener(self, listener: Callable[[], None]) -> None:
        """``listener()`` is called (on the event loop) whenever the load may have changed."""
        ...

    def set_kv_event_sink(self, sink: KvEventSink) -> None:
        """From now on, ``sink(events)`` is called on the event loop with each engine step's KV
        block events (stored / removed / cleared), in the order the engine produced them. An
        engine that publishes no events never calls it."""
        ...

    async def close(self) -> None: ...


@runtime_checkable
class RankedEngine(Engine, Protocol):
    """An engine with several data-parallel ranks (``info.data_parallel_size`` > 1), each with
    its own KV cache and scheduler: ``generate`` runs a request on its ``data_parallel_rank``
    (or one the engine picks), ``load`` is the sum over ranks. The worker serves each rank's
    load and KV events on their own (docs/engine.md#data-parallel-ranks)."""

    def rank_load(self, rank: int) -> EngineLoad:
        """Rank ``rank``'s own counters (0 <= rank < data_parallel_size)."""
        ...

    def rank_of(self, request_id: str) -> int | None:
        """The rank running ``request_id`` now; None when none is."""
        ...

    def set_rank_kv_event_sink(self, rank: int, sink: KvEventSink) -> None:
        """As ``set_kv_event_sink``, for rank ``rank``'s KV events only (its own cache). An
        engine given per-rank sinks sends each rank's events there and no longer to the
        ``set_kv_event_sink`` one."""
        ...
