"""Anthropic Messages JSON <-> the OpenAI front door's request and answer. Pure: no sockets, no
event loop, no clock.

A Messages request is rewritten as the OpenAI chat request it means (``system`` as the first
message, ``tool_use`` blocks as an assistant's ``tool_calls``, each ``tool_result`` block as a
``tool`` message, ``tools`` as functions, ``tool_choice`` as OpenAI's) and handed to
``parsing.parse_chat``: the messages, tools and forced tool choices then travel, render through
the chat template and are checked exactly as on the OpenAI path. Only what the OpenAI path has no
word for is set here (``stop_sequences``, beyond OpenAI's 4, and the session of
``metadata.user_id``). ``cache_control`` markers are accepted anywhere; kvmesh caches every full
block anyway, and a marked request without a session of its own gets one named after its
conversation's start, so that its prefix is retained between turns like any session's.

The answer side: ``message_json`` turns the OpenAI answer the ``rendering.ResponseTranslator``
built into an Anthropic message (``anthropic_stream`` does the same for the event stream), and
``usage_json`` splits the prompt tokens the Anthropic way (docs/anthropic.md#usage)."""

from __future__ import annotations

import hashlib
import json
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from kvmesh import errors
from kvmesh.v1 import common_pb2

from ..core.auth import Identity
from . import extensions, parsing, rendering
from .errors import BadRequest, http_status_for

DEFAULT_COUNT_MAX_TOKENS = 1  # count_tokens has no max_tokens; the prompt is all that counts
# Claude Code's first system block: a per-request billing line. It is no instruction to the
# model, and kept it would make every prompt differ from its first tokens (no cache, ever).
BILLING_HEADER = "x-anthropic-billing-header"
# Tool types Anthropic runs on its side (web search, code execution, ...) or that need a
# client-defined schema kvmesh does not know (bash, text editor, computer use).
CUSTOM_TOOL_TYPES = (None, "custom")
MESSAGE_ID_PREFIX = "msg_"

_CHOICE_HINT = (
    "use {'type': 'auto'}, {'type': 'any'}, {'type': 'none'} or {'type': 'tool', 'name': ...}"
)


@dataclass(frozen=True, slots=True)
class MessagesRequest:
    """A parsed Messages request: the OpenAI-path request it became, and what only the
    Anthropic answer needs."""

    chat: parsing.ParsedRequest  # its id (msg_...) is the kvmesh request_id
    stop_sequences: tuple[str, ...] = ()
    max_tokens: int = 0  # as sent (the router lowers it to the context's room)

    @property
    def id(self) -> str:
        return self.chat.id

    @property
    def model(self) -> str:
        return self.chat.model

    @property
    def stream(self) -> bool:
        return self.chat.stream


def new_message_id() -> str:
    return MESSAGE_ID_PREFIX + uuid.uuid4().hex


def new_tool_use_id() -> str:
    """An Anthropic-style tool use id (``tool_result.tool_use_id`` sends it back)."""
    return "toolu_" + uuid.uuid4().hex[:24]


# ---- headers ---------------------------------------------------------------------------------
def extensions_from_headers(
    headers: Mapping[str, str], identity: Identity | None = None
) -> extensions.Extensions:
    """``extensions.extensions_from_headers``: Anthropic's ``x-api-key`` is one of the headers
    it reads the key from. ``anthropic-version`` and ``anthropic-beta`` are accepted and
    ignored."""
    return extensions.extensions_from_headers(headers, identity)


# ---- typed readers ---------------------------------------------------------------------------
def _object(value: object, param: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise BadRequest(f"{param}: must be an object", param)
    return value


def _string(value: object, param: str) -> str:
    if not isinstance(value, str):
        raise BadRequest(f"{param}: must be a string", param)
    return value


def _text_blocks(value: object, param: str) -> list[dict[str, str]]:
    """A string, or a list of text blocks: as OpenAI text parts (cache_control dropped)."""
    if isinstance(value, str):
        return [{"type": "text", "text": value}]
    if not isinstance(value, list):
        raise BadRequest(f"{param}: must be a string or a list of text blocks", param)
    parts = []
    for j, block in enumerate(value):
        p = f"{param}.{j}"
        block = _object(block, p)
        if block.get("type") != "text":
            raise BadRequest(
                f"{p}: a {block.get('type')!r} block; only text blocks are supported here", p
            )
        parts.append({"type": "text", "text": _string(block.get("text"), f"{p}.text")})
    return parts


# ---- messages --------------------------------------------------------------------------------
def _system(value: object) -> list[dict[str, Any]]:
    if value is None:
        return []
    parts = [p for p in _text_blocks(value, "system") if not p["text"].startswith(BILLING_HEADER)]
    return [{"role": "system", "content": parts}] if parts else []


def _tool_result(block: dict[str, Any], param: str) -> dict[str, Any]:
    call_id = _string(block.get("tool_use_id"), f"{param}.tool_use_id")
    if not call_id:
        raise BadRequest(f"{param}.tool_use_id: must name the tool_use it answers", param)
    content = block.get("content")
    parts = [] if content is None else _text_blocks(content, f"{param}.content")
    text = "".join(p["text"] for p in parts)
    is_error = block.get("is_error")
    if is_error is not None and not isinstance(is_error, bool):
        raise BadRequest(f"{param}.is_error: must be true or false", f"{param}.is_error")
    if is_error:  # the template has no word for it; the model reads it in the result
        text = "Error: " + text
    return {"role": "tool", "tool_call_id": call_id, "content": text}


def _tool_use(block: dict[str, Any], param: str) -> dict[str, Any]:
    call_id = _string(block.get("id"), f"{param}.id")
    name = _string(block.get("name"), f"{param}.name")
    arguments = block.get("input", {})
    if not isinstance(arguments, dict):
        raise BadRequest(f"{param}.input: must be an object", f"{param}.input")
    return {
        "id": call_id,
        "type": "function",
        "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)},
    }


def _user(content: list[Any], param: str) -> list[dict[str, Any]]:
    """A user turn: its text blocks as user messages, each tool_result as a tool message, in
    the order they come (Anthropic puts the results first)."""
    out: list[dict[str, Any]] = []
    text: list[dict[str, str]] = []
    for j, raw in enumerate(content):
        p = f"{param}.content.{j}"
        block = _object(raw, p)
        kind = block.get("type")
        if kind == "text":
            text.append({"type": "text", "text": _string(block.get("text"), f"{p}.text")})
        elif kind == "tool_result":
            if text:
                out.append({"role": "user", "content": text})
                text = []
            out.append(_tool_result(block, p))
        else:
            raise BadRequest(
                f"{p}: {kind!r} blocks are not supported in user turns; send text and "
                "tool_result blocks",
                p,
            )
    if text or not out:
        out.append({"role": "user", "content": text})
    return out


def _assistant(content: list[Any], param: str) -> dict[str, Any]:
    text: list[dict[str, str]] = []
    calls = []
    for j, raw in enumerate(content):
        p = f"{param}.content.{j}"
        block = _object(raw, p)
        kind = block.get("type")
        if kind == "text":
            text.append({"type": "text", "text": _string(block.get("text"), f"{p}.text")})
        elif kind == "tool_use":
            calls.append(_tool_use(block, p))
        elif kind in ("thinking", "redacted_thinking"):
            continue  # a client echoing a past turn; kvmesh's models write no thinking blocks
        else:
            raise BadRequest(
                f"{p}: {kind!r} blocks are not supported in assistant turns; send text and "
                "tool_use blocks",
                p,
            )
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if calls:
        message["tool_calls"] = calls
    return message


def chat_messages(system: object, messages: object) -> list[dict[str, Any]]:
    """``system`` and ``messages`` as OpenAI chat messages."""
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages: must be a non-empty list", "messages")
    out = _system(system)
    for i, raw in enumerate(messages):
        param = f"messages.{i}"
        m = _object(raw, param)
        role = m.get("role")
        content = m.get("content")
        if isinstance(content, str):
            content = [{"type": "text", "text": content}]
        elif not isinstance(content, list):
            raise BadRequest(f"{param}.content: must be a string or a list of blocks", param)
        if role == "user":
            out += _user(content, param)
        elif role == "assistant":
            if i == len(messages) - 1:
                raise BadRequest(
                    f"{param}: a last assistant message (a prefill to continue) is not "
                    "supported; end with a user message",
                    param,
                )
            out.append(_assistant(content, param))
        elif role == "system":  # a mid-conversation system turn (Claude Code sends them)
            out.append({"role": "system", "content": _text_blocks(content, f"{param}.content")})
        else:
            raise BadRequest(
                f"{param}.role: is {role!r}; use 'user', 'assistant' or 'system'", param
            )
    return out


# ---- tools -----------------------------------------------------------------------------------
def _tools(value: object) -> list[dict[str, Any]] | None:
    if value is None:
        return None
    if not isinstance(value, list):
        raise BadRequest("tools: must be a list of tool definitions", "tools")
    out = []
    for j, raw in enumerate(value):
        p = f"tools.{j}"
        tool = _object(raw, p)
        if tool.get("type") not in CUSTOM_TOOL_TYPES:
            raise BadRequest(
                f"{p}.type: {tool.get('type')!r} is a tool Anthropic runs or defines; only "
                "custom tools (name, description, input_schema) are supported",
                p,
            )
        fn: dict[str, Any] = {"name": tool.get("name")}
        if tool.get("description") is not None:
            fn["description"] = tool["description"]
        schema = tool.get("input_schema")
        if schema is not None:
            fn["parameters"] = _object(schema, f"{p}.input_schema")
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(value: object) -> str | dict[str, Any] | None:
    """Anthropic's tool_choice as OpenAI's: auto, any (required), none, or a named tool (its
    forced JSON schema). ``disable_parallel_tool_use`` is accepted, not enforced."""
    if value is None:
        return None
    choice = _object(value, "tool_choice")
    kind = choice.get("type")
    parallel = choice.get("disable_parallel_tool_use")
    if parallel is not None and not isinstance(parallel, bool):
        raise BadRequest("tool_choice.disable_parallel_tool_use: must be true or false")
    if kind in ("auto", "none"):
        return str(kind)
    if kind == "any":
        return "required"
    if kind == "tool":
        name = choice.get("name")
        if not isinstance(name, str) or not name:
            raise BadRequest(f"tool_choice.name: must name a tool; {_CHOICE_HINT}")
        return {"type": "function", "function": {"name": name}}
    raise BadRequest(f"tool_choice.type: is {kind!r}; {_CHOICE_HINT}", "tool_choice")


# ---- requests --------------------------------------------------------------------------------
def _stop_sequences(value: object) -> tuple[str, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
        raise BadRequest("stop_sequences: must be a list of strings", "stop_sequences")
    return tuple(value)


def _output_format(value: object) -> dict[str, Any] | None:
    """``output_config.format`` (``{"type": "json_schema", "schema": ...}``: structured output)
    as OpenAI's response_format; ``effort`` is accepted and ignored."""
    if value is None:
        return None
    fmt = _object(value, "output_config").get("format")
    if fmt is None:
        return None
    fmt = _object(fmt, "output_config.format")
    if fmt.get("type") != "json_schema":
        raise BadRequest(
            f"output_config.format.type: is {fmt.get('type')!r}; use 'json_schema'",
            "output_config.format",
        )
    schema = _object(fmt.get("schema"), "output_config.format.schema")
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": schema}}


CACHE_SESSION_PREFIX = "anthropic-cache-"


def _session(body: Mapping[str, Any], ext: extensions.Extensions) -> extensions.Extensions:
    """The session whose prefix kvmesh retains between turns (docs/agents.md#retention): the
    ``x-kvmesh-session-id`` header, else ``metadata.user_id`` (agent CLIs send one per
    conversation), else, when the request marks anything with ``cache_control`` (the client
    asks for its prefix to be kept), a session named after the conversation's start: the
    model, system prompt, tools and first message, which every later turn resends unchanged.
    A marker's ``ttl`` ("5m", "1h"; the longest of them) is how long the session is kept."""
    metadata = body.get("metadata")
    user_id = None
    if metadata is not None:
        user_id = _object(metadata, "metadata").get("user_id")
        if user_id is not None and not isinstance(user_id, str):
            raise BadRequest("metadata.user_id: must be a string", "metadata.user_id")
    markers = cache_markers(body)
    ttl_s = marker_ttl_s(markers)
    if ttl_s:
        ext = replace(ext, retention_ttl_s=ttl_s)
    if ext.session_id:
        return ext
    if user_id:
        return replace(ext, session_id=user_id)
    if markers:
        return replace(ext, session_id=_conversation_id(body))
    return ext


# Anthropic's cache lifetimes (cache_control.ttl), seconds.
CACHE_TTLS_S = {"5m": 300.0, "1h": 3600.0}


def cache_markers(value: Any) -> list[object]:
    """Every ``cache_control`` marker in ``value`` (system, tools, messages' content blocks,
    the top level)."""
    found: list[object] = []
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, Mapping):
            if "cache_control" in v:
                found.append(v["cache_control"])
            stack.extend(x for k, x in v.items() if k != "cache_control")
        elif isinstance(v, list):
            stack.extend(v)
    return found


def marker_ttl_s(markers: list[object]) -> float:
    """The longest ``ttl`` the markers name, in seconds; 0 when none names one. A marker that
    is not an object, or a ttl other than "5m" and "1h", is a 400."""
    ttl_s = 0.0
    for marker in markers:
        if marker is None:
            continue
        m = _object(marker, "cache_control")
        ttl = m.get("ttl")
        if ttl is None:
            continue
        if ttl not in CACHE_TTLS_S:
            raise BadRequest(
                f"cache_control.ttl: is {ttl!r}; use '5m' or '1h' (or leave it out)",
                "cache_control.ttl",
            )
        ttl_s = max(ttl_s, CACHE_TTLS_S[ttl])
    return ttl_s


def _conversation_id(body: Mapping[str, Any]) -> str:
    messages = body.get("messages")
    first = messages[0] if isinstance(messages, list) and messages else None
    start = [body.get("model"), body.get("system"), body.get("tools"), first]
    digest = hashlib.sha256(json.dumps(start, sort_keys=True, default=str).encode()).hexdigest()
    return CACHE_SESSION_PREFIX + digest[:32]


def _chat_body(body: Mapping[str, Any], max_tokens: int) -> dict[str, Any]:
    chat: dict[str, Any] = {
        "model": body.get("model"),
        "messages": chat_messages(body.get("system"), body.get("messages")),
        "max_tokens": max_tokens,
        "stream": body.get("stream"),
    }
    for name in ("temperature", "top_p", "top_k"):
        if body.get(name) is not None:
            chat[name] = body[name]
    tools = _tools(body.get("tools"))
    if tools is not None:
        chat["tools"] = tools
    choice = _tool_choice(body.get("tool_choice"))
    if choice is not None:
        chat["tool_choice"] = choice
    fmt = _output_format(body.get("output_config"))
    if fmt is not None:
        chat["response_format"] = fmt
    thinking = body.get("thinking")  # accepted, ignored: the models write no thinking blocks
    if thinking is not None:
        _object(thinking, "thinking")
    for name in ("mcp_servers", "container"):
        if body.get(name):
            raise BadRequest(f"{name}: is not supported; omit it", name)
    return chat


def parse_messages(body: object, ext: extensions.Extensions, request_id: str) -> MessagesRequest:
    """``POST /v1/messages``'s body (decoded JSON) -> the request. ``max_tokens`` is required,
    as Anthropic's API has it."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    max_tokens = body.get("max_tokens")
    if max_tokens is None:
        raise BadRequest("max_tokens: Field required", "max_tokens")
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int):
        raise BadRequest("max_tokens: must be an integer", "max_tokens")
    stops = _stop_sequences(body.get("stop_sequences"))
    chat = parsing.parse_chat(
        _chat_body(body, max_tokens), _session(body, ext), request_id, max_tokens
    )
    chat.generate.sampling.stop.extend(stops)  # the router checks them (at most 16)
    # max_tokens is an upper bound (Claude Code sends 32000 whatever the context): a prompt
    # that leaves less room lowers it, and the answer says model_context_window_exceeded.
    chat.generate.fit_max_tokens = True
    return MessagesRequest(chat, stops, max_tokens)


def parse_count_tokens(
    body: object, ext: extensions.Extensions, request_id: str
) -> parsing.ParsedRequest:
    """``POST /v1/messages/count_tokens``'s body: the prompt a Messages request with it would
    have (system, messages, tools; no max_tokens)."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    chat = _chat_body({**body, "stream": False}, DEFAULT_COUNT_MAX_TOKENS)
    return parsing.parse_chat(chat, ext, request_id, DEFAULT_COUNT_MAX_TOKENS)


# ---- answers ---------------------------------------------------------------------------------
def usage_json(usage: common_pb2.Usage, block_size: int) -> dict[str, Any]:
    """Anthropic's split of the prompt: ``cache_read_input_tokens`` came from a cache (the
    worker's or its node kvmanager's), ``cache_creation_input_tokens`` were computed and are
    now cached (the prompt's whole blocks of ``block_size`` tokens beyond the cached ones; the
    engine caches every whole block), ``input_tokens`` were computed and are not cached (the
    last, partial block). The three add up to the prompt, as Anthropic's do. ``block_size`` 0
    (unknown): every computed token counts as cache creation."""
    prompt, cached = usage.prompt_tokens, usage.cached_prompt_tokens
    computed = max(0, prompt - cached)
    whole = (prompt // block_size) * block_size if block_size > 0 else prompt
    created = min(computed, max(0, whole - cached))
    return {
        "input_tokens": computed - created,
        "output_tokens": usage.completion_tokens,
        "cache_creation_input_tokens": created,
        "cache_read_input_tokens": cached,
    }


def stop_reason(
    finish_reason: str | None,
    matched: str | None,
    calls_complete: bool,
    stop_sequences: tuple[str, ...],
    cut_short_of: int = 0,
) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of an answer: ``max_tokens`` when cut short, or
    ``model_context_window_exceeded`` when cut by the context before ``max_tokens``
    (``cut_short_of``: how many tokens short of it), ``tool_use`` when it holds whole tool
    calls, ``stop_sequence`` when one of ``stop_sequences`` ended it (``matched``: the router's
    stop reason), else ``end_turn``."""
    if finish_reason == "length":
        return ("model_context_window_exceeded" if cut_short_of > 0 else "max_tokens"), None
    if calls_complete:
        return "tool_use", None
    if matched is not None and matched in stop_sequences:
        return "stop_sequence", matched
    return "end_turn", None


def aborted() -> errors.Unavailable:
    """What an answer the engine aborted (a worker shutting down) becomes: overloaded, so the
    SDKs retry, rather than a cut answer passed off as a finished turn."""
    return errors.Unavailable("the worker aborted the request (it is shutting down); retry")


def _is_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False


def message_json(
    request: MessagesRequest,
    answer: Mapping[str, Any],
    matched: str | None,
    usage: common_pb2.Usage,
    block_size: int,
) -> dict[str, Any]:
    """The Messages answer for the OpenAI chat answer ``answer`` (``ResponseTranslator.
    response()``): its content as a text block, each tool call as a ``tool_use`` block. A call
    whose arguments are no JSON object (a forced call cut by max_tokens) stays text."""
    choice = answer["choices"][0]
    message = choice["message"]
    content: list[dict[str, Any]] = []
    if message.get("content"):
        content.append({"type": "text", "text": message["content"]})
    calls = 0
    for call in message.get("tool_calls") or ():
        fn = call["function"]
        if _is_object(fn["arguments"]):
            calls += 1
            content.append(
                {
                    "type": "tool_use",
                    "id": call["id"],
                    "name": fn["name"],
                    "input": json.loads(fn["arguments"]),
                }
            )
        else:
            content.append({"type": "text", "text": fn["arguments"]})
    reason, sequence = stop_reason(
        choice["finish_reason"],
        matched,
        calls > 0,
        request.stop_sequences,
        request.max_tokens - usage.completion_tokens,
    )
    return {
        "id": request.id,
        "type": "message",
        "role": "assistant",
        "model": request.model,
        "content": content,
        "stop_reason": reason,
        "stop_sequence": sequence,
        "usage": usage_json(usage, block_size),
        "kvmesh": rendering.kvmesh_json(request.id, usage),
    }


# ---- errors ----------------------------------------------------------------------------------
# Anthropic's error type for each HTTP status of the one table (``errors.HTTP_OF``).
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    504: "timeout_error",
    529: "overloaded_error",
}
OVERLOADED = 529  # Anthropic's status for "try again later"; its SDKs retry it


def error_body(exc: BaseException, request_id: str = "") -> tuple[int, dict[str, Any]]:
    """(HTTP status, Anthropic's error body). The status is the OpenAI front door's, except
    unavailable (no worker, draining) which is Anthropic's 529 ``overloaded_error``.
    Unexpected errors say only "internal error" and the request id."""
    status = http_status_for(exc).status
    if status == 503:
        status = OVERLOADED
    if status >= 500 and status not in (504, OVERLOADED):
        status = 500
        message = f"internal error (request_id={request_id}); see the router log"
    else:
        message = str(exc)
    body: dict[str, Any] = {
        "type": "error",
        "error": {"type": ERROR_TYPES.get(status, "api_error"), "message": message},
    }
    if request_id:
        body["request_id"] = request_id
    return status, body
