"""Session retention, the router's adapter: after each turn of a session, tell the node
kvmanager of the worker that served it to keep the turn's blocks (``KvManager.RetainSession``,
with a deadline), in the background; and count whether each turn found the previous one's
prefix (``core/sessions.py``). Every trouble degrades to no retention: a failed pin is logged
and counted, never seen by the request. docs/agents.md#retention.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

import grpc
from prometheus_client import CollectorRegistry, Counter

from kvmesh.discovery.keys import WorkerId
from kvmesh.telemetry import client_interceptors
from kvmesh.tls import Tls, open_channel
from kvmesh.v1 import kvmanager_pb2, kvmanager_pb2_grpc

from .core.node_stores import TierStream
from .core.sessions import RetentionConfig, SessionBook, retained_ids
from .core.workers import ModelSummary
from .prompt import PromptBuilder, PromptInput

log = logging.getLogger(__name__)


class RetentionMetrics:
    def __init__(self, r: CollectorRegistry) -> None:
        self.turns = Counter(
            "kvmesh_router_retention_turns",
            "Session turns after a retained one, by outcome: hit (the previous turn's prompt "
            "was cached) or miss.",
            ["model", "outcome"],
            registry=r,
        )
        self.pins = Counter(
            "kvmesh_router_retention_pins",
            "RetainSession calls after a session's turn (ReleaseSession after its last), by "
            "outcome: ok, released, failed (the kvmanager refused or did not answer), "
            "no_kvmanager (the worker has none).",
            ["model", "outcome"],
            registry=r,
        )
        self.prefetches = Counter(
            "kvmesh_router_retention_prefetches",
            "PrefetchSession calls when a retained session's turn arrives, by outcome: ok, "
            "failed (the kvmanager refused or did not answer in time), no_kvmanager.",
            ["model", "outcome"],
            registry=r,
        )
        self.prefetched_blocks = Counter(
            "kvmesh_router_retention_prefetched_blocks",
            "Blocks the kvmanagers brought from disk to RAM on the router's prefetch calls.",
            ["model"],
            registry=r,
        )


class SessionRetention:
    """``stream_of(worker)``: the worker's node store (kvmanager address and layout), if any."""

    def __init__(
        self,
        config: RetentionConfig,
        prompts: PromptBuilder,
        stream_of: Callable[[WorkerId], TierStream | None],
        registry: CollectorRegistry,
        tls: Tls | None = None,
    ) -> None:
        self.config = config
        self._prompts = prompts
        self._stream_of = stream_of
        self._tls = tls
        self.book = SessionBook(config.max_sessions)
        self.metrics = RetentionMetrics(registry)
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._tasks: set[asyncio.Task[Any]] = set()

    def before_turn(self, model: ModelSummary, session_id: str, tenant: str) -> None:
        """A session's turn arrived: if its last turn was retained, ask that node's kvmanager
        to bring the retained blocks from disk into RAM while this turn is tokenized, routed
        and queued (in the background; the request does not wait)."""
        if not self.config.prefetch_timeout_s:
            return
        worker_id = self.book.worker_of(tenant, session_id)
        if worker_id is None:
            return
        self._background(self._prefetch(model, session_id, tenant, worker_id))

    def after_turn(
        self,
        model: ModelSummary,
        session_id: str,
        tenant: str,
        cache_salt: str,
        prompt_ids: Sequence[int],
        output_ids: Sequence[int],
        worker_id: str,
        cached_prompt_tokens: int,
        ttl_s: float = 0.0,
    ) -> None:
        """A session's turn ended with its final message: judge it, and pin its blocks (in
        the background; the request does not wait) for ``ttl_s`` (0: the configured TTL)."""
        outcome = self.book.judge(tenant, session_id, cached_prompt_tokens)
        if outcome is not None:
            self.metrics.turns.labels(model.name, outcome.value).inc()
        ids = retained_ids(prompt_ids, output_ids)
        if len(ids) < model.block_size:
            return
        self._background(
            self._pin(
                model,
                session_id,
                tenant,
                cache_salt,
                ids,
                len(prompt_ids),
                worker_id,
                self.config.turn_ttl_s(ttl_s),
            )
        )

    def end(self, model: ModelSummary, session_id: str, tenant: str, worker_id: str) -> None:
        """The session ended with this turn: release its retention (in the background)."""
        self.book.forget(tenant, session_id)
        self._background(self._release(model, session_id, tenant, worker_id))

    def _background(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _prefetch(
        self, model: ModelSummary, session_id: str, tenant: str, worker_id: str
    ) -> None:
        stream = self._stream_of(WorkerId(worker_id))
        if stream is None:
            self.metrics.prefetches.labels(model.name, "no_kvmanager").inc()
            return
        stub = kvmanager_pb2_grpc.KvManagerStub(self._channel(stream.address))
        try:
            got = await stub.PrefetchSession(
                kvmanager_pb2.PrefetchSessionRequest(session_id=session_id, tenant=tenant),
                timeout=self.config.prefetch_timeout_s,
            )
        except grpc.aio.AioRpcError as exc:
            self.metrics.prefetches.labels(model.name, "failed").inc()
            log.info(
                "session %s: kvmanager %s did not prefetch its blocks: %s %s",
                session_id,
                stream.kvmanager_id,
                exc.code().name,
                exc.details(),
            )
            return
        self.metrics.prefetches.labels(model.name, "ok").inc()
        self.metrics.prefetched_blocks.labels(model.name).inc(got.promoted_blocks)
        log.debug(
            "session %s: %d of %d retained blocks brought to RAM on %s (%d there already, "
            "%d left on disk, %d missing)",
            session_id,
            got.promoted_blocks,
            got.retained_blocks,
            stream.kvmanager_id,
            got.in_cpu_blocks,
            got.on_disk_blocks,
            got.missing_blocks,
        )

    async def _release(
        self, model: ModelSummary, session_id: str, tenant: str, worker_id: str
    ) -> None:
        stream = self._stream_of(WorkerId(worker_id))
        if stream is None:
            self.metrics.pins.labels(model.name, "no_kvmanager").inc()
            return
        stub = kvmanager_pb2_grpc.KvManagerStub(self._channel(stream.address))
        try:
            await stub.ReleaseSession(
                kvmanager_pb2.ReleaseSessionRequest(session_id=session_id, tenant=tenant),
                timeout=self.config.timeout_s,
            )
        except grpc.aio.AioRpcError as exc:
            self.metrics.pins.labels(model.name, "failed").inc()
            log.info("session %s: release failed: %s", session_id, exc.code().name)
            return
        self.metrics.pins.labels(model.name, "released").inc()

    async def _pin(
        self,
        model: ModelSummary,
        session_id: str,
        tenant: str,
        cache_salt: str,
        ids: list[int],
        prompt_tokens: int,
        worker_id: str,
        ttl_s: float,
    ) -> None:
        stream = self._stream_of(WorkerId(worker_id))
        if stream is None:
            self.metrics.pins.labels(model.name, "no_kvmanager").inc()
            return
        try:
            prompt = await self._prompts.build(
                model.name,
                model.model_path,
                model.block_size,
                session_id,
                PromptInput(token_ids=ids),
                lambda _ids: None,
                cache_salt,
            )
            stub = kvmanager_pb2_grpc.KvManagerStub(self._channel(stream.address))
            got = await stub.RetainSession(
                kvmanager_pb2.RetainSessionRequest(
                    layout_key=stream.layout_key,
                    session_id=session_id,
                    tenant=tenant,
                    block_hashes=prompt.hashed.hashes,
                    ttl_s=ttl_s,
                ),
                timeout=self.config.timeout_s,
            )
        except grpc.aio.AioRpcError as exc:
            self.metrics.pins.labels(model.name, "failed").inc()
            log.info(
                "session %s: kvmanager %s did not retain its blocks: %s %s",
                session_id,
                stream.kvmanager_id,
                exc.code().name,
                exc.details(),
            )
            return
        except Exception:
            self.metrics.pins.labels(model.name, "failed").inc()
            log.warning("session %s: retaining its blocks failed", session_id, exc_info=True)
            return
        self.metrics.pins.labels(model.name, "ok").inc()
        self.book.pinned(tenant, session_id, prompt_tokens, model.block_size, worker_id)
        log.debug(
            "session %s: %d blocks retained on %s (%d held, %d sessions released)",
            session_id,
            got.retained_blocks,
            stream.kvmanager_id,
            got.held_blocks,
            got.released_sessions,
        )

    def _channel(self, address: str) -> grpc.aio.Channel:
        ch = self._channels.get(address)
        if ch is None:
            ch = self._channels[address] = open_channel(
                address, self._tls, interceptors=client_interceptors()
            )
        return ch

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for ch in self._channels.values():
            await ch.close()
        self._channels.clear()
