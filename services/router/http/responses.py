"""OpenAI Responses API JSON <-> the OpenAI chat front door's request and answer. Pure: no
sockets, no event loop, no clock (callers pass ``created_at``).

A Responses request becomes the chat request it means: ``instructions`` the first (system)
message, then the stored conversation of ``previous_response_id`` (``state.StoredResponse.
history``), then ``input`` (text, or items: messages, ``function_call`` as an assistant's
``tool_calls``, ``function_call_output`` as a ``tool`` message), ``tools`` (function tools) as
chat tools, ``tool_choice`` as chat's, ``max_output_tokens`` as ``max_tokens``, ``text.format``
as ``response_format``; and it is handed to ``parsing.parse_chat``, so it renders and is checked
exactly as on the chat path. The prompt's tokens then extend the previous turn's exactly when
its instructions and tools are the same (``continuation.py``; the HTTP edge asks the router).

The answer side: ``output_items`` turns the chat answer (``rendering.ResponseTranslator``) into
Responses output items, ``response_json`` the Response object; ``responses_stream`` the events."""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from kvmesh import errors
from kvmesh.v1 import common_pb2

from ..state import StoredResponse
from . import anthropic, extensions, parsing, rendering
from .errors import BadRequest, ResponseNotFound

RESPONSE_ID_PREFIX = "resp_"
_TEXT_PARTS = ("input_text", "output_text", "text")
# Fields accepted and not acted on (no reasoning models, nothing to include, nothing to truncate:
# a prompt past the context is a 400 either way).
_IGNORED = (
    "include",
    "reasoning",
    "truncation",
    "service_tier",
    "user",
    "safety_identifier",
    "stream_options",
    "prompt_cache_retention",
    "prompt_cache_options",
    "context_management",
    "max_tool_calls",
)
_UNSUPPORTED = {
    "background": "background responses are not supported; omit background",
    "conversation": "the Conversations API is not supported; chain turns with previous_response_id",
    "prompt": "prompt templates are not supported; send instructions and input",
    "top_logprobs": "logprobs are not supported on /v1/responses; use /v1/chat/completions",
}


def new_response_id() -> str:
    return RESPONSE_ID_PREFIX + uuid.uuid4().hex


def new_item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


@dataclass(frozen=True, slots=True)
class ResponsesInput:
    """A ``POST /v1/responses`` body, checked: this turn's part, before the stored
    conversation of ``previous_response_id`` (if any) is read."""

    body: dict[str, Any]
    messages: tuple[dict[str, Any], ...]  # ``input`` as chat messages
    instructions: str
    chat_tools: tuple[dict[str, Any], ...]  # ``tools`` as chat tools
    namespaces: Mapping[str, str]  # function name -> its namespace tool's name
    tool_choice: object  # chat's, or None
    previous_response_id: str | None
    store: bool
    stream: bool


@dataclass(frozen=True, slots=True)
class ResponsesRequest:
    """A turn, ready to serve: the chat request of the whole conversation, and what the answer
    and the stored record need."""

    chat: parsing.ParsedRequest  # its id (resp_...) is the kvmesh request_id
    input: ResponsesInput
    history: tuple[dict[str, Any], ...]  # chat messages after the instructions, this input last
    new_from: int  # chat messages before this turn's input (instructions + stored history)
    tools_key: str  # the tools the prompt renders, canonical ("" none)
    previous: StoredResponse | None
    session_id: str

    @property
    def id(self) -> str:
        return self.chat.id

    @property
    def model(self) -> str:
        return self.chat.model

    @property
    def stream(self) -> bool:
        return self.chat.stream

    @property
    def extends(self) -> bool:
        """Whether the prompt may extend the previous turn's tokens: same model, instructions
        and rendered tools (they are at the prompt's start)."""
        prev = self.previous
        return (
            prev is not None
            and prev.model == self.model
            and prev.instructions == self.input.instructions
            and prev.tools_key == self.tools_key
        )


# ---- typed readers ---------------------------------------------------------------------------
def _object(value: object, param: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise BadRequest(f"{param}: must be an object", param)
    return value


def _string(value: object, param: str) -> str:
    if not isinstance(value, str):
        raise BadRequest(f"{param}: must be a string", param)
    return value


def _text(content: object, param: str) -> str:
    """A message's content: a string or a list of text parts (input_text, output_text)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise BadRequest(f"{param}: must be a string or a list of input_text parts", param)
    out = []
    for j, raw in enumerate(content):
        p = f"{param}[{j}]"
        part = _object(raw, p)
        kind = part.get("type")
        if kind in _TEXT_PARTS:
            out.append(_string(part.get("text"), f"{p}.text"))
        elif kind == "refusal":
            out.append(_string(part.get("refusal"), f"{p}.refusal"))
        else:
            raise BadRequest(
                f"{p}: {kind!r} parts are not supported (the served models read text); send "
                "input_text parts",
                p,
            )
    return "".join(out)


# ---- input items -> chat messages ------------------------------------------------------------
def _message(item: dict[str, Any], param: str) -> dict[str, Any]:
    role = item.get("role")
    if role not in ("user", "assistant", "system", "developer"):
        raise BadRequest(
            f"{param}.role: is {role!r}; use user, assistant, system or developer",
            f"{param}.role",
        )
    return {"role": role, "content": _text(item.get("content"), f"{param}.content")}


def _function_call(item: dict[str, Any], param: str) -> dict[str, Any]:
    call_id = _string(item.get("call_id"), f"{param}.call_id")
    name = _string(item.get("name"), f"{param}.name")
    if not call_id or not name:
        raise BadRequest(f"{param}: a function_call needs its call_id and name", param)
    arguments = item.get("arguments", "{}")
    return {
        "id": call_id,
        "type": "function",
        "function": {"name": name, "arguments": _string(arguments, f"{param}.arguments")},
    }


def _call_output(item: dict[str, Any], param: str) -> dict[str, Any]:
    call_id = _string(item.get("call_id"), f"{param}.call_id")
    if not call_id:
        raise BadRequest(f"{param}.call_id: must name the function_call it answers", param)
    output = item.get("output")
    if output is None:
        raise BadRequest(f"{param}.output: Field required", f"{param}.output")
    return {"role": "tool", "tool_call_id": call_id, "content": _text(output, f"{param}.output")}


def input_messages(value: object) -> list[dict[str, Any]]:
    """``input`` (a string, or a list of items) as chat messages. Consecutive function calls
    (and the assistant message before them) are one assistant turn with ``tool_calls``;
    reasoning items are dropped (no reasoning models here)."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise BadRequest("input: must be a string or a non-empty list of items", "input")
    out: list[dict[str, Any]] = []
    for i, raw in enumerate(value):
        param = f"input[{i}]"
        item = _object(raw, param)
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            out.append(_message(item, param))
        elif kind == "function_call":
            call = _function_call(item, param)
            last = out[-1] if out else None
            if last is None or last["role"] != "assistant":
                last = {"role": "assistant", "content": ""}
                out.append(last)
            last.setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            out.append(_call_output(item, param))
        elif kind == "reasoning":
            continue
        elif kind == "item_reference":
            raise BadRequest(
                f"{param}: item_reference is not supported; send the item itself, or chain "
                "with previous_response_id",
                param,
            )
        else:
            raise BadRequest(
                f"{param}.type: is {kind!r}; use message, function_call or "
                "function_call_output (kvmesh runs no built-in tools)",
                f"{param}.type",
            )
    return out


# ---- tools -----------------------------------------------------------------------------------
def _function(tool: dict[str, Any]) -> dict[str, Any]:
    fn: dict[str, Any] = {"name": tool.get("name")}
    for key in ("description", "parameters", "strict"):
        if tool.get(key) is not None:
            fn[key] = tool[key]
    return {"type": "function", "function": fn}


def _tools(value: object) -> tuple[list[dict[str, Any]], dict[str, str]]:
    """``tools`` as chat tools, and the namespace of each function offered inside a
    ``namespace`` tool (its calls name it). Function tools are offered to the model, those of a
    namespace too (under their own names); tools OpenAI runs or that take free-form input
    (``web_search``, ``file_search``, ``mcp``, ``custom``, ...) are not offered: kvmesh runs
    none and the models here call functions only (Codex sends ``web_search`` by default)."""
    if value is None:
        return [], {}
    if not isinstance(value, list):
        raise BadRequest("tools: must be a list of tools", "tools")
    out: list[dict[str, Any]] = []
    namespaces: dict[str, str] = {}
    for j, raw in enumerate(value):
        p = f"tools[{j}]"
        tool = _object(raw, p)
        kind = tool.get("type")
        if kind == "function":
            out.append(_function(tool))
        elif kind == "namespace":
            namespace = _string(tool.get("name"), f"{p}.name")
            inner = tool.get("tools")
            if not isinstance(inner, list):
                raise BadRequest(f"{p}.tools: must be a list of function tools", f"{p}.tools")
            for k, fn in enumerate(inner):
                fn = _object(fn, f"{p}.tools[{k}]")
                if fn.get("type") == "function":
                    out.append(_function(fn))
                    namespaces[str(fn.get("name"))] = namespace
        elif not isinstance(kind, str) or not kind:
            raise BadRequest(f"{p}.type: must name the tool's type (function)", f"{p}.type")
    return out, namespaces


def _tool_choice(value: object) -> object:
    if value is None or value in ("auto", "none", "required"):
        return value
    if isinstance(value, dict) and value.get("type") == "function":
        name = value.get("name")
        if not isinstance(name, str) or not name:
            raise BadRequest("tool_choice.name: must name a function tool", "tool_choice")
        return {"type": "function", "function": {"name": name}}
    raise BadRequest(
        "tool_choice: use 'auto', 'none', 'required' or {'type': 'function', 'name': ...}",
        "tool_choice",
    )


def _response_format(text: object) -> dict[str, Any] | None:
    """``text.format`` as chat's ``response_format``; ``text.verbosity`` accepted, ignored."""
    if text is None:
        return None
    fmt = _object(text, "text").get("format")
    if fmt is None:
        return None
    fmt = _object(fmt, "text.format")
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        schema = {"name": fmt.get("name") or "output", "schema": fmt.get("schema")}
        if fmt.get("strict") is not None:
            schema["strict"] = fmt["strict"]
        return {"type": "json_schema", "json_schema": schema}
    raise BadRequest(
        f"text.format.type: is {kind!r}; use text, json_object or json_schema", "text.format"
    )


def _flag(body: Mapping[str, Any], name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise BadRequest(f"{name}: must be true or false", name)
    return value


def parse_input(body: object) -> ResponsesInput:
    """``POST /v1/responses``'s body (decoded JSON), checked."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    for name, why in _UNSUPPORTED.items():
        if body.get(name) not in (None, False):
            raise BadRequest(f"{name}: {why}", name)
    if "input" not in body:
        raise BadRequest("input: Field required; send text or a list of items", "input")
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise BadRequest(
            "instructions: must be a string (put message items in input instead)", "instructions"
        )
    previous = body.get("previous_response_id")
    if previous is not None and (not isinstance(previous, str) or not previous):
        raise BadRequest(
            "previous_response_id: must be the id of a stored response", "previous_response_id"
        )
    metadata = body.get("metadata")
    if metadata is not None:
        _object(metadata, "metadata")
    for name in ("parallel_tool_calls",):
        _flag(body, name, True)
    chat_tools, namespaces = _tools(body.get("tools"))
    return ResponsesInput(
        body=body,
        messages=tuple(input_messages(body["input"])),
        instructions=instructions or "",
        chat_tools=tuple(chat_tools),
        namespaces=namespaces,
        tool_choice=_tool_choice(body.get("tool_choice")),
        previous_response_id=previous,
        store=_flag(body, "store", True),
        stream=_flag(body, "stream", False),
    )


def previous_not_found(response_id: str) -> ResponseNotFound:
    return ResponseNotFound(
        f"Previous response with id {response_id!r} not found (never stored, store: false, "
        "deleted or expired); send the whole conversation in input instead",
        "previous_response_id",
        "previous_response_not_found",
    )


def _tools_key(turn: ResponsesInput) -> str:
    if not turn.chat_tools or turn.tool_choice == "none":
        return ""  # the template sees no tools (tool_choice none keeps them out, as on chat)
    return json.dumps(turn.chat_tools, sort_keys=True, separators=(",", ":"))


def build(
    turn: ResponsesInput,
    previous: StoredResponse | None,
    ext: extensions.Extensions,
    request_id: str,
    default_max_tokens: int,
) -> ResponsesRequest:
    """The turn's chat request: instructions, the stored conversation, the input. The session:
    the ``x-kvmesh-session-id`` header, else the chain's (its first turn's), else
    ``prompt_cache_key``, else this response's id (the chain's from here on)."""
    body = turn.body
    history = (*(previous.history if previous is not None else ()), *turn.messages)
    system = [{"role": "system", "content": turn.instructions}] if turn.instructions else []
    chat: dict[str, Any] = {
        "model": body.get("model"),
        "messages": [*system, *history],
        "stream": turn.stream,
    }
    max_tokens = body.get("max_output_tokens")
    if max_tokens is not None:
        chat["max_tokens"] = max_tokens
    for name in ("temperature", "top_p"):
        if body.get(name) is not None:
            chat[name] = body[name]
    if turn.chat_tools:
        chat["tools"] = list(turn.chat_tools)
    if turn.tool_choice is not None:
        chat["tool_choice"] = turn.tool_choice
    fmt = _response_format(body.get("text"))
    if fmt is not None:
        chat["response_format"] = fmt
    session = ext.session_id
    if not session:
        key = body.get("prompt_cache_key")
        if key is not None and not isinstance(key, str):
            raise BadRequest("prompt_cache_key: must be a string", "prompt_cache_key")
        session = previous.session_id if previous is not None else (key or request_id)
    try:
        parsed = parsing.parse_chat(
            chat, replace(ext, session_id=session), request_id, default_max_tokens
        )
    except BadRequest as exc:  # the chat path's names for what the Responses request calls
        raise _renamed(exc) from None
    parsed = replace(parsed, max_tokens_param="max_output_tokens")
    return ResponsesRequest(
        chat=parsed,
        input=turn,
        history=history,
        new_from=len(system) + len(history) - len(turn.messages),
        tools_key=_tools_key(turn),
        previous=previous,
        session_id=session,
    )


def output_room(max_model_len: int, prompt_tokens: int) -> int:
    """The tokens an answer may have when the request sets no ``max_output_tokens``: what the
    context leaves after the prompt (0: unknown, or no room: the router's default then, and its
    own error for a prompt too long)."""
    return max(0, max_model_len - prompt_tokens)


def _param(param: str) -> str:
    """A chat request's parameter as the Responses request names it."""
    if param.startswith("messages"):
        return "input"  # the conversation as a whole: instructions, stored turns, input
    if param in ("max_tokens", "max_completion_tokens"):
        return "max_output_tokens"
    if param.startswith("response_format"):
        return "text.format"
    return param.replace(".function.", ".")  # tools[0].function.name -> tools[0].name


def _renamed(exc: BadRequest) -> BadRequest:
    if exc.param is None:
        return exc
    param = _param(exc.param)
    message = str(exc).replace(exc.param, param, 1)
    if param == "max_output_tokens":
        message = message.replace("max_tokens", "max_output_tokens")
    return BadRequest(message, param)


def bad_request(exc: errors.KvmeshError, request: ResponsesRequest) -> errors.KvmeshError:
    """A router error about the chat request, naming the Responses parameter."""
    mapped = parsing.router_error(exc, request.chat)
    return _renamed(mapped) if isinstance(mapped, BadRequest) else mapped


# ---- answers ---------------------------------------------------------------------------------
def message_item(text: str, item_id: str, status: str = "completed") -> dict[str, Any]:
    return {
        "id": item_id,
        "type": "message",
        "status": status,
        "role": "assistant",
        "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}],
    }


def call_item(
    call_id: str,
    name: str,
    arguments: str,
    item_id: str,
    status: str = "completed",
    namespaces: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """A function_call item; ``namespaces``: the request's (a namespaced function's call names
    its namespace)."""
    item = {
        "id": item_id,
        "type": "function_call",
        "status": status,
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
    }
    namespace = (namespaces or {}).get(name)
    if namespace is not None:
        item["namespace"] = namespace
    return item


def output_items(
    answer: Mapping[str, Any], namespaces: Mapping[str, str] | None = None
) -> list[dict[str, Any]]:
    """The chat answer (``ResponseTranslator.response()``) as output items: its text as a
    message, each tool call as a function_call."""
    message = answer["choices"][0]["message"]
    items: list[dict[str, Any]] = []
    if message.get("content"):
        items.append(message_item(message["content"], new_item_id("msg")))
    for call in message.get("tool_calls") or ():
        fn = call["function"]
        items.append(
            call_item(
                call["id"], fn["name"], fn["arguments"], new_item_id("fc"), namespaces=namespaces
            )
        )
    return items


def assistant_message(items: list[dict[str, Any]]) -> dict[str, Any]:
    """The output items as the chat assistant message the next turn's conversation holds."""
    text = "".join(
        part["text"] for item in items if item["type"] == "message" for part in item["content"]
    )
    message: dict[str, Any] = {"role": "assistant", "content": text}
    calls = [
        {
            "id": item["call_id"],
            "type": "function",
            "function": {"name": item["name"], "arguments": item["arguments"]},
        }
        for item in items
        if item["type"] == "function_call"
    ]
    if calls:
        message["tool_calls"] = calls
    return message


def usage_json(usage: common_pb2.Usage, block_size: int) -> dict[str, Any]:
    """``input_tokens`` (the whole prompt), ``cached_tokens`` (read from a cache: the worker's
    or its node kvmanager's), ``cache_write_tokens`` (computed now and cached: the prompt's
    whole blocks beyond the cached ones, as Anthropic's cache creation)."""
    split = anthropic.usage_json(usage, block_size)
    return {
        "input_tokens": usage.prompt_tokens,
        "input_tokens_details": {
            "cached_tokens": usage.cached_prompt_tokens,
            "cache_write_tokens": split["cache_creation_input_tokens"],
        },
        "output_tokens": usage.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
    }


def _echo_tools(body: Mapping[str, Any]) -> list[Any]:
    tools = body.get("tools") or []
    return [
        {"parameters": None, "strict": None, **t} if t.get("type") == "function" else t
        for t in tools
    ]


def response_json(
    request: ResponsesRequest,
    created_at: int,
    status: str,
    output: list[dict[str, Any]],
    usage: dict[str, Any] | None = None,
    kvmesh: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The Response object: ``status`` in_progress (the stream's first events), completed, or
    incomplete (``max_output_tokens`` cut it)."""
    body = request.input.body
    text_format = (body.get("text") or {}).get("format") or {"type": "text"}
    out: dict[str, Any] = {
        "id": request.id,
        "object": "response",
        "created_at": created_at,
        "status": status,
        "error": None,
        "incomplete_details": ({"reason": "max_output_tokens"} if status == "incomplete" else None),
        "instructions": request.input.instructions or None,
        "max_output_tokens": body.get("max_output_tokens"),
        "model": request.model,
        "output": output,
        "parallel_tool_calls": body.get("parallel_tool_calls", True),
        "previous_response_id": request.input.previous_response_id,
        "reasoning": {"effort": None, "summary": None},
        "store": request.input.store,
        "temperature": body.get("temperature"),
        "text": {"format": text_format},
        "tool_choice": body.get("tool_choice", "auto"),
        "tools": _echo_tools(body),
        "top_p": body.get("top_p"),
        "truncation": body.get("truncation") or "disabled",
        "usage": usage,
        "user": body.get("user"),
        "metadata": body.get("metadata") or {},
    }
    if body.get("prompt_cache_key") is not None:
        out["prompt_cache_key"] = body["prompt_cache_key"]
    if kvmesh is not None:
        out["kvmesh"] = kvmesh
    return out


def kvmesh_json(
    request: ResponsesRequest, usage: common_pb2.Usage, extended: bool
) -> dict[str, Any]:
    """The chat path's ``kvmesh`` object, and how the prompt was made: ``extended`` (the
    previous turn's tokens, then the new ones) or ``rendered`` (the whole conversation)."""
    out = rendering.kvmesh_json(request.id, usage)
    out["session_id"] = request.session_id
    out["prompt"] = "extended" if extended else "rendered"
    return out


def status_of(finish_reason: str | None) -> str:
    if finish_reason == "abort":
        raise anthropic.aborted()
    return "incomplete" if finish_reason == "length" else "completed"


def record(
    request: ResponsesRequest,
    response: dict[str, Any],
    created_at: float,
    prompt_ids: list[int],
    output_ids: list[int],
) -> StoredResponse:
    """What is stored of an answered turn (``store``: true)."""
    return StoredResponse(
        id=request.id,
        tenant=request.chat.generate.tenant,
        session_id=request.session_id,
        created_at=created_at,
        model=request.model,
        response=response,
        history=(*request.history, assistant_message(response["output"])),
        instructions=request.input.instructions,
        tools_key=request.tools_key,
        prompt_ids=prompt_ids,
        output_ids=output_ids,
    )


def deleted_json(response_id: str) -> dict[str, Any]:
    return {"id": response_id, "object": "response", "deleted": True}


def not_found(response_id: str) -> ResponseNotFound:
    return ResponseNotFound(f"Response with id {response_id!r} not found.")


def visible(record: StoredResponse | None, tenant: str) -> StoredResponse | None:
    """``record`` when the caller's tenant may see it (its own); another tenant's is as if
    there were none."""
    return record if record is not None and record.tenant == tenant else None
