"""kvmesh.v1 answers -> OpenAI JSON. Pure: no sockets, no event loop, no clock (callers pass
``created``), so every rule is a unit-test row.

``ResponseTranslator`` turns the router's stream into OpenAI chunks (streaming) or one response
object (non-streaming), reading tool calls out of the text when the request gave tools
(``toolcalls``); the ``kvmesh`` object, usage, response headers and ``/v1/models`` bodies are
here too. The request side is ``parsing``.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvmesh.v1 import common_pb2, router_pb2

from ..core.forced_tools import ForcedKind
from . import forcedcalls, toolcalls
from .logprobs import NO_LOGPROBS, LogprobsOut, echo_prefix
from .parsing import Kind, ParsedRequest

FINISH_REASONS = {
    common_pb2.FINISH_REASON_STOP: "stop",
    common_pb2.FINISH_REASON_LENGTH: "length",
    common_pb2.FINISH_REASON_ABORT: "abort",
}


def usage_json(usage: common_pb2.Usage) -> dict[str, Any]:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_prompt_tokens},
    }


def cached_by_tier(usage: common_pb2.Usage) -> dict[str, int]:
    """Where the cached prompt tokens came from: the worker's own GPU prefix cache, its node
    kvmanager's CPU and disk tiers, a peer node's kvmanager. They add up to
    ``cached_prompt_tokens``; all 0 with cached tokens: the worker did not say (an older one)."""
    return {
        "gpu": usage.cached_gpu_tokens,
        "cpu": usage.cached_cpu_tokens,
        "disk": usage.cached_disk_tokens,
        "peer": usage.cached_peer_tokens,
    }


def kvmesh_json(request_id: str, usage: common_pb2.Usage) -> dict[str, Any]:
    """The ``kvmesh`` object of a response: which worker served it, what the cache saved, and
    whether it was resumed after a worker failed."""
    return {
        "request_id": request_id,
        "worker_id": usage.worker_id,
        "cached_tokens": usage.cached_prompt_tokens,
        "cached_tokens_by_tier": cached_by_tier(usage),
        "prompt_tokens": usage.prompt_tokens,
        "time_to_first_token_s": round(usage.time_to_first_token_s, 6),
        # a worker failed mid-stream and the request went on on another (docs/failover.md)
        "resumes": usage.resumes,
        "resume_recomputed_tokens": usage.resume_recomputed_tokens,
    }


def response_headers(request_id: str, usage: common_pb2.Usage | None) -> dict[str, str]:
    headers = {"x-request-id": request_id}
    if usage is not None:
        headers["x-kvmesh-worker"] = usage.worker_id
        headers["x-kvmesh-cached-tokens"] = str(usage.cached_prompt_tokens)
        headers["x-kvmesh-cached-tokens-by-tier"] = ",".join(
            f"{tier}={n}" for tier, n in cached_by_tier(usage).items()
        )
        headers["x-kvmesh-prompt-tokens"] = str(usage.prompt_tokens)
    return headers


def models_json(resp: router_pb2.ListModelsResponse, created: int) -> dict[str, Any]:
    return {"object": "list", "data": [model_json(m, created) for m in resp.models]}


def model_json(m: router_pb2.ModelInfo, created: int) -> dict[str, Any]:
    return {
        "id": m.name,
        "object": "model",
        "created": created,
        "owned_by": "kvmesh",
        "max_model_len": m.max_model_len,  # vLLM's extension field
        "kvmesh": {"block_size": m.block_size, "workers": m.workers},
    }


def new_call_id() -> str:
    """An OpenAI-style tool call id."""
    return "call_" + uuid.uuid4().hex[:24]


def tool_call_json(call: toolcalls.Call, call_id: str) -> dict[str, Any]:
    return {
        "id": call_id,
        "type": "function",
        "function": {"name": call.name, "arguments": call.arguments},
    }


@dataclass(slots=True)
class ResponseTranslator:
    """Feeds on the router's ``GenerateResponse`` stream; ``feed`` returns the SSE payloads each
    message becomes, ``response()`` the non-streaming body once the stream has finished.

    With ``request.parse_tool_calls`` the text is read for tool calls (``toolcalls``): streamed,
    text that may open a ``<tool_call>`` waits until it is known, and each call goes out as one
    ``tool_calls`` delta (index, id, type, name, whole arguments) once its block closes; a reply
    holding calls finishes with ``tool_calls``. ``call_id`` makes the calls' ids.

    ``index`` is the choice's (``choices``: one translator per choice); ``usage_tail`` False
    leaves the ``include_usage`` chunk to the caller (which adds up the choices')."""

    request: ParsedRequest
    created: int
    call_id: Callable[[], str] = new_call_id
    index: int = 0
    usage_tail: bool = True
    text: list[str] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | None = None
    usage: common_pb2.Usage | None = None
    _started: bool = False
    _calls: toolcalls.StreamParser | None = None
    _required: forcedcalls.RequiredParser | None = None
    _sent_calls: int = 0
    _logprobs: LogprobsOut | None = None  # None: neither logprobs nor echo asked for
    _echo_pending: bool = False

    def __post_init__(self) -> None:
        if self.request.kind is Kind.CHAT and self.request.stream:
            forced = self.request.forced
            if forced is not None and forced.kind is ForcedKind.REQUIRED:
                self._required = forcedcalls.RequiredParser()
            elif self.request.parse_tool_calls and forced is None:
                self._calls = toolcalls.StreamParser()
        options = self.request.logprobs
        if options != NO_LOGPROBS:
            self._logprobs = LogprobsOut(self.request.kind is Kind.CHAT, options)
            self._echo_pending = options.echo

    def _finish_reason(self, calls: int) -> str | None:
        forced = self.request.forced
        if forced is not None:
            # As OpenAI and vLLM answer: "tool_calls" for required, "stop" for a named function;
            # "length" when max_tokens cut the calls short.
            required = forced.kind is ForcedKind.REQUIRED
            return (
                "tool_calls"
                if calls and required and self.finish_reason == "stop"
                else (self.finish_reason)
            )
        if calls and self.finish_reason != "abort":
            return "tool_calls"
        return self.finish_reason

    def _named_delta(self, text: str) -> dict[str, Any]:
        """A named tool choice streams one call, its arguments as the model writes them."""
        forced = self.request.forced
        assert forced is not None
        if self._sent_calls:
            call: dict[str, Any] = {"index": 0, "function": {"arguments": text}}
        else:
            call = {
                "index": 0,
                **tool_call_json(toolcalls.Call(forced.function_name, text), self.call_id()),
            }
            self._sent_calls = 1
        return self._chunk({"tool_calls": [call]}, None)

    def _pieces(self, pieces: list[toolcalls.Piece]) -> list[dict[str, Any]]:
        """Stream chunks for what the tool call parser found."""
        out = []
        for piece in pieces:
            if isinstance(piece, toolcalls.Text):
                out.append(self._chunk({"content": piece.text}, None))
                continue
            call = {"index": self._sent_calls, **tool_call_json(piece, self.call_id())}
            self._sent_calls += 1
            out.append(self._chunk({"tool_calls": [call]}, None))
        return out

    @property
    def finished(self) -> bool:
        return self.usage is not None

    def feed(self, msg: router_pb2.GenerateResponse) -> list[dict[str, Any]]:
        out = []
        if self.request.kind is Kind.CHAT and not self._started:
            out.append(self._chunk({"role": "assistant", "content": ""}, None))
        self._started = True
        forced = self.request.forced
        named = forced is not None and forced.kind is ForcedKind.FUNCTION and self.request.stream
        text = msg.text
        echoed: list[common_pb2.TokenLogprob] = []
        if self._echo_pending:  # the first message: the prompt goes first
            self._echo_pending = False
            echoed = list(msg.prompt_logprobs)
            text = echo_prefix(self.request.logprobs, echoed) + text
        shown = len(out)
        if text:
            self.text.append(text)
            if self._calls is not None:
                out += self._pieces(self._calls.feed(text))
            elif self._required is not None:
                out += self._pieces(self._required.feed(text))
            elif named:
                out.append(self._named_delta(text))
            else:
                out.append(self._chunk({"content": text}, None, text=text))
        if self._logprobs is not None:
            lp = self._logprobs.feed(msg.logprobs, msg.prompt_logprobs, echoed)
            if lp is not None:  # on this message's last chunk (or one of its own)
                if len(out) == shown:
                    out.append(self._chunk({}, None, text=""))
                out[-1]["choices"][0]["logprobs"] = lp
        if msg.HasField("finished"):
            self.finish_reason = FINISH_REASONS.get(msg.finished.reason, "stop")
            self.stop_reason = msg.finished.stop_reason or None
            self.usage = msg.finished.usage
            if self._calls is not None:
                out += self._pieces(self._calls.finish())
            if self._required is not None:
                out += self._pieces(self._required.finish())
            last = self._chunk({}, self._finish_reason(self._sent_calls), text="")
            last["kvmesh"] = kvmesh_json(self.request.id, self.usage)
            out.append(last)
            if self.request.include_usage and self.usage_tail:
                tail = self._base()
                tail["choices"] = []
                tail["usage"] = usage_json(self.usage)
                out.append(tail)
        return out

    def _base(self) -> dict[str, Any]:
        obj = "chat.completion.chunk" if self.request.kind is Kind.CHAT else "text_completion"
        body: dict[str, Any] = {
            "id": self.request.id,
            "object": obj,
            "created": self.created,
            "model": self.request.model,
        }
        if self.request.include_usage:
            body["usage"] = None
        return body

    def _chunk(
        self, delta: dict[str, Any], finish_reason: str | None, text: str = ""
    ) -> dict[str, Any]:
        body = self._base()
        if self.request.kind is Kind.CHAT:
            choice: dict[str, Any] = {"index": self.index, "delta": delta, "logprobs": None}
        else:
            choice = {"index": self.index, "text": text, "logprobs": None}
        choice["finish_reason"] = finish_reason
        if finish_reason is not None:
            choice["stop_reason"] = self.stop_reason  # vLLM's extension
        body["choices"] = [choice]
        return body

    def response(self) -> dict[str, Any]:
        if self.usage is None:
            raise RuntimeError("the stream has not finished")
        text = "".join(self.text)
        finish_reason = self.finish_reason
        if self.request.kind is Kind.CHAT:
            message: dict[str, Any] = {"role": "assistant", "content": text}
            forced = self.request.forced
            if self.request.parse_tool_calls:
                if forced is None:
                    content, calls = toolcalls.parse(text)
                elif forced.kind is ForcedKind.REQUIRED:
                    content, calls = forcedcalls.parse_required(text)
                else:
                    call = forcedcalls.named_call(text, forced.function_name)
                    content, calls = ("", [call]) if call is not None else (text, [])
                if calls:
                    message["content"] = content or None
                    message["tool_calls"] = [tool_call_json(c, self.call_id()) for c in calls]
                    finish_reason = self._finish_reason(len(calls))
            choice: dict[str, Any] = {"index": self.index, "message": message, "logprobs": None}
        else:
            choice = {"index": self.index, "text": text, "logprobs": None}
        choice["finish_reason"] = finish_reason
        choice["stop_reason"] = self.stop_reason
        body: dict[str, Any] = {
            "id": self.request.id,
            "object": self.request.kind.value,
            "created": self.created,
            "model": self.request.model,
            "choices": [choice],
            "usage": usage_json(self.usage),
            "kvmesh": kvmesh_json(self.request.id, self.usage),
        }
        if self._logprobs is not None:
            choice["logprobs"] = self._logprobs.whole()
            prompt = self._logprobs.prompt()
            if prompt is not None:  # vLLM's extension: on the choice, or the chat answer
                holder = choice if self.request.kind is Kind.COMPLETION else body
                holder["prompt_logprobs"] = prompt
        return body
