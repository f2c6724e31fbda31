"""OpenAI request bodies -> kvmesh.v1 requests. Pure: no sockets, no event loop, no clock, so
every rule is a unit-test row.

``parse_chat`` / ``parse_completion`` turn a decoded JSON body plus the kvmesh request headers
(``extensions``) into a ``router_pb2.GenerateRequest``; anything we cannot honour is a
``BadRequest`` naming the field, never silently dropped (the shared fields are read in
``params``, the tool fields in ``tools``). ``router_error`` names the parameter a router error is
about. The answer side is ``rendering``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from enum import StrEnum
from typing import Any

from kvmesh.errors import InvalidArgument, KvmeshError
from kvmesh.v1 import common_pb2, router_pb2

from ..core.forced_tools import ForcedChoice
from .errors import BadRequest
from .extensions import Extensions
from .logprobs import NO_LOGPROBS, LogprobOptions
from .logprobs import parse_chat as parse_chat_logprobs
from .logprobs import parse_completion as parse_completion_logprobs
from .params import (
    choices_per_prompt,
    flag,
    max_tokens_param,
    sampling_params,
    structured_param,
    typed,
)
from .tools import assistant_tool_calls, tool_spec

_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}

MAX_CHOICES = 1024  # choices per request (prompts x n): each is a router request of its own


class Kind(StrEnum):
    CHAT = "chat.completion"
    COMPLETION = "text_completion"


@dataclass(frozen=True, slots=True)
class ParsedRequest:
    kind: Kind
    id: str  # the OpenAI id ("chatcmpl-..."), also the kvmesh request_id (Router.Abort takes it)
    model: str
    stream: bool
    include_usage: bool
    generate: router_pb2.GenerateRequest
    # The request gave tools and tool_choice is not "none": the answer is read for tool calls
    # (hermes blocks; with ``forced``, the JSON the router constrained it to).
    parse_tool_calls: bool = False
    max_tokens_param: str = "max_tokens"  # or max_completion_tokens, whichever bounds it
    # tool_choice "required" or a named function: the answer is the calls, as JSON.
    forced: ForcedChoice | None = None
    # The field that set sampling.structured_output: response_format, or vLLM's structured_outputs.
    structured_param: str = "response_format"
    logprobs: LogprobOptions = NO_LOGPROBS  # and echo
    n: int = 1  # choices per prompt
    # A completions request with several prompts: one request per prompt (``generate`` is the
    # first); empty for one prompt. ``choices.plan`` turns them and ``n`` into router requests.
    batch: tuple[router_pb2.GenerateRequest, ...] = ()


def _reject_unsupported(body: Mapping[str, Any], kind: Kind) -> None:
    if kind is Kind.COMPLETION and body.get("suffix"):
        raise BadRequest("suffix is not supported; omit it", "suffix")


def _common(
    body: object, kind: Kind, default_max_tokens: int
) -> tuple[dict[str, Any], str, bool, bool, common_pb2.SamplingParams, int]:
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    model = typed(body, "model", str, "a string") or ""
    stream = flag(body, "stream")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise BadRequest("stream_options must be an object", "stream_options")
    include_usage = bool(options and options.get("include_usage"))
    if include_usage and not stream:
        raise BadRequest("stream_options is only allowed with stream: true", "stream_options")
    typed(body, "user", str, "a string")  # accepted; logs carry the tenant instead
    _reject_unsupported(body, kind)
    n = choices_per_prompt(body)
    return body, model, stream, include_usage, sampling_params(body, default_max_tokens), n


def cache_salt_of(body: Mapping[str, Any], ext: Extensions) -> str:
    """The request's cache salt: its tenant's on a router with API keys, whatever the body
    says (a client never picks the blocks it may share); on an open router vLLM's
    ``cache_salt`` body field (null or absent: none)."""
    if ext.cache_salt is not None:
        return ext.cache_salt
    sent = typed(body, "cache_salt", str, "a string")
    if sent == "":
        raise BadRequest(
            "cache_salt is empty; send a non-empty string or leave it out", "cache_salt"
        )
    return sent or ""


def _request(
    ext: Extensions,
    request_id: str,
    model: str,
    sampling: common_pb2.SamplingParams,
    body: Mapping[str, Any],
) -> router_pb2.GenerateRequest:
    return router_pb2.GenerateRequest(
        request_id=request_id,
        model=model,
        sampling=sampling,
        session_id=ext.session_id,
        tenant=ext.tenant,
        priority=ext.priority,
        cache_salt=cache_salt_of(body, ext),
        end_session=ext.session_end,
        retention_ttl_s=ext.retention_ttl_s,
    )


# ---- chat ------------------------------------------------------------------------------------
def _content_text(content: object, param: str) -> str:
    """A message's content: a string, null, or a list of parts of which only text is served."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        out = []
        for j, part in enumerate(content):
            if isinstance(part, str):
                out.append(part)
                continue
            if not isinstance(part, dict) or part.get("type") not in ("text", "input_text"):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise BadRequest(
                    f"{param}[{j}] is a {kind!r} part; only text parts are supported",
                    f"{param}[{j}]",
                )
            text = part.get("text")
            if not isinstance(text, str):
                raise BadRequest(f"{param}[{j}].text must be a string", f"{param}[{j}].text")
            out.append(text)
        return "".join(out)
    raise BadRequest(f"{param} must be a string, a list of text parts or null", param)


def chat_messages(messages: object) -> list[router_pb2.ChatMessage]:
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages must be a non-empty list", "messages")
    out = []
    for i, m in enumerate(messages):
        param = f"messages[{i}]"
        if not isinstance(m, dict):
            raise BadRequest(f"{param} must be an object", param)
        role = m.get("role")
        text = _content_text(m.get("content"), f"{param}.content")
        name = m.get("name") or ""
        if not isinstance(name, str):
            raise BadRequest(f"{param}.name must be a string", f"{param}.name")
        tool_call_id = ""
        if role in _ROLES:
            role = _ROLES[role]
        elif role == "tool":
            tool_call_id = m.get("tool_call_id") or ""
            if not isinstance(tool_call_id, str) or not tool_call_id:
                raise BadRequest(
                    f"{param} has role 'tool' but no tool_call_id; set the id of the tool call "
                    "it answers",
                    f"{param}.tool_call_id",
                )
        elif role == "function":  # the legacy function-calling API: the name is the call
            if not name:
                raise BadRequest(f"{param} has role 'function' but no name", f"{param}.name")
            role, tool_call_id = "tool", name
        else:
            raise BadRequest(
                f"{param}.role is {role!r}; use system, developer, user, assistant or tool",
                f"{param}.role",
            )
        msg = router_pb2.ChatMessage(role=role, content=text, name=name, tool_call_id=tool_call_id)
        if role == "assistant":
            msg.tool_calls.extend(assistant_tool_calls(m, param))
        out.append(msg)
    return out


def parse_chat(
    body: object, ext: Extensions, request_id: str, default_max_tokens: int
) -> ParsedRequest:
    data, model, stream, include_usage, sampling, n = _common(body, Kind.CHAT, default_max_tokens)
    req = _request(ext, request_id, model, sampling, data)
    req.chat.messages.extend(chat_messages(data.get("messages")))
    tools = tool_spec(data)
    req.chat.tools.extend(tools.tools)
    if tools.choice is not None:
        req.chat.tool_choice.CopyFrom(tools.choice)
    # A structured output makes the answer JSON content (no hermes blocks in it), unless a forced
    # tool choice makes it the calls (the router then replaces the constraint with theirs).
    constrained = sampling.HasField("structured_output")
    return ParsedRequest(
        Kind.CHAT,
        request_id,
        model,
        stream,
        include_usage,
        req,
        tools.parse_calls and (tools.forced is not None or not constrained),
        max_tokens_param(data),
        forced=tools.forced,
        structured_param=structured_param(data),
        logprobs=parse_chat_logprobs(data, stream, req.sampling),
        n=n,
    )


# ---- completions -----------------------------------------------------------------------------
def _is_ids(x: object) -> bool:
    return (
        isinstance(x, list)
        and bool(x)
        and all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 2**32 for t in x)
    )


def parse_completion(
    body: object, ext: Extensions, request_id: str, default_max_tokens: int
) -> ParsedRequest:
    data, model, stream, include_usage, sampling, n = _common(
        body, Kind.COMPLETION, default_max_tokens
    )
    prompt = data.get("prompt")
    # A batch: a list of strings and/or token id lists (a list of ints is one prompt).
    batch: list[Any] = [prompt]
    if isinstance(prompt, list) and not all(isinstance(t, int) for t in prompt):
        batch = prompt
    if len(batch) * n > MAX_CHOICES:
        raise BadRequest(
            f"{len(batch)} prompts x n {n} = {len(batch) * n} choices; send at most "
            f"{MAX_CHOICES} per request",
            "prompt" if len(batch) > 1 else "n",
        )
    if len(batch) > 1 and data.get("echo") is True:
        raise BadRequest(
            "echo with a list of prompts is not supported; send one prompt per request", "echo"
        )
    first = batch[0]
    options = parse_completion_logprobs(
        data, stream, sampling, first if isinstance(first, str) else None
    )
    reqs = []
    for i, one in enumerate(batch):
        param = f"prompt[{i}]" if len(batch) > 1 else "prompt"
        req = _request(ext, request_id, model, sampling, data)
        if isinstance(one, str):
            if not one:
                raise BadRequest(f"{param} is empty; send a non-empty prompt", param)
            req.text = one
        elif _is_ids(one):
            req.token_ids.ids.extend(one)
        else:
            raise BadRequest(
                "prompt must be a string, a list of token ids, or a list of those", param
            )
        reqs.append(req)
    return ParsedRequest(
        Kind.COMPLETION,
        request_id,
        model,
        stream,
        include_usage,
        reqs[0],
        max_tokens_param=max_tokens_param(data),
        structured_param=structured_param(data),
        logprobs=options,
        n=n,
        batch=tuple(reqs) if len(reqs) > 1 else (),
    )


# ---- what the router says back ---------------------------------------------------------------
def with_model(request: ParsedRequest, name: str) -> ParsedRequest:
    """``request`` (sent without a model) for the model ``name``: the router serves that one and
    the answer names it, as vLLM's does. An empty ``name`` changes nothing."""
    if not name:
        return request
    request.generate.model = name
    for one in request.batch:
        one.model = name
    return replace(request, model=name)


# kvmesh.v1 request fields (``InvalidArgument.field``) -> the OpenAI parameter.
_PARAMS = {
    "model": "model",
    "sampling.temperature": "temperature",
    "sampling.top_p": "top_p",
    "sampling.top_k": "top_k",
    "sampling.seed": "seed",
    "sampling.stop": "stop",
    "sampling.stop_token_ids": "stop_token_ids",
    "chat.tools": "tools",
    "chat.tool_choice": "tool_choice",
    "sampling.presence_penalty": "presence_penalty",
    "sampling.frequency_penalty": "frequency_penalty",
    "sampling.repetition_penalty": "repetition_penalty",
    "sampling.logit_bias": "logit_bias",
    "sampling.min_tokens": "min_tokens",
}


def param_of(path: str, request: ParsedRequest) -> str | None:
    """The OpenAI parameter of ``request`` that the kvmesh.v1 field ``path`` stands for, or None."""
    if path in _PARAMS:
        return _PARAMS[path]
    if path == "sampling.max_tokens":
        return request.max_tokens_param
    if path == "sampling.structured_output":
        return request.structured_param
    if path == "sampling.logprobs":
        return "top_logprobs" if request.kind is Kind.CHAT else "logprobs"
    if path == "sampling.prompt_logprobs":
        return request.logprobs.prompt_param
    if path.startswith("chat.messages"):  # chat.messages[2].role -> messages[2].role
        return path.removeprefix("chat.")
    if path in ("input", "text", "token_ids", "chat"):  # the prompt
        return "messages" if request.kind is Kind.CHAT else "prompt"
    return None


def router_error(exc: KvmeshError, request: ParsedRequest) -> KvmeshError:
    """A router error about ``request`` as the OpenAI error: an INVALID_ARGUMENT naming a field
    becomes a ``BadRequest`` naming the parameter (the error body's ``param``)."""
    path = exc.field if isinstance(exc, InvalidArgument) else None
    param = param_of(path, request) if path else None
    return BadRequest(str(exc), param) if param is not None else exc
