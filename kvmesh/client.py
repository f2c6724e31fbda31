"""A small client for the router's gRPC API, used by the CLI, the demo, tests and benchmarks."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field

import grpc

from kvmesh.v1 import common_pb2, router_pb2, router_pb2_grpc


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
) -> router_pb2.GenerateRequest:
    """Text (as a user chat message when ``chat``), chat message dicts, or token ids."""
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


class RouterClient:
    def __init__(self, address: str) -> None:
        self.address = address
        self._channel = grpc.aio.insecure_channel(address)
        self.stub = router_pb2_grpc.RouterStub(self._channel)

    async def __aenter__(self) -> RouterClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self._channel.close()

    def stream(
        self, request: router_pb2.GenerateRequest, timeout_s: float | None = 600.0
    ) -> AsyncIterator[router_pb2.GenerateResponse]:
        return self.stub.Generate(request, timeout=timeout_s)

    async def complete(
        self,
        request: router_pb2.GenerateRequest,
        timeout_s: float | None = 600.0,
        on_chunk: Callable[[router_pb2.GenerateResponse], object] | None = None,
    ) -> Completion:
        """Collects a stream; ``on_chunk`` sees each chunk as it arrives (to print it)."""
        out = Completion()
        start = time.monotonic()
        async for chunk in self.stream(request, timeout_s):
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

    async def wait_for_models(self, timeout_s: float = 30.0) -> router_pb2.ListModelsResponse:
        """Polls ListModels until a worker serves something (a fresh mesh takes a moment)."""
        deadline = time.monotonic() + timeout_s
        while True:
            resp = await self.stub.ListModels(router_pb2.ListModelsRequest(), timeout=5.0)
            if resp.models or time.monotonic() > deadline:
                return resp
            await asyncio.sleep(0.1)


def usage_line(c: Completion) -> str:
    u = c.usage
    if u is None:
        return "[usage] (stream ended without a final chunk)"
    # A worker failed mid-stream and the router resumed the request elsewhere (docs/failover.md)
    resumed = f" resumed={u.resumes} recomputed={u.resume_recomputed_tokens}" if u.resumes else ""
    return (
        f"[usage] prompt_tokens={u.prompt_tokens} cached_tokens={u.cached_prompt_tokens} "
        f"output_tokens={u.completion_tokens} ttft_ms={u.time_to_first_token_s * 1000:.0f} "
        f"worker={u.worker_id} finish={c.finish_reason.removeprefix('FINISH_REASON_').lower()}"
        f"{resumed}"
    )
