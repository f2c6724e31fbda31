"""``Engine`` on vLLM's v1 ``AsyncLLM``.

How it runs: AsyncLLM always puts its EngineCore (scheduler + model) in a child process and
talks to it over ZMQ; this process keeps the asyncio front end (input processing,
detokenization, the output handler task). ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` (set by main())
only makes that child run the model itself instead of spawning one more worker process. So an
engine step never blocks our event loop. The child is started with ``spawn``: a script that
builds an engine must guard its entry point with ``if __name__ == "__main__"``.

Load comes from vLLM's own scheduler stats through a stat logger (``StatsSink``) that keeps
the latest ``SchedulerStats``; vLLM pushes them after every engine step, including the step
that retires finished or aborted requests, so an idle engine's last snapshot reads 0 running.

KV events: every engine publishes vLLM's KV cache events over ZMQ to this process
(``kv_events.VllmKvEvents``: ipc sockets in a temp dir of the engine's own, subscribed before
the engine starts); ``set_kv_event_sink`` receives them on the event loop.

Cached tokens by tier: vLLM's ``num_cached_tokens`` counts the engine's own prefix cache hit and
the tokens its KV connector planned to load, together. The connector reports per request what it
really loaded, by source (``connector.plan.LoadReport``): with the request's final output
(``RequestOutput.kv_transfer_params``, when the engine core finished the request) and in its
stats, which ``StatsSink`` keeps for the requests the front end finishes (stop strings). The
rest of ``num_cached_tokens`` is the engine's own (``CachedTokens.split``).

Library code: reads no environment variables (main() sets vLLM's before importing this).
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from dataclasses import replace
from typing import Any

import vllm
from opentelemetry import propagate
from vllm import SamplingParams
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.exceptions import (
    GracefulHTTPError,
    RetryableRequestError,
    VLLMClientError,
    VLLMNotFoundError,
)
from vllm.inputs import TokensPrompt
from vllm.logprobs import Logprob
from vllm.outputs import RequestOutput
from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams
from vllm.v1.engine.async_llm import AsyncLLM
from vllm.v1.engine.exceptions import EngineDeadError
from vllm.v1.metrics.loggers import StatLoggerBase

from kvmesh import errors
from kvmesh.cpus import engine_environment, format_cpu_list, pin_threads
from kvmesh.sampling import STRUCTURED_FIELD, OutputKind, StructuredOutput

from . import detokenizer
from .config import EngineConfig
from .connector.kvmanager_client import TRACE_HEADERS, TRACE_PARAM
from .connector.plan import REQUEST_ID_PARAM, STORE_PREFIX_PARAM, LoadReport, PeerSource
from .core import (
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
    TokenLogprob,
    TopLogprob,
)
from .dp import rank_event_configs, sum_loads
from .kv_events import VllmKvEvents, events_config
from .speculative import check_models, vllm_speculative_config
from .stats import StatsSink, stat_loggers
from .vllm_ext import EXTENSION_CLS

log = logging.getLogger(__name__)

_FINISH_REASONS = {
    "stop": FinishReason.STOP,
    "length": FinishReason.LENGTH,
    "abort": FinishReason.ABORT,
    "repetition": FinishReason.STOP,  # vLLM's repetition detector: a stop by the engine
}


def build_engine_args(
    config: EngineConfig, kv_events_config: Mapping[str, Any] | None = None
) -> AsyncEngineArgs:
    """The vLLM engine arguments for ``config`` (tests build reference engines from these).
    ``kv_events_config``: the resolved KV events settings, instead of ``config``'s own (which
    ``VllmEngine.start`` completes with endpoints of its own)."""
    if not config.model:
        raise errors.InvalidArgument("engine.model is empty; pass the model directory (--model)")
    kwargs: dict[str, Any] = {
        "model": config.model,
        "served_model_name": config.model_name,
        "dtype": config.dtype,
        "block_size": config.block_size,
        "kv_cache_memory_bytes": config.kv_cache_bytes,
        "enable_prefix_caching": config.enable_prefix_caching,
        "enforce_eager": True,
        "seed": config.seed,
        # Our stat logger enables stats; this only turns off vLLM's default loggers.
        "disable_log_stats": True,
        "worker_extension_cls": EXTENSION_CLS,
        "shutdown_timeout": max(0, config.core_drain_s),
    }
    if config.max_model_len > 0:
        kwargs["max_model_len"] = config.max_model_len
    if config.max_num_seqs > 0:
        kwargs["max_num_seqs"] = config.max_num_seqs
    if config.scheduling_policy != "fcfs":
        kwargs["scheduling_policy"] = config.scheduling_policy
    if config.long_prefill_token_threshold > 0:
        kwargs["long_prefill_token_threshold"] = config.long_prefill_token_threshold
    if config.data_parallel_size > 1:
        kwargs["data_parallel_size"] = config.data_parallel_size
    if config.enable_expert_parallel:
        kwargs["enable_expert_parallel"] = True
    events = kv_events_config if kv_events_config is not None else config.kv_events_config
    if events is not None:
        from vllm.config import KVEventsConfig

        kwargs["kv_events_config"] = KVEventsConfig(**dict(events))
    if config.kv_transfer_config is not None:
        from vllm.config import KVTransferConfig

        kwargs["kv_transfer_config"] = KVTransferConfig(**dict(config.kv_transfer_config))
    if config.structured_outputs_config is not None:
        from vllm.config import StructuredOutputsConfig

        try:
            kwargs["structured_outputs_config"] = StructuredOutputsConfig(
                **dict(config.structured_outputs_config)
            )
        except (ValueError, TypeError) as exc:
            raise errors.InvalidArgument(
                f"engine.structured_outputs_config is not valid: {exc}"
            ) from None
    spec = config.speculative
    if spec.enabled:
        mtp_layers = check_models(spec, config.model)
        kwargs["speculative_config"] = vllm_speculative_config(spec, mtp_layers)
    extra = dict(config.engine_extra or {})
    clash = sorted(set(extra) & set(kwargs))
    if clash:
        raise errors.InvalidArgument(
            f"engine_extra sets {clash}, which have their own settings; use those instead"
        )
    return AsyncEngineArgs(**kwargs, **extra)


def sampling_params(
    s: Sampling, kv_transfer_params: Mapping[str, Any] | None = None
) -> SamplingParams:
    """vLLM sampling parameters for ``s``, streaming deltas. Raises ``InvalidArgument`` for
    values vLLM refuses. ``kv_transfer_params`` reach the KV connector as the request's
    ``kv_transfer_params`` (only give them to an engine with a connector)."""
    kwargs: dict[str, Any] = {
        "max_tokens": s.max_tokens,
        "ignore_eos": s.ignore_eos,
        "output_kind": RequestOutputKind.DELTA,
    }
    if kv_transfer_params:
        kwargs["extra_args"] = {"kv_transfer_params": dict(kv_transfer_params)}
    if s.temperature is not None:
        kwargs["temperature"] = s.temperature
    if s.top_p is not None:
        kwargs["top_p"] = s.top_p
    if s.top_k is not None and s.top_k > 0:  # -1 and 0 both mean "disabled" (vLLM: 0)
        kwargs["top_k"] = s.top_k
    if s.seed is not None:
        kwargs["seed"] = s.seed
    if s.stop:
        kwargs["stop"] = list(s.stop)
    if s.stop_token_ids:
        kwargs["stop_token_ids"] = list(s.stop_token_ids)
    if s.structured_output is not None:
        kwargs["structured_outputs"] = structured_outputs_params(s.structured_output)
    if s.logprobs is not None:
        kwargs["logprobs"] = s.logprobs
    if s.prompt_logprobs is not None:
        kwargs["prompt_logprobs"] = s.prompt_logprobs
    if s.presence_penalty is not None:
        kwargs["presence_penalty"] = s.presence_penalty
    if s.frequency_penalty is not None:
        kwargs["frequency_penalty"] = s.frequency_penalty
    if s.repetition_penalty is not None:
        kwargs["repetition_penalty"] = s.repetition_penalty
    if s.logit_bias:
        kwargs["logit_bias"] = dict(s.logit_bias)
    if s.min_tokens:
        kwargs["min_tokens"] = s.min_tokens
    try:
        return SamplingParams(**kwargs)
    except (ValueError, TypeError, VLLMClientError) as exc:
        raise errors.InvalidArgument(f"sampling parameters rejected by the engine: {exc}") from exc


def structured_outputs_params(so: StructuredOutput) -> StructuredOutputsParams:
    """vLLM's structured outputs for ``so`` (the engine's backend compiles it per request)."""
    try:
        if so.kind is OutputKind.JSON_SCHEMA:
            return StructuredOutputsParams(json=so.spec)
        if so.kind is OutputKind.JSON_OBJECT:
            return StructuredOutputsParams(json_object=True)
        if so.kind is OutputKind.CHOICE:
            return StructuredOutputsParams(choice=list(so.choices))
        if so.kind is OutputKind.REGEX:
            return StructuredOutputsParams(regex=so.spec)
        return StructuredOutputsParams(grammar=so.spec)
    except (ValueError, TypeError, VLLMClientError) as exc:
        raise errors.InvalidArgument(
            f"{STRUCTURED_FIELD} rejected by the engine: {exc}", STRUCTURED_FIELD
        ) from exc


def _domain_error(exc: BaseException) -> errors.KvmeshError | None:
    """The domain error for an exception vLLM raised while serving a request, if any."""
    if isinstance(exc, VLLMNotFoundError):
        return errors.NotFound(str(exc))
    if isinstance(exc, VLLMClientError | ValueError):
        return errors.InvalidArgument(f"the engine rejected the request: {exc}")
    if isinstance(exc, GracefulHTTPError):  # admission control: queue full
        return errors.ResourceExhausted(f"the engine is saturated: {exc}")
    if isinstance(exc, EngineDeadError | RetryableRequestError):
        return errors.Unavailable(f"the engine cannot serve: {exc}")
    return None


class VllmEngine:
    """One vLLM engine. Build with ``await VllmEngine.start(config)``; ``close()`` when done."""

    def __init__(
        self,
        llm: AsyncLLM,
        stats: StatsSink,
        info: EngineInfo,
        kv_events: VllmKvEvents,
        rank_stats: Sequence[StatsSink] = (),
        rank_events: Sequence[VllmKvEvents] = (),
    ) -> None:
        """``rank_stats`` / ``rank_events``: with several data-parallel ranks, each rank's stat
        logger and KV event reader (``stats`` and ``kv_events`` are then rank 0's)."""
        self._llm = llm
        self._stats = stats
        self._info = info
        self._kv_events = kv_events
        self._rank_stats = tuple(rank_stats) or (stats,)
        self._rank_events = tuple(rank_events) or (kv_events,)
        self._running: set[str] = set()
        self._rank_of: dict[str, int] = {}  # running requests sent to a rank
        # vLLM refuses a priority unless its scheduler orders by priority (lower first there).
        self._by_priority = llm.vllm_config.scheduler_config.policy == "priority"

    @classmethod
    async def start(cls, config: EngineConfig) -> VllmEngine:
        """Starts the engine (spawns its core process; seconds) and waits until it is ready."""
        # Subscribed before the engine exists, so its first KV events have a reader.
        engine_only = config.kv_transfer_config is None
        ranks = max(config.data_parallel_size, 1)
        if ranks > 1:  # one reader per rank, at the rank's offset port (services/worker/dp.py)
            readers = [
                VllmKvEvents(events_config(c, ""), None, engine_only)
                for c in rank_event_configs(config.kv_events_config, ranks)
            ]
        else:
            readers = [VllmKvEvents.open(config.kv_events_config, engine_only=engine_only)]
        kv_events = readers[0]

        async def close_readers() -> None:
            for reader in readers:
                await reader.close()

        try:
            args = build_engine_args(config, kv_events.config)
        except BaseException:
            await close_readers()
            raise
        sinks = [StatsSink() for _ in range(ranks)]
        stats = sinks[0]
        started = time.monotonic()
        detokenizer.install()  # a prompt ending inside a character: only the new text streams

        # Blocks this thread until the core process is ready; nothing else runs before it.
        def stats_factory(_vllm_config: object, engine_index: int = 0) -> StatLoggerBase:
            return sinks[engine_index] if 0 <= engine_index < ranks else stats

        try:
            # The engine core process starts here; its OpenMP threads bind as it starts.
            with _environment(engine_environment(config.compute_cpus)):
                loggers = stat_loggers(stats_factory, config.vllm_prometheus)
                llm = AsyncLLM.from_engine_args(args, stat_loggers=loggers)
        except BaseException:
            await close_readers()
            raise
        try:
            for reader in readers:
                await reader.start()
            amx = await llm.collective_rpc("kvmesh_init_amx")
            parent = os.getpid() if ranks == 1 else 0  # ranks: the model runs in their children
            await llm.collective_rpc("kvmesh_die_with_parent", args=(parent, os.getpid()))
            layouts = await llm.collective_rpc("kvmesh_kv_layout")
            if config.compute_cpus and config.service_cpus:
                # The engine core's other threads (vLLM's output and input threads, the
                # connector's saver) stay on its compute core, where they inherited the main
                # thread's binding: they share its interpreter lock, and one of them preempted
                # on a busy service core while holding it stalls the step (moving them there
                # cost 11% engine CPU per token and 13-16% throughput, docs/serving-cost.md).
                log.info(
                    "engine compute threads on cores %s; this process on cores %s",
                    format_cpu_list(config.compute_cpus),
                    format_cpu_list(config.service_cpus),
                )
                pin_threads(config.service_cpus)
            model_config = llm.model_config
            vocab = model_config.get_vocab_size()
            tokenizer = llm.tokenizer
            if tokenizer is not None:
                vocab = max(vocab, tokenizer.max_token_id + 1)
            max_logprobs = model_config.max_logprobs  # -1: the whole vocabulary
            spec = llm.vllm_config.speculative_config
            info = EngineInfo(
                model=config.model_name,
                model_path=config.model,
                max_model_len=model_config.max_model_len,
                block_size=llm.vllm_config.cache_config.block_size,
                vocab_size=vocab,
                connector_layout=layouts[0] if layouts else "",
                max_logprobs=vocab if max_logprobs < 0 else max_logprobs,
                vllm_version=vllm.__version__,
                max_running_requests=llm.vllm_config.scheduler_config.max_num_seqs,
                speculative_method=str(spec.method or "") if spec is not None else "",
                num_speculative_tokens=spec.num_speculative_tokens if spec is not None else 0,
                data_parallel_size=ranks,
            )
        except BaseException:
            llm.shutdown()
            await close_readers()
            raise
        log.info(
            "engine ready in %.1f s: model=%s dtype=%s max_model_len=%d block_size=%d "
            "vocab_size=%d kv_cache_bytes=%d amx=%s speculative=%s",
            time.monotonic() - started,
            info.model,
            model_config.dtype,
            info.max_model_len,
            info.block_size,
            info.vocab_size,
            config.kv_cache_bytes,
            amx,
            f"{info.speculative_method}x{info.num_speculative_tokens}"
            if info.speculative_method
            else "off",
        )
        if ranks > 1:
            return cls(llm, stats, info, kv_events, sinks, readers)
        return cls(llm, stats, info, kv_events)

    @property
    def info(self) -> EngineInfo:
        return self._info

    @property
    def llm(self) -> AsyncLLM:
        """The vLLM engine itself (tests compare against it; later work adds connectors)."""
        return self._llm

    def is_running(self, request_id: str) -> bool:
        return request_id in self._running

    def load(self) -> EngineLoad:
        if len(self._rank_stats) > 1:
            return sum_loads([self.rank_load(r) for r in range(len(self._rank_stats))])
        return self._load_of(self._stats)

    def rank_load(self, rank: int) -> EngineLoad:
        """Data-parallel rank ``rank``'s own counters (its stat logger)."""
        return self._load_of(self._rank_stats[rank])

    def rank_of(self, request_id: str) -> int | None:
        """The rank a running request was sent to; None when vLLM chose (or it is not running)."""
        return self._rank_of.get(request_id)

    def _load_of(self, stats: StatsSink) -> EngineLoad:
        s = stats.latest
        running, waiting = s.num_running_reqs, s.num_waiting_reqs + s.num_skipped_waiting_reqs
        usage = s.kv_cache_usage
        if self._llm.get_num_unfinished_requests() == 0 and (running or waiting):
            # Belt and braces: the front end has retired every request but the core has not
            # pushed stats since (not observed with vLLM 0.32: the retiring step pushes them).
            running = waiting = 0
        return EngineLoad(
            running_requests=running,
            waiting_requests=waiting,
            kv_cache_usage=min(max(usage, 0.0), 1.0),
            prefix_cache_queried_tokens=stats.queried_tokens,
            prefix_cache_hit_tokens=stats.hit_tokens,
            preemptions=stats.preemptions,
            prefill_computed_tokens=stats.prefill_tokens,
            prefill_s=stats.prefill_s,
            generation_tokens=stats.generation_tokens,
            decode_tokens=stats.decode_tokens,
            decode_s=stats.decode_s,
            spec=stats.spec,
            kv_connector=stats.connector_counts(),
        )

    def add_load_listener(self, listener: Callable[[], None]) -> None:
        for stats in self._rank_stats:
            stats.listeners.append(listener)

    def set_kv_event_sink(self, sink: KvEventSink) -> None:
        """Every rank's events into ``sink`` (with ranks, ``set_rank_kv_event_sink`` is exact)."""
        for reader in self._rank_events:
            reader.set_sink(sink)

    def set_rank_kv_event_sink(self, rank: int, sink: KvEventSink) -> None:
        self._rank_events[rank].set_sink(sink)

    def _take_report(self, request_id: str) -> LoadReport | None:
        """The connector's load report of a request, from whichever rank ran it."""
        for stats in self._rank_stats:
            report = stats.take_report(request_id)
            if report is not None:
                return report
        return None

    @property
    def kv_events(self) -> VllmKvEvents:
        """The KV event reader (its ``stats``; its ``config`` went into the engine)."""
        return self._kv_events

    async def abort(self, request_id: str) -> None:
        if request_id not in self._running:
            raise errors.NotFound(f"request {request_id!r} is not running on this worker")
        await self._llm.abort(request_id)

    async def generate(self, request: GenerateRequest) -> AsyncIterator[OutputDelta]:
        rid = request.request_id
        if rid in self._running:
            raise errors.InvalidArgument(
                f"request_id {rid!r} is already running on this worker; use a unique id"
            )
        params = sampling_params(request.sampling, self._kv_transfer_params(request))
        if params.structured_outputs is not None:
            self._check_structured(params.structured_outputs)
        arrived = time.monotonic()
        prompt_tokens = len(request.prompt_token_ids)
        try:
            # Token ids in, so rendering is cheap (no tokenizer); vLLM's preferred input form.
            prompt = TokensPrompt(prompt_token_ids=list(request.prompt_token_ids))
            if request.cache_salt:  # into the first block's hash, so every block's (vLLM)
                prompt["cache_salt"] = request.cache_salt
            (engine_input,) = self._llm.renderer.render_cmpl([prompt])
        except Exception as exc:
            domain = _domain_error(exc)
            if domain is None:
                raise
            raise domain from exc
        top_n = request.sampling.logprobs  # None: no logprobs asked for (nothing to convert)
        prompt_top_n = request.sampling.prompt_logprobs
        self._running.add(rid)
        if request.data_parallel_rank is not None:
            self._rank_of[rid] = request.data_parallel_rank
        try:
            stream = self._llm.generate(
                engine_input,
                params,
                rid,
                priority=-request.priority if self._by_priority else 0,
                data_parallel_rank=request.data_parallel_rank,
            )
            # aclosing: if our consumer stops early, vLLM's generator is closed right away,
            # which aborts the request in the engine.
            async with contextlib.aclosing(stream):
                first_token_s: float | None = None
                completion = 0
                while True:
                    try:
                        out: RequestOutput = await anext(stream)
                    except StopAsyncIteration:
                        return
                    except Exception as exc:
                        domain = _domain_error(exc)
                        if domain is None:
                            raise
                        raise domain from exc
                    now = time.monotonic()
                    c = out.outputs[0]
                    token_ids = tuple(c.token_ids)
                    completion += len(token_ids)
                    if first_token_s is None and token_ids:
                        first_token_s = now
                    finish = timing = split = None
                    cached = out.num_cached_tokens or 0
                    if out.finished:
                        finish = _finish(rid, c.finish_reason, c.stop_reason)
                        timing = Timing(
                            arrived_s=arrived,
                            scheduled_s=_scheduled_s(out),
                            first_token_s=first_token_s,
                            finished_s=now,
                        )
                        split = self._cached_split(rid, cached, out.kv_transfer_params)
                        cached = split.total
                    logprobs = prompt_logprobs = None
                    if top_n is not None and c.logprobs is not None:
                        logprobs = token_logprobs(token_ids, c.logprobs, top_n)
                    if prompt_top_n is not None and out.prompt_logprobs:
                        prompt_logprobs = self._prompt_logprobs(
                            request.prompt_token_ids, out.prompt_logprobs, prompt_top_n
                        )
                    yield OutputDelta(
                        request_id=rid,
                        token_ids=token_ids,
                        text=c.text,
                        prompt_tokens=prompt_tokens,
                        cached_tokens=cached,
                        completion_tokens=completion,
                        finish=finish,
                        timing=timing,
                        cached_by_tier=split,
                        logprobs=logprobs,
                        prompt_logprobs=prompt_logprobs,
                    )
                    if out.finished:
                        return
        finally:
            self._running.discard(rid)
            self._take_report(rid)
            self._rank_of.pop(rid, None)

    def _check_structured(self, so: StructuredOutputsParams) -> None:
        """The engine's own check of a structured output (the one vLLM runs when the request is
        added: the backend parses the schema, regex or grammar; milliseconds), on a probe that
        holds nothing else, so a refusal is known to be the constraint's and names its field.
        The request's own check then runs again, on the real parameters."""
        probe = SamplingParams(
            max_tokens=1,
            structured_outputs=StructuredOutputsParams(
                json=so.json,
                regex=so.regex,
                choice=so.choice,
                grammar=so.grammar,
                json_object=so.json_object,
            ),
        )
        config = self._llm.vllm_config
        try:
            probe.verify(
                self._llm.model_config,
                config.speculative_config,
                config.structured_outputs_config,
                self._llm.tokenizer,
            )
        except (ValueError, TypeError, VLLMClientError) as exc:
            raise errors.InvalidArgument(
                f"{STRUCTURED_FIELD} rejected by the engine's structured output backend: {exc}",
                STRUCTURED_FIELD,
            ) from None

    def _prompt_logprobs(
        self,
        prompt: Sequence[int],
        positions: Sequence[Mapping[int, Logprob] | None],
        top_n: int,
    ) -> tuple[TokenLogprob, ...]:
        """The prompt's logprobs; its first token (which vLLM gives none) decoded here."""
        out = token_logprobs(prompt, positions, top_n)
        if out and out[0].logprob is None and not out[0].token:
            tokenizer = self._llm.tokenizer
            text = tokenizer.decode([out[0].token_id]) if tokenizer is not None else ""
            out = (replace(out[0], token=text), *out[1:])
        return out

    def _cached_split(
        self, rid: str, engine_cached: int, params: Mapping[str, Any] | None
    ) -> CachedTokens:
        """``engine_cached`` (vLLM's num_cached_tokens) by source: the connector's load report
        from the final output, else from its stats, else none (all the engine's own)."""
        from_stats = self._take_report(rid)
        from_output = LoadReport.from_params(params)
        report = from_output or from_stats or LoadReport()
        if report.loaded or report.failed:
            log.debug(
                "request_id=%s loaded %s (report from the %s)",
                rid,
                report,
                "final output" if from_output is not None else "stats",
            )
        return CachedTokens.split(
            engine_cached, report.cpu, report.disk, report.peer, report.failed
        )

    def _kv_transfer_params(self, request: GenerateRequest) -> dict[str, Any] | None:
        """For the KV connector (engines without one get nothing): our request id (for its load
        report), the router's peer hint and count of the node store's prefix, and the current
        W3C trace context, which the connector sends on its kvmanager calls."""
        if not self._info.connector_layout:
            return None
        # The connector tags its load report with our id (vLLM's own gets a random suffix).
        params: dict[str, Any] = {REQUEST_ID_PARAM: request.request_id}
        if request.store_prefix_blocks is not None:
            params[STORE_PREFIX_PARAM] = request.store_prefix_blocks
        source = request.kv_source
        if source is not None:
            params.update(
                PeerSource(
                    source.kvmanager_id, source.blocks, source.handoff_wait_s, source.max_fetch_s
                ).to_params()
            )
        headers: dict[str, str] = {}
        propagate.inject(headers)  # nothing when no span is recording (tracing off)
        if headers.get("traceparent"):  # W3C trace context only (no baggage)
            params[TRACE_PARAM] = {k: headers[k] for k in TRACE_HEADERS if k in headers}
        return params

    async def close(self) -> None:
        running = list(self._running)
        if running:
            await self._llm.abort(running)
        llm = self._llm
        llm.shutdown()
        # AsyncLLM.__del__ calls shutdown() again, possibly at interpreter exit when vLLM's
        # module globals are already gone ("'NoneType' object is not callable").
        llm.shutdown = _already_shut_down  # type: ignore[method-assign]
        for reader in self._rank_events:
            await reader.close()


@contextlib.contextmanager
def _environment(values: Mapping[str, str]) -> Iterator[None]:
    """``values`` in os.environ while a child process starts (it inherits them), then restored."""
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _already_shut_down(timeout: float | None = None) -> None:
    pass


def _finish(request_id: str, reason: str | None, stop_reason: int | str | None) -> Finish:
    if reason == "error":
        # vLLM: a retryable request-level failure inside the engine (e.g. KV load failure).
        raise errors.Unavailable(f"the engine failed request {request_id!r} (retryable); retry it")
    kind = _FINISH_REASONS.get(reason or "")
    if kind is None:
        log.warning("unknown finish reason %r for request_id=%s", reason, request_id)
        kind = FinishReason.STOP
    return Finish(reason=kind, stop_reason="" if stop_reason is None else str(stop_reason))


def token_logprobs(
    token_ids: Sequence[int], positions: Sequence[Mapping[int, Logprob] | None], top_n: int
) -> tuple[TokenLogprob, ...]:
    """vLLM's logprobs of ``token_ids`` (per position: the token's own entry plus the ``top_n``
    most likely, in one dict, the token first) as ours: the token's own, and the ``top_n``
    most likely in rank order. A position without an entry for its token (a prompt's first)
    has no logprob."""
    out = []
    for token_id, position in zip(token_ids, positions, strict=False):
        own = position.get(token_id) if position else None
        if position is None or own is None:
            out.append(TokenLogprob(token_id, None, "", 0))
            continue
        ranked = sorted(
            ((lp.rank, tid, lp) for tid, lp in position.items() if lp.rank and lp.rank <= top_n),
            key=_rank,
        )
        top = tuple(TopLogprob(tid, lp.logprob, lp.decoded_token or "") for _r, tid, lp in ranked)
        out.append(
            TokenLogprob(token_id, own.logprob, own.decoded_token or "", own.rank or 0, top[:top_n])
        )
    return tuple(out)


def _rank(entry: tuple[int, int, Logprob]) -> int:
    return entry[0]


def _scheduled_s(out: RequestOutput) -> float | None:
    """When the engine core first scheduled the request (its monotonic clock), if known."""
    metrics = getattr(out, "metrics", None)
    ts = getattr(metrics, "scheduled_ts", 0.0) or 0.0
    return ts if ts > 0 else None
