"""OpenAI tool calling on the way in: ``tools`` (and the legacy ``functions``), ``tool_choice``
(and the legacy ``function_call``) and an assistant message's ``tool_calls`` (and its legacy
``function_call``) -> ``kvmesh.v1`` messages. Pure; every malformed field is a ``BadRequest``
naming it.

Arguments and parameter schemas travel as JSON text; the router parses them again for the chat
template, so what is checked here is what the template would choke on."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvmesh.v1 import router_pb2

from ..core.forced_tools import ForcedChoice, ForcedKind
from .errors import BadRequest

_MODES = {
    "auto": router_pb2.TOOL_CHOICE_MODE_AUTO,
    "none": router_pb2.TOOL_CHOICE_MODE_NONE,
    "required": router_pb2.TOOL_CHOICE_MODE_REQUIRED,
}
_CHOICE_HINT = "use 'none', 'auto', 'required' or {'type': 'function', 'function': {'name': ...}}"


@dataclass(frozen=True, slots=True)
class ToolSpec:
    """A request's tools and tool choice, and whether its answer is parsed for tool calls."""

    tools: tuple[router_pb2.Tool, ...] = ()
    choice: router_pb2.ToolChoice | None = None
    # Tools were given and tool_choice is not "none": the model may answer with calls.
    parse_calls: bool = False
    # tool_choice "required" or a named function: the router constrains the output to the calls.
    forced: ForcedChoice | None = None


def _kind(value: object, param: str, what: str) -> None:
    """``type`` of a tool or call: "function" (or absent, as lenient clients send it)."""
    if value not in (None, "function"):
        raise BadRequest(
            f"{param} is {json.dumps(value)[:40]}; only 'function' {what} are supported", param
        )


def arguments_text(value: object, param: str) -> str:
    """A call's ``arguments``: a JSON object as a string (what OpenAI returns and clients send
    back). Absent or empty means no arguments."""
    if value is None or value == "":
        return "{}"
    if not isinstance(value, str):
        raise BadRequest(
            f"{param} must be a string holding a JSON object (got {type(value).__name__}); "
            "send json.dumps(arguments)",
            param,
        )
    try:
        decoded = json.loads(value)
    except ValueError as exc:
        raise BadRequest(f"{param} is not valid JSON ({exc}): {value[:60]!r}", param) from None
    if not isinstance(decoded, dict):
        raise BadRequest(f"{param} must hold a JSON object (got {value[:60]!r})", param)
    return value


def _call(call: object, param: str) -> router_pb2.ToolCall:
    if not isinstance(call, dict):
        raise BadRequest(f"{param} must be an object", param)
    _kind(call.get("type"), f"{param}.type", "tool calls")
    call_id = call.get("id") or ""
    if not isinstance(call_id, str):
        raise BadRequest(f"{param}.id must be a string", f"{param}.id")
    fn = call.get("function")
    if not isinstance(fn, dict):
        raise BadRequest(f"{param}.function must be an object with name and arguments", param)
    name = fn.get("name")
    if not isinstance(name, str) or not name:
        raise BadRequest(
            f"{param}.function.name must be a non-empty string", f"{param}.function.name"
        )
    return router_pb2.ToolCall(
        id=call_id,
        type="function",
        name=name,
        arguments=arguments_text(fn.get("arguments"), f"{param}.function.arguments"),
    )


def assistant_tool_calls(message: Mapping[str, Any], param: str) -> list[router_pb2.ToolCall]:
    """An assistant message's ``tool_calls``, or its legacy ``function_call`` (one call whose id
    is the function's name, which the legacy ``function`` message answers)."""
    calls = message.get("tool_calls")
    if calls is not None:
        if not isinstance(calls, list):
            raise BadRequest(f"{param}.tool_calls must be a list", f"{param}.tool_calls")
        return [_call(c, f"{param}.tool_calls[{j}]") for j, c in enumerate(calls)]
    legacy = message.get("function_call")
    if legacy is None:
        return []
    p = f"{param}.function_call"
    if (
        not isinstance(legacy, dict)
        or not isinstance(legacy.get("name"), str)
        or not legacy["name"]
    ):
        raise BadRequest(f"{p} must be an object with a non-empty name", p)
    return [
        router_pb2.ToolCall(
            id=legacy["name"],
            type="function",
            name=legacy["name"],
            arguments=arguments_text(legacy.get("arguments"), f"{p}.arguments"),
        )
    ]


def _function(fn: object, param: str) -> router_pb2.Tool:
    if not isinstance(fn, dict):
        raise BadRequest(f"{param} must be an object with name, description, parameters", param)
    name = fn.get("name")
    if not isinstance(name, str) or not name:
        raise BadRequest(f"{param}.name must be a non-empty string", f"{param}.name")
    description = fn.get("description")
    if description is not None and not isinstance(description, str):
        raise BadRequest(f"{param}.description must be a string", f"{param}.description")
    parameters = fn.get("parameters")
    if parameters is not None and not isinstance(parameters, dict):
        raise BadRequest(f"{param}.parameters must be a JSON Schema object", f"{param}.parameters")
    strict = fn.get("strict")  # accepted: a forced call follows the schema either way
    if strict is not None and not isinstance(strict, bool):
        raise BadRequest(f"{param}.strict must be true or false", f"{param}.strict")
    return router_pb2.Tool(
        type="function",
        name=name,
        description=description or "",
        parameters_json=json.dumps(parameters, ensure_ascii=False) if parameters else "",
    )


def _tools(body: Mapping[str, Any]) -> list[router_pb2.Tool]:
    tools, functions = body.get("tools"), body.get("functions")
    if tools is not None and functions is not None:
        raise BadRequest("send tools or the legacy functions, not both", "functions")
    out: list[router_pb2.Tool] = []
    params: list[str] = []
    if tools is not None:
        if not isinstance(tools, list):
            raise BadRequest(
                "tools must be a list of {'type': 'function', 'function': ...}", "tools"
            )
        for j, tool in enumerate(tools):
            if not isinstance(tool, dict):
                raise BadRequest(f"tools[{j}] must be an object", f"tools[{j}]")
            _kind(tool.get("type"), f"tools[{j}].type", "tools")
            out.append(_function(tool.get("function"), f"tools[{j}].function"))
            params.append(f"tools[{j}].function.name")
    elif functions is not None:
        if not isinstance(functions, list):
            raise BadRequest("functions must be a list of function definitions", "functions")
        for j, fn in enumerate(functions):
            out.append(_function(fn, f"functions[{j}]"))
            params.append(f"functions[{j}].name")
    seen: set[str] = set()
    for tool, param in zip(out, params, strict=True):
        if tool.name in seen:
            raise BadRequest(f"{param}: {tool.name!r} is defined twice", param)
        seen.add(tool.name)
    return out


def _choice(body: Mapping[str, Any], names: list[str]) -> router_pb2.ToolChoice | None:
    param = "tool_choice"
    raw = body.get(param)
    if raw is None and body.get("function_call") is not None:  # the legacy spelling
        param = "function_call"
        raw = body[param]
    if raw is None:
        return None
    if isinstance(raw, str):
        if raw not in _MODES:
            raise BadRequest(f"{param} is {raw!r}; {_CHOICE_HINT}", param)
        choice = router_pb2.ToolChoice(mode=_MODES[raw])
    elif isinstance(raw, dict):
        _kind(raw.get("type"), f"{param}.type", "tool choices")
        fn = raw.get("function", raw)  # the legacy function_call: {"name": ...}
        name = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(name, str) or not name:
            raise BadRequest(f"{param} names no function; {_CHOICE_HINT}", param)
        choice = router_pb2.ToolChoice(
            mode=router_pb2.TOOL_CHOICE_MODE_FUNCTION, function_name=name
        )
    else:
        raise BadRequest(f"{param} must be a string or an object; {_CHOICE_HINT}", param)
    wants_call = choice.mode in (
        router_pb2.TOOL_CHOICE_MODE_REQUIRED,
        router_pb2.TOOL_CHOICE_MODE_FUNCTION,
    )
    if wants_call and not names:
        raise BadRequest(f"{param} asks for a tool call but the request has no tools", param)
    if choice.mode == router_pb2.TOOL_CHOICE_MODE_FUNCTION and choice.function_name not in names:
        raise BadRequest(
            f"{param} names {choice.function_name!r}, which is not one of the tools "
            f"({', '.join(names)})",
            param,
        )
    return choice


def tool_spec(body: Mapping[str, Any]) -> ToolSpec:
    """A chat request's ``tools`` / ``functions``, ``tool_choice`` / ``function_call`` and
    ``parallel_tool_calls`` (accepted; every call the model writes is returned). A forced
    choice (``required``, a named function) is read as JSON calls, not hermes blocks."""
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise BadRequest("parallel_tool_calls must be true or false", "parallel_tool_calls")
    tools = _tools(body)
    names = [t.name for t in tools]
    choice = _choice(body, names)
    none = choice is not None and choice.mode == router_pb2.TOOL_CHOICE_MODE_NONE
    forced = None
    if choice is not None and choice.mode == router_pb2.TOOL_CHOICE_MODE_REQUIRED:
        forced = ForcedChoice(ForcedKind.REQUIRED)
    elif choice is not None and choice.mode == router_pb2.TOOL_CHOICE_MODE_FUNCTION:
        forced = ForcedChoice(ForcedKind.FUNCTION, choice.function_name)
    return ToolSpec(tuple(tools), choice, parse_calls=bool(tools) and not none, forced=forced)
