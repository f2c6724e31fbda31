"""kvmesh.v1.Router over gRPC: Generate, Abort, ListModels. ``stream`` admits a request and
turns it into a ``RouteRequest`` (``prepare.py``); ``proxy.py`` carries it through its worker
attempts (``attempt.py``; a disaggregated request's prefill: ``disagg.py``)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable

import grpc
from opentelemetry import trace

from kvmesh import errors
from kvmesh.discovery.keys import WorkerId
from kvmesh.grpc_errors import status_for
from kvmesh.kv.hashing import check_cache_salt
from kvmesh.sampling import (
    STRUCTURED_FIELD,
    check_prompt,
    check_sampling,
    fitted_max_tokens,
    sampling_from_pb,
)
from kvmesh.v1 import common_pb2, router_pb2, router_pb2_grpc

from .admission import AdmissionGate
from .attempt import Active, AttemptRunner
from .auth import CALLER, KeySource
from .config import RouterConfig
from .continuation import Prior
from .core import validation
from .core.disagg import DisaggHandler
from .core.forced_tools import TOOLS_FIELD, ForcedChoice
from .core.index_types import StoreId
from .core.peers import PeerHints
from .core.routing import RoutingPolicy
from .core.types import RouteRequest
from .core.workers import WorkerSet
from .metrics import RouterMetrics
from .pool import WorkerPool
from .prefill import Prefills
from .prepare import constrained_sampling, forced_choice, prompt_input
from .prompt import PromptBuilder
from .proxy import Proxy
from .resume import Replay
from .retention import SessionRetention

log = logging.getLogger(__name__)


class RouterServicer(router_pb2_grpc.RouterServicer):
    def __init__(
        self,
        config: RouterConfig,
        workers: WorkerSet,
        pool: WorkerPool,
        policy: RoutingPolicy,
        prompts: PromptBuilder,
        metrics: RouterMetrics | None = None,
        peers: PeerHints | None = None,
        disagg: DisaggHandler | None = None,
        linked: Callable[[WorkerId], StoreId | None] | None = None,
    ) -> None:
        self._config = config
        # The worker -> node store link (the KV index's); None: no worker can hand KV over.
        self._linked: Callable[[WorkerId], StoreId | None] = linked or (lambda _w: None)
        self._disagg = disagg or DisaggHandler(
            config.disagg, policy, can_hand_off=lambda w: self._linked(w) is not None
        )
        self._workers = workers
        self._pool = pool
        self._prompts = prompts
        self.metrics = metrics or RouterMetrics()
        self.metrics.in_flight.set_function(lambda: len(self._active))
        # request id -> its worker, while an attempt or a tracked prefill runs (for Abort)
        self._active: dict[str, Active] = {}
        self._proxy = Proxy(
            config,
            workers,
            prompts,
            self.metrics,
            self._disagg,
            peers,
            AttemptRunner(
                config,
                workers,
                pool,
                policy,
                self.metrics,
                self._active,
                peers.computed if peers is not None else None,
            ),
            Prefills(
                self._disagg.config, workers, pool, policy, self.metrics, self._active, self._linked
            ),
        )
        # Flow control in front of the scheduler (--admission); None: every request is routed
        # at once, as before.
        self.admission: AdmissionGate | None = None
        if config.admission.enabled:
            self.admission = AdmissionGate(
                config.admission,
                workers,
                policy,
                self.metrics.admission,
                keyed=bool(config.api_keys or config.api_keys_file),
                cluster=config.cluster,
            )
        # Session retention (--retention-ttl-s; main.py sets it): None: off.
        self.retention: SessionRetention | None = None
        self._draining = False
        self.not_ready = ""  # while starting: why new requests are refused ("": ready)

    @property
    def draining(self) -> bool:
        return self._draining

    @draining.setter
    def draining(self, value: bool) -> None:
        """Set when the router starts shutting down: new requests are refused, and so are the
        ones waiting in flow control (to another router)."""
        self._draining = value
        if value and self.admission is not None:
            self.admission.drain()

    def use_keys(self, keys: KeySource) -> None:
        """The API key table in force (main.py): flow control's per-tenant rate limits."""
        if self.admission is not None:
            self.admission.use_keys(keys)

    # ---- Generate -------------------------------------------------------------------------
    def Generate(
        self, request: router_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[router_pb2.GenerateResponse]:
        # A plain function returning the generator: the host's error interceptor
        # (kvmesh.grpc_errors.ErrorStatus) maps what it raises, and its wrapper is the one hop
        # between gRPC and ``stream``. The id is set on the request, so an INTERNAL status
        # names the id this request is logged under.
        if not request.request_id:
            request.request_id = uuid.uuid4().hex
        return self.stream(request, request.request_id, context.time_remaining())

    async def stream(
        self,
        request: router_pb2.GenerateRequest,
        rid: str,
        time_remaining_s: float | None,
    ) -> AsyncGenerator[router_pb2.GenerateResponse, None]:
        """One request, transport-free: what ``Generate`` serves over gRPC and what the HTTP
        front door calls in-process (``http.backend.InProcessRouterBackend``). Raises domain
        errors; closing the generator early cancels the worker call (the engine aborts)."""
        arrived = time.monotonic()
        # The request's span: the RPC's server span (kvmesh.telemetry.ServerSpans), or the HTTP
        # front door's; the trace's root unless the client sent a trace context.
        request_span = trace.get_current_span()
        request_span.set_attribute("request_id", rid)
        model_name = ""
        code = "OK"
        finished = False  # the final chunk was handed out
        forced: ForcedChoice | None = None
        admission = self.admission
        ticket = None  # its place in flow control, once admitted
        usage: common_pb2.Usage | None = None  # the final chunk's
        prefilled = False  # its first token came
        prompt_tokens = 0
        retention = self.retention if request.session_id else None
        output_ids: list[int] = []  # a session's turn's output, to retain its blocks
        try:
            if rid in self._active:
                raise errors.InvalidArgument(
                    f"request_id {rid!r} is already in flight; use a unique id per request"
                )
            if self.draining:
                raise errors.Unavailable("router is shutting down; retry on another router")
            if self.not_ready:
                raise errors.Unavailable(
                    f"router is starting ({self.not_ready}); retry shortly or on another router"
                )
            model = self._workers.model(request.model)
            model_name = model.name
            if retention is not None:  # its node brings the session's blocks to RAM meanwhile
                retention.before_turn(model, request.session_id, request.tenant)
            request_span.set_attribute("model", model_name)
            if admission is not None:  # a full queue refuses before the prompt is tokenized
                admission.precheck(model.name, request.tenant, request.priority)
            sampling = sampling_from_pb(request.sampling)
            check_sampling(sampling, model.vocab_size)
            check_cache_salt(request.cache_salt)  # the tenant's with API keys (auth.py)
            fit = request.fit_max_tokens
            prompt = await self._prompts.build(
                model.name,
                model.model_path,
                model.block_size,
                request.session_id,
                prompt_input(request),
                lambda ids: check_prompt(
                    ids,
                    fitted_max_tokens(sampling.max_tokens, len(ids), model.max_model_len, fit),
                    model.vocab_size,
                    model.max_model_len,
                ),
                request.cache_salt,
            )
            ids, hashed = prompt.token_ids, prompt.hashed
            fitted = fitted_max_tokens(sampling.max_tokens, len(ids), model.max_model_len, fit)
            if fitted != sampling.max_tokens:  # the context's room (Anthropic's max_tokens)
                request.sampling.max_tokens = fitted
                sampling = sampling_from_pb(request.sampling)
                check_sampling(sampling, model.vocab_size)
            forced = forced_choice(request)
            sampling_pb = constrained_sampling(request, forced)
            route = RouteRequest(
                request_id=rid,
                model=model.name,
                prompt_token_ids=tuple(ids),
                session_id=request.session_id,
                tenant=request.tenant,
                priority=request.priority,
                block_hashes=hashed.hashes,
                cache_salt=request.cache_salt,
            )
            if forced is not None or sampling_pb.HasField("structured_output"):
                not_resumable = "a structured output's grammar state cannot be replayed"
            else:
                not_resumable = ""
            resume = request.resume  # the client's, after its router failed mid-stream
            validation.check_resume(
                resume.token_ids,
                resume.text,
                sampling.max_tokens,
                model.vocab_size,
                not_resumable,
                resume.time_to_first_token_s,
            )
            replay = Replay.from_client(len(ids), resume) if resume.token_ids else None
            if admission is not None:
                prompt_tokens = route.prompt_tokens
                left_s = (
                    self._config.default_timeout_s if time_remaining_s is None else time_remaining_s
                )
                ticket = await admission.admit(route, sampling.max_tokens, arrived + left_s)
            chunks = self._proxy.run(
                route, model, sampling_pb, time_remaining_s, arrived, not_resumable, replay
            )
            async with contextlib.aclosing(chunks):
                async for chunk in chunks:
                    finished = chunk.HasField("finished")
                    if retention is not None:
                        output_ids.extend(chunk.token_ids)
                    if finished:
                        usage = chunk.finished.usage
                    if (
                        admission is not None
                        and ticket is not None
                        and not prefilled
                        and (chunk.token_ids or finished)
                    ):
                        prefilled = True  # its prefill is off the worker's backlog: look again
                        admission.prefilled(ticket)
                    if finished and retention is not None and usage is not None:
                        if request.end_session:
                            retention.end(
                                model, request.session_id, request.tenant, usage.worker_id
                            )
                        else:
                            retention.after_turn(
                                model,
                                request.session_id,
                                request.tenant,
                                request.cache_salt,
                                ids,
                                output_ids,
                                usage.worker_id,
                                usage.cached_prompt_tokens,
                                request.retention_ttl_s,
                            )
                    yield chunk
        except errors.KvmeshError as exc:
            code = status_for(exc).name
            if (
                admission is not None
                and isinstance(exc, errors.Unavailable)
                and exc.retry_after_s is None
            ):  # no worker, draining: say when to come back
                exc.retry_after_s = admission.config.unavailable_retry_after_s
            log.info("request %s rejected: %s: %s", rid, type(exc).__name__, exc)
            if (
                forced is not None
                and isinstance(exc, errors.InvalidArgument)
                and exc.field == STRUCTURED_FIELD
            ):  # the schema came from the tools: they are what to fix
                raise errors.InvalidArgument(
                    f"the engine cannot constrain the output to calls of chat.tools (forced "
                    f"chat.tool_choice): {exc}",
                    TOOLS_FIELD,
                ) from exc
            raise
        except (asyncio.CancelledError, GeneratorExit):
            # A caller that stops reading after the final chunk (the HTTP front door) ends a
            # finished request: that is OK, not a cancel.
            if not finished:
                code = "CANCELLED"
                log.info("request %s cancelled by the client", rid)
            raise
        except Exception:
            code = "INTERNAL"
            raise
        finally:
            if ticket is not None and admission is not None:
                if usage is None:  # ended without its final message
                    admission.release(ticket, prompt_tokens, 0, None)
                else:
                    admission.release(
                        ticket,
                        usage.prompt_tokens,
                        usage.cached_prompt_tokens,
                        usage.completion_tokens,
                    )
            self.metrics.ended(model_name, code)

    async def count_tokens(self, request: router_pb2.GenerateRequest) -> int:
        """The prompt tokens ``request`` has (its chat template rendered with its tools), without
        routing or generating: the Anthropic front door's count_tokens."""
        model = self._workers.model(request.model)
        return await self._prompts.count(model.name, model.model_path, prompt_input(request))

    async def render_prompt(
        self, request: router_pb2.GenerateRequest, prior: Prior | None, new_from: int
    ) -> tuple[list[int], bool]:
        """A chat request's prompt ids, and whether they extend ``prior`` (the previous turn's
        stored prompt and output ids) exactly (``PromptBuilder.render``): the Responses front
        door's ``previous_response_id``. The chat is checked as ``Generate`` checks it."""
        model = self._workers.model(request.model)
        source = prompt_input(request)
        if source.chat is None:
            raise errors.InvalidArgument("render_prompt takes a chat request", "chat")
        return await self._prompts.render(
            model.name, model.model_path, source.chat, prior, new_from
        )

    # ---- Abort, ListModels ----------------------------------------------------------------
    async def Abort(
        self, request: common_pb2.AbortRequest, context: grpc.aio.ServicerContext
    ) -> common_pb2.AbortResponse:
        active = self._active.get(request.request_id)
        caller = CALLER.get()  # with API keys: only the request's own tenant may abort it
        if active is None or (caller is not None and caller.tenant != active.tenant):
            raise errors.NotFound(f"request {request.request_id!r} is not in flight on this router")
        stub = self._pool.stub(active.worker_id)
        if stub is not None:
            try:
                await stub.Abort(
                    common_pb2.AbortRequest(request_id=request.request_id),
                    timeout=self._config.worker_call_timeout_s,
                )
            except grpc.aio.AioRpcError as exc:
                if exc.code() is not grpc.StatusCode.NOT_FOUND:  # finished meanwhile: fine
                    raise errors.Unavailable(f"abort failed: {exc.details()}") from exc
        return common_pb2.AbortResponse()

    async def ListModels(
        self, request: router_pb2.ListModelsRequest, context: grpc.aio.ServicerContext
    ) -> router_pb2.ListModelsResponse:
        return self.models()

    def models(self) -> router_pb2.ListModelsResponse:
        """The served models (``ListModels``; the HTTP front door's ``/v1/models``)."""
        return router_pb2.ListModelsResponse(
            models=[
                router_pb2.ModelInfo(
                    name=m.name,
                    max_model_len=m.max_model_len,
                    block_size=m.block_size,
                    workers=m.workers,
                )
                for m in self._workers.models()
            ]
        )

    @property
    def in_flight(self) -> int:
        return len(self._active)
