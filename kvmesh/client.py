"""A small client for the router's gRPC API, used by the CLI, the demo, tests and benchmarks.

It fails over between routers (docs/failover.md, "Router failover from the client"): given
several addresses ("a:1,b:2", a list) or a DNS name with several (``dns:///name:port``), a
stream that breaks before its first token is sent again to the next router, and one that
breaks after tokens is resumed there (``GenerateRequest.resume``: the tokens received), within
``max_attempts``. Unary calls ride gRPC's own retry policy (``SERVICE_CONFIG``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum

import grpc

from kvmesh.tls import Tls, open_channel
from kvmesh.v1 import common_pb2, router_pb2, router_pb2_grpc

log = logging.getLogger(__name__)

# gRPC's own retries for the unary calls (ListModels, Abort) on UNAVAILABLE; with a DNS name,
# round_robin spreads calls over its addresses and a retry goes to another one. Generate is
# not retried by gRPC: a router's own UNAVAILABLE (its workers failed, it is draining) must
# reach the caller as it is, and a broken stream is this client's to retry or resume
# (``next_move``) on another router.
SERVICE_CONFIG = json.dumps(
    {
        "loadBalancingConfig": [{"round_robin": {}}],
        "methodConfig": [
            {
                "name": [
                    {"service": "kvmesh.v1.Router", "method": "ListModels"},
                    {"service": "kvmesh.v1.Router", "method": "Abort"},
                ],
                "retryPolicy": {
                    "maxAttempts": 3,
                    "initialBackoff": "0.05s",
                    "maxBackoff": "0.5s",
                    "backoffMultiplier": 2,
                    "retryableStatusCodes": ["UNAVAILABLE"],
                },
            }
        ],
    }
)


@dataclass
class Completion:
    """A finished stream, collected: what tests compare and the CLI prints."""

    request_id: str = ""
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str = ""
    usage: common_pb2.Usage | None = None
    chunks: int = 0
    first_chunk_s: float | None = None  # client-side time to the first chunk with tokens
    total_s: float = 0.0
    failovers: int = 0  # times the request went on through another router
    resumed: int = 0  # ... of those, after tokens (GenerateRequest.resume)
    routers: list[str] = field(default_factory=list)  # the router address of each attempt


def make_request(
    prompt: str | Sequence[int] | Sequence[dict[str, str]],
    *,
    max_tokens: int = 32,
    chat: bool = False,
    model: str = "",
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    seed: int | None = None,
    stop: Sequence[str] = (),
    stop_token_ids: Sequence[int] = (),
    ignore_eos: bool = False,
    request_id: str = "",
    session_id: str = "",
    tenant: str = "",
    priority: int = 0,
    cache_salt: str = "",
) -> router_pb2.GenerateRequest:
    """Text (as a user chat message when ``chat``), chat message dicts, or token ids.
    ``cache_salt``: vLLM's, honoured by an open router only (with API keys the router sets the
    tenant's)."""
    sampling = common_pb2.SamplingParams(
        max_tokens=max_tokens,
        stop=list(stop),
        stop_token_ids=list(stop_token_ids),
        ignore_eos=ignore_eos,
    )
    for name, value in (
        ("temperature", temperature),
        ("top_p", top_p),
        ("top_k", top_k),
        ("seed", seed),
    ):
        if value is not None:
            setattr(sampling, name, value)
    req = router_pb2.GenerateRequest(
        request_id=request_id,
        model=model,
        sampling=sampling,
        session_id=session_id,
        tenant=tenant,
        priority=priority,
        cache_salt=cache_salt,
    )
    if isinstance(prompt, str):
        if chat:
            req.chat.messages.add(role="user", content=prompt)
        else:
            req.text = prompt
    elif prompt and isinstance(prompt[0], dict):
        for m in prompt:
            req.chat.messages.add(**m)  # type: ignore[arg-type]
    else:
        req.token_ids.ids.extend(prompt)  # type: ignore[arg-type]
    return req


class Move(StrEnum):
    """What the client does after a Generate stream broke without its final message."""

    RETRY = "retry"  # the same request, to the next router (nothing was received)
    RESUME = "resume"  # the request with the tokens received, to the next router
    FAIL = "fail"  # raise the stream's error


# Statuses a stream breaks with when its router is gone, unreachable or shutting down (a killed
# process: UNAVAILABLE "Socket closed" / "Connection reset by peer"); any other is the
# request's own answer (INVALID_ARGUMENT, DEADLINE_EXCEEDED ...), not the router's failure.
FAILOVER_CODES = frozenset({grpc.StatusCode.UNAVAILABLE})


def next_move(
    code: grpc.StatusCode, received_tokens: int, attempts: int, max_attempts: int, resumable: bool
) -> Move:
    """After attempt ``attempts`` (1-based) of a stream ended with ``code`` and no final
    message, having delivered ``received_tokens`` over all attempts: fail over, or not. Pure."""
    if code not in FAILOVER_CODES or attempts >= max_attempts:
        return Move.FAIL
    if received_tokens == 0:
        return Move.RETRY
    return Move.RESUME if resumable else Move.FAIL


def resumable(request: router_pb2.GenerateRequest) -> bool:
    """Whether a router can resume the request (``GenerateRequest.resume``): not a structured
    output or a forced tool choice, whose grammar state a replay does not restore."""
    if request.sampling.HasField("structured_output"):
        return False
    forced = (router_pb2.TOOL_CHOICE_MODE_REQUIRED, router_pb2.TOOL_CHOICE_MODE_FUNCTION)
    return not (request.WhichOneof("input") == "chat" and request.chat.tool_choice.mode in forced)


def router_targets(addresses: str | Sequence[str]) -> list[str]:
    """gRPC targets from "a:1,b:2", a list, or one name (``dns:///name:port`` for every address
    of a DNS name: one target, spread by round_robin)."""
    items = addresses.split(",") if isinstance(addresses, str) else list(addresses)
    targets = [a.strip() for a in items if a.strip()]
    if not targets:
        raise ValueError("no router address given")
    return targets


@dataclass(slots=True)
class Stream:
    """A Generate stream across routers (``RouterClient.stream``): iterate it for the chunks;
    ``cancel()`` cancels the call in flight, as a gRPC call's does."""

    chunks: AsyncIterator[router_pb2.GenerateResponse] | None = None
    call: grpc.aio.UnaryStreamCall | None = None  # the current router's call

    def __aiter__(self) -> Stream:
        return self

    async def __anext__(self) -> router_pb2.GenerateResponse:
        assert self.chunks is not None
        return await anext(self.chunks)

    def cancel(self) -> bool:
        return self.call.cancel() if self.call is not None else False


DEFAULT_ATTEMPTS = 3


def default_attempts(targets: Sequence[str]) -> int:
    """Generate attempts per request when not told: one router address, plain, has no other
    router to fail over to (its own errors reach the caller as they are)."""
    if len(targets) > 1 or targets[0].startswith("dns:"):
        return DEFAULT_ATTEMPTS
    return 1


def _with_key(details: grpc.aio.ClientCallDetails, key: str) -> grpc.aio.ClientCallDetails:
    metadata = grpc.aio.Metadata(*(details.metadata or ()), ("authorization", f"Bearer {key}"))
    return details._replace(metadata=metadata)  # type: ignore[attr-defined,no-any-return]


class _UnaryKey(grpc.aio.UnaryUnaryClientInterceptor):
    """Adds ``authorization: Bearer <key>`` to unary calls (grpc.aio files an interceptor
    under one kind only: one class a kind)."""

    def __init__(self, key: str) -> None:
        self._key = key

    async def intercept_unary_unary(self, continuation, details, request):  # type: ignore[no-untyped-def]
        return await continuation(_with_key(details, self._key), request)


class _StreamKey(grpc.aio.UnaryStreamClientInterceptor):
    """The same for server-streaming calls (Generate)."""

    def __init__(self, key: str) -> None:
        self._key = key

    async def intercept_unary_stream(self, continuation, details, request):  # type: ignore[no-untyped-def]
        return await continuation(_with_key(details, self._key), request)


class RouterClient:
    """The router's API over one channel per address (``router_targets``), with failover."""

    def __init__(
        self,
        address: str | Sequence[str],
        *,
        max_attempts: int | None = None,
        service_config: str = SERVICE_CONFIG,
        api_key: str = "",
        tls: Tls | None = None,
    ) -> None:
        """``api_key``: sent with every call (``authorization: Bearer``) to a router that
        checks keys (``--api-keys-file``; docs/tenants.md); empty: none. ``tls``: the
        routers' TLS (``kvmesh/tls.py``: their CA, and a client certificate for a router that
        asks one); None: plaintext."""
        self.targets = router_targets(address)
        self.address = self.targets[0]
        # Generate attempts per request, over all routers; None: DEFAULT_ATTEMPTS when there
        # is another router to go to (several targets, or a DNS name's addresses), else 1.
        self.max_attempts = max_attempts or default_attempts(self.targets)
        options = [("grpc.service_config", service_config), ("grpc.enable_retries", 1)]
        interceptors = [_UnaryKey(api_key), _StreamKey(api_key)] if api_key else None
        self._channels = [
            open_channel(t, tls, options=options, interceptors=interceptors) for t in self.targets
        ]
        for ch in self._channels[1:]:
            ch.get_state(try_to_connect=True)  # connected before it has to take over
        self._stubs = [router_pb2_grpc.RouterStub(ch) for ch in self._channels]
        self._next = 0  # the router a new request goes to first
        self.stub = self._stubs[0]

    async def __aenter__(self) -> RouterClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        for ch in self._channels:
            await ch.close()

    def _unary(self, attempt: int) -> router_pb2_grpc.RouterStub:
        return self._stubs[(self._next + attempt) % len(self._stubs)]

    def stream(
        self,
        request: router_pb2.GenerateRequest,
        timeout_s: float | None = 600.0,
        out: Completion | None = None,
    ) -> Stream:
        """The request's chunks, as one stream across router failures (``next_move``): a
        resumed stream goes on with the chunks after the tokens received, without a gap or a
        repeat. ``out``: counts failovers there. Raises the last router's error."""
        stream = Stream()
        stream.chunks = self._failover(request, timeout_s, out, stream)
        return stream

    async def _failover(
        self,
        request: router_pb2.GenerateRequest,
        timeout_s: float | None,
        out: Completion | None,
        stream: Stream,
    ) -> AsyncIterator[router_pb2.GenerateResponse]:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        stats = out if out is not None else Completion()
        can_resume = resumable(request)
        ids: list[int] = []
        text: list[str] = []
        current = request
        first = self._next
        sent_s = time.monotonic()
        ttft_s = 0.0  # the client's, reported to the router it resumes through
        for attempt in range(1, self.max_attempts + 1):
            index = (first + attempt - 1) % len(self._stubs)
            stats.routers.append(self.targets[index])
            left = None if deadline is None else max(deadline - time.monotonic(), 0.001)
            call = self._stubs[index].Generate(current, timeout=left)
            stream.call = call
            try:
                async for chunk in call:
                    if chunk.request_id and not current.request_id:
                        current.request_id = chunk.request_id  # the router made it: keep it
                    if chunk.token_ids and not ttft_s:
                        ttft_s = time.monotonic() - sent_s
                    ids.extend(chunk.token_ids)
                    text.append(chunk.text)
                    yield chunk
                return
            except grpc.aio.AioRpcError as exc:
                move = next_move(exc.code(), len(ids), attempt, self.max_attempts, can_resume)
                if move is Move.FAIL:
                    raise
                log.warning(
                    "router %s failed (%s: %s) after %d token(s) of %s; %s on %s",
                    self.targets[index],
                    exc.code().name,
                    exc.details(),
                    len(ids),
                    current.request_id or "a request",
                    move.value,
                    self.targets[(index + 1) % len(self.targets)],
                )
                self._next = (index + 1) % len(self._stubs)  # new requests avoid it too
                stats.failovers += 1
                if move is Move.RESUME:
                    if current is request:
                        current = router_pb2.GenerateRequest()
                        current.CopyFrom(request)
                    current.resume.CopyFrom(
                        router_pb2.Resume(
                            token_ids=ids,
                            text="".join(text),
                            resumes=stats.resumed,
                            time_to_first_token_s=ttft_s,
                        )
                    )
                    stats.resumed += 1
            finally:
                call.cancel()

    async def complete(
        self,
        request: router_pb2.GenerateRequest,
        timeout_s: float | None = 600.0,
        on_chunk: Callable[[router_pb2.GenerateResponse], object] | None = None,
    ) -> Completion:
        """Collects a stream; ``on_chunk`` sees each chunk as it arrives (to print it)."""
        out = Completion()
        start = time.monotonic()
        async for chunk in self.stream(request, timeout_s, out):
            if on_chunk is not None:
                on_chunk(chunk)
            out.request_id = chunk.request_id
            out.chunks += 1
            if chunk.token_ids and out.first_chunk_s is None:
                out.first_chunk_s = time.monotonic() - start
            out.token_ids.extend(chunk.token_ids)
            out.text += chunk.text
            if chunk.HasField("finished"):
                out.finish_reason = common_pb2.FinishReason.Name(chunk.finished.reason)
                out.usage = chunk.finished.usage
        out.total_s = time.monotonic() - start
        return out

    async def list_models(self, timeout_s: float = 5.0) -> router_pb2.ListModelsResponse:
        """ListModels on the first router that answers (gRPC retries each one first)."""
        for attempt in range(len(self._stubs)):
            try:
                return await self._unary(attempt).ListModels(
                    router_pb2.ListModelsRequest(), timeout=timeout_s
                )
            except grpc.aio.AioRpcError as exc:
                if exc.code() not in FAILOVER_CODES or attempt == len(self._stubs) - 1:
                    raise
        raise AssertionError("unreachable")

    async def wait_for_models(self, timeout_s: float = 30.0) -> router_pb2.ListModelsResponse:
        """Polls ListModels until a worker serves something (a fresh mesh takes a moment)."""
        deadline = time.monotonic() + timeout_s
        while True:
            resp = await self.list_models()
            if resp.models or time.monotonic() > deadline:
                return resp
            await asyncio.sleep(0.1)


def usage_line(c: Completion) -> str:
    u = c.usage
    if u is None:
        return "[usage] (stream ended without a final chunk)"
    # A worker failed mid-stream and the router resumed the request elsewhere (docs/failover.md)
    resumed = f" resumed={u.resumes} recomputed={u.resume_recomputed_tokens}" if u.resumes else ""
    # A router failed and the client went on through another (docs/failover.md)
    if c.failovers:
        resumed += f" router_failovers={c.failovers}"
    return (
        f"[usage] prompt_tokens={u.prompt_tokens} cached_tokens={u.cached_prompt_tokens} "
        f"output_tokens={u.completion_tokens} ttft_ms={u.time_to_first_token_s * 1000:.0f} "
        f"worker={u.worker_id} finish={c.finish_reason.removeprefix('FINISH_REASON_').lower()}"
        f"{resumed}"
    )
