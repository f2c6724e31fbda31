"""OpenAI JSON <-> kvmesh.v1 messages. Pure: no sockets, no event loop, no clock (callers pass
``created``), so every rule is a unit-test row.

Requests: ``parse_chat`` / ``parse_completion`` turn a decoded JSON body plus the kvmesh request
headers into a ``router_pb2.GenerateRequest``; anything we cannot honour is a ``BadRequest``
naming the field, never silently dropped (the tool fields are read in ``tools``). Responses:
``ResponseTranslator`` turns the router's stream into OpenAI chunks (streaming) or one response
object (non-streaming), reading tool calls out of the text when the request gave tools
(``toolcalls``).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import Any

from kvmesh.errors import InvalidArgument, KvmeshError
from kvmesh.sampling import structured_output_pb
from kvmesh.v1 import common_pb2, router_pb2

from ..core.auth import Claims, Identity, tenant_of_key
from ..core.forced_tools import ForcedChoice, ForcedKind
from . import forcedcalls, toolcalls
from .errors import BadRequest
from .logprobs import NO_LOGPROBS, LogprobOptions, LogprobsOut, echo_prefix
from .logprobs import parse_chat as parse_chat_logprobs
from .logprobs import parse_completion as parse_completion_logprobs
from .structured import structured_output
from .tools import assistant_tool_calls, tool_spec

SESSION_HEADER = "x-kvmesh-session-id"
TENANT_HEADER = "x-kvmesh-tenant"
PRIORITY_HEADER = "x-kvmesh-priority"

_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}

MAX_STOP = 4  # stop sequences per request, as the OpenAI API allows
MAX_N = 128  # choices per prompt (n), as the OpenAI API allows
MAX_CHOICES = 1024  # choices per request (prompts x n): each is a router request of its own

FINISH_REASONS = {
    common_pb2.FINISH_REASON_STOP: "stop",
    common_pb2.FINISH_REASON_LENGTH: "length",
    common_pb2.FINISH_REASON_ABORT: "abort",
}


class Kind(StrEnum):
    CHAT = "chat.completion"
    COMPLETION = "text_completion"


@dataclass(frozen=True, slots=True)
class Extensions:
    """What the kvmesh request headers (and the API key) say about a request."""

    session_id: str = ""
    tenant: str = ""
    priority: int = 0


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


# ---- headers ---------------------------------------------------------------------------------
def api_key_of(headers: Mapping[str, str]) -> str:
    """``Authorization: Bearer <key>``, else ``x-api-key`` (Anthropic-style clients), else
    ``api-key`` (Azure-style clients)."""
    auth = headers.get("authorization", "")
    scheme, _, key = auth.partition(" ")
    if scheme.lower() == "bearer" and key.strip():
        return key.strip()
    return (headers.get("x-api-key", "") or headers.get("api-key", "")).strip()


def priority_of(headers: Mapping[str, str]) -> int:
    """The ``x-kvmesh-priority`` header (0 when absent); ``BadRequest`` when not an int32."""
    raw_priority = headers.get(PRIORITY_HEADER, "").strip()
    try:
        priority = int(raw_priority) if raw_priority else 0
    except ValueError:
        raise BadRequest(
            f"header {PRIORITY_HEADER} must be an integer (got {raw_priority!r})", PRIORITY_HEADER
        ) from None
    if not -(2**31) <= priority < 2**31:
        raise BadRequest(f"header {PRIORITY_HEADER} is out of the int32 range", PRIORITY_HEADER)
    return priority


def claims_of(headers: Mapping[str, str]) -> Claims:
    """What the headers ask beside the key (checked by ``core.auth.authorize``)."""
    return Claims(
        tenant=headers.get(TENANT_HEADER, "").strip(),
        priority=priority_of(headers),
        tenant_source=f"header {TENANT_HEADER}",
        priority_source=f"header {PRIORITY_HEADER}",
    )


def extensions_from_headers(
    headers: Mapping[str, str], identity: Identity | None = None
) -> Extensions:
    """``headers`` with lower-case names (aiohttp's CIMultiDict is case-insensitive anyway).
    ``identity``: the caller as its API key names it (``http.auth``, keys configured): its
    tenant and priority. Without (an open router) the tenant header wins, else the hashed key,
    and the priority header is taken as sent."""
    session_id = headers.get(SESSION_HEADER, "").strip()
    if identity is not None:
        return Extensions(session_id, identity.tenant, identity.priority)
    key = api_key_of(headers)
    tenant = headers.get(TENANT_HEADER, "").strip() or (tenant_of_key(key) if key else "")
    return Extensions(session_id=session_id, tenant=tenant, priority=priority_of(headers))


# ---- typed field readers ---------------------------------------------------------------------
def _get(body: Mapping[str, Any], name: str, types: type | tuple[type, ...], what: str) -> Any:
    value = body.get(name)
    if value is None:
        return None
    # bool is an int in Python; JSON true is not a number.
    if isinstance(value, bool) and bool not in (types if isinstance(types, tuple) else (types,)):
        raise BadRequest(f"{name} must be {what} (got {json.dumps(value)})", name)
    if not isinstance(value, types):
        raise BadRequest(f"{name} must be {what} (got {json.dumps(value)[:80]})", name)
    return value


def _number(body: Mapping[str, Any], name: str) -> float | None:
    v = _get(body, name, (int, float), "a number")
    return None if v is None else float(v)


def _int(body: Mapping[str, Any], name: str) -> int | None:
    v = _get(body, name, int, "an integer")
    return None if v is None else int(v)


def _bool(body: Mapping[str, Any], name: str) -> bool:
    return bool(_get(body, name, bool, "true or false"))


def choices_per_prompt(body: Mapping[str, Any]) -> int:
    """``n`` (1 to MAX_N), and ``best_of`` checked against it: vLLM V1 dropped best_of (its
    server ignores the field), so only a best_of that selects nothing (= n) is accepted."""
    n = _int(body, "n")
    if n is None:
        n = 1
    if not 1 <= n <= MAX_N:
        raise BadRequest(f"n must be in [1, {MAX_N}] (got {n})", "n")
    best_of = _int(body, "best_of")
    if best_of is not None and best_of < n:
        raise BadRequest(f"best_of must be >= n = {n} (got {best_of})", "best_of")
    if best_of is not None and best_of > n:
        raise BadRequest(
            f"best_of > n is not supported (got best_of {best_of}, n {n}): choosing the best "
            "by log probability was removed in vLLM V1, which kvmesh serves with; send "
            f"n = {best_of} and pick on the client",
            "best_of",
        )
    return n


def _reject_unsupported(body: Mapping[str, Any], kind: Kind) -> None:
    if kind is Kind.COMPLETION and body.get("suffix"):
        raise BadRequest("suffix is not supported; omit it", "suffix")


def _structured_param(body: Mapping[str, Any]) -> str:
    return "structured_outputs" if body.get("structured_outputs") is not None else "response_format"


def _max_tokens_param(body: Mapping[str, Any]) -> str:
    """The field bounding the answer's length: max_completion_tokens wins over max_tokens."""
    return (
        "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    )


def _sampling(body: Mapping[str, Any], default_max_tokens: int) -> common_pb2.SamplingParams:
    param = _max_tokens_param(body)
    max_tokens = _int(body, param)
    if max_tokens is None:
        max_tokens = default_max_tokens
    if max_tokens <= 0:
        raise BadRequest(f"{param} must be > 0 (got {max_tokens})", param)
    if max_tokens >= 2**32:
        raise BadRequest(f"{param} is too large (got {max_tokens})", param)
    stop = body.get("stop")
    if stop is None:
        stops: list[str] = []
    elif isinstance(stop, str):
        stops = [stop]
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        stops = list(stop)
    else:
        raise BadRequest("stop must be a string or a list of strings", "stop")
    if len(stops) > MAX_STOP:
        raise BadRequest(f"stop has {len(stops)} strings; send at most {MAX_STOP}", "stop")
    stop_token_ids = body.get("stop_token_ids") or []  # vLLM extension
    if not isinstance(stop_token_ids, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 2**32 for t in stop_token_ids
    ):
        raise BadRequest("stop_token_ids must be a list of token ids", "stop_token_ids")
    sampling = common_pb2.SamplingParams(
        max_tokens=max_tokens,
        stop=stops,
        stop_token_ids=stop_token_ids,
        ignore_eos=_bool(body, "ignore_eos"),  # vLLM extension
    )
    temperature = _number(body, "temperature")
    if temperature is not None:
        sampling.temperature = temperature
    top_p = _number(body, "top_p")
    if top_p is not None:
        sampling.top_p = top_p
    top_k = _int(body, "top_k")  # vLLM extension
    if top_k is not None:
        if not -(2**31) <= top_k < 2**31:
            raise BadRequest(f"top_k is out of range (got {top_k})", "top_k")
        sampling.top_k = top_k
    seed = _int(body, "seed")
    if seed is not None:
        if not -(2**63) <= seed < 2**63:
            raise BadRequest(f"seed must fit in 64 bits (got {seed})", "seed")
        sampling.seed = seed
    structured = structured_output(body)
    if structured is not None:
        sampling.structured_output.CopyFrom(
            structured_output_pb(structured, common_pb2.StructuredOutput)
        )
    _penalties(body, sampling)
    return sampling


def _penalties(body: Mapping[str, Any], sampling: common_pb2.SamplingParams) -> None:
    """presence / frequency / repetition penalties, logit_bias, min_tokens: typed here, their
    ranges (and logit_bias's vocabulary) checked by the router (``kvmesh.sampling``)."""
    for name in ("presence_penalty", "frequency_penalty", "repetition_penalty"):
        value = _number(body, name)
        if value is not None:
            setattr(sampling, name, value)
    bias = body.get("logit_bias")
    if bias is not None:
        if not isinstance(bias, dict):
            raise BadRequest(
                "logit_bias must be an object: token id (a string) -> bias", "logit_bias"
            )
        for key, value in bias.items():
            token = key.strip() if isinstance(key, str) else ""
            if not token.isdecimal() or int(token) >= 2**32:
                raise BadRequest(
                    f"logit_bias keys must be token ids (got {json.dumps(key)[:40]})", "logit_bias"
                )
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise BadRequest(
                    f"logit_bias[{token}] must be a number (got {json.dumps(value)[:40]})",
                    "logit_bias",
                )
            sampling.logit_bias[int(token)] = float(value)
    min_tokens = _int(body, "min_tokens")  # vLLM extension
    if min_tokens is not None:
        if not 0 <= min_tokens < 2**32:
            raise BadRequest(f"min_tokens must be >= 0 (got {min_tokens})", "min_tokens")
        sampling.min_tokens = min_tokens


def _common(
    body: object, kind: Kind, default_max_tokens: int
) -> tuple[dict[str, Any], str, bool, bool, common_pb2.SamplingParams, int]:
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    model = _get(body, "model", str, "a string") or ""
    stream = _bool(body, "stream")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise BadRequest("stream_options must be an object", "stream_options")
    include_usage = bool(options and options.get("include_usage"))
    if include_usage and not stream:
        raise BadRequest("stream_options is only allowed with stream: true", "stream_options")
    _get(body, "user", str, "a string")  # accepted; logs carry the tenant instead
    _reject_unsupported(body, kind)
    n = choices_per_prompt(body)
    return body, model, stream, include_usage, _sampling(body, default_max_tokens), n


def _request(
    ext: Extensions, request_id: str, model: str, sampling: common_pb2.SamplingParams
) -> router_pb2.GenerateRequest:
    return router_pb2.GenerateRequest(
        request_id=request_id,
        model=model,
        sampling=sampling,
        session_id=ext.session_id,
        tenant=ext.tenant,
        priority=ext.priority,
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
    req = _request(ext, request_id, model, sampling)
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
        _max_tokens_param(data),
        forced=tools.forced,
        structured_param=_structured_param(data),
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
        req = _request(ext, request_id, model, sampling)
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
        max_tokens_param=_max_tokens_param(data),
        structured_param=_structured_param(data),
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


# ---- responses -------------------------------------------------------------------------------
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
