"""The router's answer stream as a Responses API answer: the event sequence (streaming) or one
Response object (not). Pure.

Both feed the router's messages to the chat front door's ``rendering.ResponseTranslator``
(which reads tool calls out of the text: hermes blocks, or the JSON a forced tool choice
constrained it to) and keep the output's token ids (the next turn extends them). Events, each
with its ``sequence_number``: ``response.created``, ``response.in_progress``; per output item
``response.output_item.added``, then for a message ``response.content_part.added``,
``response.output_text.delta``..., ``response.output_text.done``,
``response.content_part.done``, for a function call ``response.function_call_arguments.delta``
..., ``response.function_call_arguments.done``; ``response.output_item.done``; at the end
``response.completed`` (or ``response.incomplete``: max_output_tokens cut it) with the whole
Response, usage included."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvmesh.v1 import router_pb2

from . import rendering
from .responses import (
    ResponsesRequest,
    call_item,
    kvmesh_json,
    message_item,
    new_item_id,
    output_items,
    response_json,
    status_of,
    usage_json,
)

Event = tuple[str, dict[str, Any]]  # (event type, data)


@dataclass(slots=True)
class _Answer:
    """What both shapes keep: the translator, the output's token ids, the final Response."""

    request: ResponsesRequest
    created_at: int
    block_size: int = 0
    extended: bool = False  # the prompt extends the previous turn's tokens
    output_ids: list[int] = field(default_factory=list)
    final: dict[str, Any] | None = None  # the Response once finished
    _out: rendering.ResponseTranslator = field(init=False)

    def __post_init__(self) -> None:
        self._out = rendering.ResponseTranslator(self.request.chat, self.created_at)

    @property
    def finished(self) -> bool:
        return self._out.finished

    @property
    def usage(self) -> Any:
        return self._out.usage

    def _finish(self, output: list[dict[str, Any]]) -> dict[str, Any]:
        status = status_of(self._out.finish_reason)  # raises for an aborted answer
        usage = self._out.usage
        assert usage is not None
        self.final = response_json(
            self.request,
            self.created_at,
            status,
            output,
            usage_json(usage, self.block_size),
            kvmesh_json(self.request, usage, self.extended),
        )
        return self.final


@dataclass(slots=True)
class ResponseCollector(_Answer):
    """Non-streaming: ``feed`` the router's messages until ``finished``, then ``response()``."""

    def feed(self, msg: router_pb2.GenerateResponse) -> None:
        self.output_ids.extend(msg.token_ids)
        self._out.feed(msg)

    def response(self) -> dict[str, Any]:
        if self._out.finish_reason == "abort":
            status_of("abort")
        return self._finish(output_items(self._out.response(), self.request.input.namespaces))


@dataclass(slots=True)
class ResponseEvents(_Answer):
    """Streaming: ``start()`` gives the opening events, ``feed`` those each router message
    becomes (the closing ones once ``finished``). An aborted answer raises from ``feed`` (the
    server sends it as an ``error`` event)."""

    _seq: int = 0
    items: list[dict[str, Any]] = field(default_factory=list)
    _open: bool = False  # the last item is still being written

    def _event(self, kind: str, **data: Any) -> Event:
        body = {"type": kind, "sequence_number": self._seq, **data}
        self._seq += 1
        return kind, body

    def start(self) -> list[Event]:
        shell = response_json(self.request, self.created_at, "in_progress", [])
        return [
            self._event("response.created", response=shell),
            self._event("response.in_progress", response=shell),
        ]

    def _close(self, out: list[Event]) -> None:
        if not self._open:
            return
        self._open = False
        index = len(self.items) - 1
        item = self.items[index]
        item["status"] = "completed"
        if item["type"] == "message":
            part = item["content"][0]
            ids = {"item_id": item["id"], "output_index": index, "content_index": 0}
            out.append(
                self._event("response.output_text.done", **ids, text=part["text"], logprobs=[])
            )
            out.append(self._event("response.content_part.done", **ids, part=dict(part)))
        else:
            out.append(
                self._event(
                    "response.function_call_arguments.done",
                    item_id=item["id"],
                    output_index=index,
                    arguments=item["arguments"],
                )
            )
        out.append(self._event("response.output_item.done", output_index=index, item=_copy(item)))

    def _begin(self, out: list[Event], item: dict[str, Any]) -> None:
        self._close(out)
        self.items.append(item)
        self._open = True
        index = len(self.items) - 1
        added = _copy(item)
        if item["type"] == "message":
            added["content"] = []  # its part comes with response.content_part.added
        out.append(self._event("response.output_item.added", output_index=index, item=added))
        if item["type"] == "message":
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            out.append(
                self._event(
                    "response.content_part.added",
                    item_id=item["id"],
                    output_index=index,
                    content_index=0,
                    part=part,
                )
            )

    def _text(self, out: list[Event], text: str) -> None:
        if not (self._open and self.items[-1]["type"] == "message"):
            item = message_item("", new_item_id("msg"), "in_progress")
            self._begin(out, item)
        item = self.items[-1]
        item["content"][0]["text"] += text
        out.append(
            self._event(
                "response.output_text.delta",
                item_id=item["id"],
                output_index=len(self.items) - 1,
                content_index=0,
                delta=text,
                logprobs=[],
            )
        )

    def _call(self, out: list[Event], call: dict[str, Any]) -> None:
        fn = call.get("function") or {}
        if "id" in call:  # a new call: its first (or only) delta names it
            item = call_item(
                call["id"],
                fn["name"],
                "",
                new_item_id("fc"),
                "in_progress",
                self.request.input.namespaces,
            )
            self._begin(out, item)
        arguments = fn.get("arguments") or ""
        if arguments and self._open and self.items[-1]["type"] == "function_call":
            item = self.items[-1]
            item["arguments"] += arguments
            out.append(
                self._event(
                    "response.function_call_arguments.delta",
                    item_id=item["id"],
                    output_index=len(self.items) - 1,
                    delta=arguments,
                )
            )

    def feed(self, msg: router_pb2.GenerateResponse) -> list[Event]:
        self.output_ids.extend(msg.token_ids)
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
            status_of(self._out.finish_reason)  # an aborted answer raises before closing
            self._close(out)
            final = self._finish([_copy(item) for item in self.items])
            kind = (
                "response.incomplete" if final["status"] == "incomplete" else "response.completed"
            )
            out.append(self._event(kind, response=final))
        return out

    def error(self, body: dict[str, Any]) -> Event:
        """The ``error`` event of a failure after the headers (OpenAI's error fields)."""
        err = body.get("error") or {}
        return self._event(
            "error", code=err.get("code"), message=err.get("message", ""), param=err.get("param")
        )


def _copy(item: dict[str, Any]) -> dict[str, Any]:
    out = dict(item)
    if "content" in out:
        out["content"] = [dict(p) for p in out["content"]]
    return out
