"""The router's answer stream as Anthropic Messages: the event sequence (streaming) or one
message (not). Pure.

Both feed the router's messages to the OpenAI front door's ``rendering.ResponseTranslator``,
which reads tool calls out of the text (hermes blocks, or the JSON a forced tool choice
constrained it to), and turn what it makes into Anthropic's shapes: its text deltas become a
text block's ``text_delta``s, each tool call a ``tool_use`` block whose arguments go out as
``input_json_delta``s (whole, or as the model writes them for a named tool choice). Events:
``message_start``, ``ping``, then per block ``content_block_start`` / ``content_block_delta`` /
``content_block_stop``, then ``message_delta`` (stop reason, usage) and ``message_stop``.

The usage is known only at the end: ``message_start`` carries zeros and ``message_delta`` the
whole usage (Anthropic's message_delta counts are cumulative; the SDKs take them)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from kvmesh.v1 import router_pb2

from . import rendering
from .anthropic import MessagesRequest, aborted, message_json, new_tool_use_id, stop_reason
from .anthropic import usage_json as anthropic_usage

Event = tuple[str, dict[str, Any]]  # (event type, data)


def _translator(request: MessagesRequest) -> rendering.ResponseTranslator:
    return rendering.ResponseTranslator(request.chat, 0, call_id=new_tool_use_id)


@dataclass(slots=True)
class MessageCollector:
    """Non-streaming: ``feed`` the router's messages until ``finished``, then ``message()``.
    An aborted answer raises ``anthropic.aborted()`` from ``message()``."""

    request: MessagesRequest
    block_size: int = 0
    _out: rendering.ResponseTranslator = field(init=False)

    def __post_init__(self) -> None:
        self._out = _translator(self.request)

    @property
    def finished(self) -> bool:
        return self._out.finished

    @property
    def usage(self) -> Any:
        return self._out.usage

    def feed(self, msg: router_pb2.GenerateResponse) -> None:
        self._out.feed(msg)

    def message(self) -> dict[str, Any]:
        if self._out.finish_reason == "abort":
            raise aborted()
        assert self._out.usage is not None
        return message_json(
            self.request,
            self._out.response(),
            self._out.stop_reason,
            self._out.usage,
            self.block_size,
        )


@dataclass(slots=True)
class EventStream:
    """Streaming: ``start()`` gives the opening events, ``feed`` those each router message
    becomes (the last ones once ``finished``). An aborted answer raises ``anthropic.aborted()``
    from ``feed`` (the server sends it as an ``error`` event)."""

    request: MessagesRequest
    block_size: int = 0
    _out: rendering.ResponseTranslator = field(init=False)
    _index: int = -1  # the open content block's index; -1 before the first
    _open: str | None = None  # "text" or "tool_use" while a block is open
    _calls: list[list[str]] = field(default_factory=list)  # each tool call's argument pieces

    def __post_init__(self) -> None:
        self._out = _translator(self.request)

    @property
    def finished(self) -> bool:
        return self._out.finished

    def start(self) -> list[Event]:
        message: dict[str, Any] = {
            "id": self.request.id,
            "type": "message",
            "role": "assistant",
            "model": self.request.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": 0, "output_tokens": 0},
        }
        return [
            ("message_start", {"type": "message_start", "message": message}),
            ("ping", {"type": "ping"}),
        ]

    def _close(self, out: list[Event]) -> None:
        if self._open is not None:
            out.append(("content_block_stop", {"type": "content_block_stop", "index": self._index}))
            self._open = None

    def _begin(self, out: list[Event], block: dict[str, Any]) -> None:
        self._close(out)
        self._index += 1
        self._open = block["type"]
        start = {"type": "content_block_start", "index": self._index, "content_block": block}
        out.append(("content_block_start", start))

    def _delta(self, out: list[Event], delta: dict[str, Any]) -> None:
        body = {"type": "content_block_delta", "index": self._index, "delta": delta}
        out.append(("content_block_delta", body))

    def _text(self, out: list[Event], text: str) -> None:
        if self._open != "text":
            self._begin(out, {"type": "text", "text": ""})
        self._delta(out, {"type": "text_delta", "text": text})

    def _call(self, out: list[Event], call: dict[str, Any]) -> None:
        fn = call.get("function") or {}
        if "id" in call:  # a new call: its first (or only) delta names it
            self._begin(
                out, {"type": "tool_use", "id": call["id"], "name": fn["name"], "input": {}}
            )
            self._calls.append([])
        arguments = fn.get("arguments") or ""
        if arguments and self._open == "tool_use":
            self._calls[-1].append(arguments)
            self._delta(out, {"type": "input_json_delta", "partial_json": arguments})

    def _calls_complete(self) -> bool:
        if not self._calls:
            return False
        for pieces in self._calls:
            try:
                if not isinstance(json.loads("".join(pieces)), dict):
                    return False
            except ValueError:
                return False
        return True

    def feed(self, msg: router_pb2.GenerateResponse) -> list[Event]:
        out: list[Event] = []
        for chunk in self._out.feed(msg):
            choices = chunk.get("choices") or ()
            if not choices:
                continue
            delta = choices[0].get("delta") or {}
            if delta.get("content"):
                self._text(out, delta["content"])
            for call in delta.get("tool_calls") or ():
                self._call(out, call)
        if self._out.finished:
            out += self._end()
        return out

    def _end(self) -> list[Event]:
        if self._out.finish_reason == "abort":
            raise aborted()
        out: list[Event] = []
        self._close(out)
        usage = self._out.usage
        assert usage is not None
        reason, sequence = stop_reason(
            self._out.finish_reason,
            self._out.stop_reason,
            self._calls_complete(),
            self.request.stop_sequences,
            self.request.max_tokens - usage.completion_tokens,
        )
        delta = {
            "type": "message_delta",
            "delta": {"stop_reason": reason, "stop_sequence": sequence},
            "usage": anthropic_usage(usage, self.block_size),
            "kvmesh": rendering.kvmesh_json(self.request.id, usage),
        }
        out.append(("message_delta", delta))
        out.append(("message_stop", {"type": "message_stop"}))
        return out


def sse_event(event: str, data: bytes) -> bytes:
    """One server-sent event in Anthropic's framing: its type on the ``event:`` line."""
    return b"event: " + event.encode() + b"\ndata: " + data + b"\n\n"
