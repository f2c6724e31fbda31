"""A forced tool choice as a structured output. Pure.

``tool_choice: "required"`` and a named function are enforced the way vLLM enforces them
(``vllm/tool_parsers/utils.py``): the completion is constrained to a JSON Schema, so the model
cannot answer in prose.

- required: a JSON array of at least one ``{"name": <one of the tools' names>, "parameters":
  <that tool's arguments>}`` object (``parallel_tool_calls: false`` is not enforced: it has no
  ``kvmesh.v1`` field yet);
- a named function: that function's arguments object itself (its ``parameters`` schema).

A tool without parameters takes ``{}`` only. Tools' ``$defs`` move to the root of the
required-array schema, where their ``#/$defs/...`` references point; two tools defining one name
differently cannot share it and are INVALID_ARGUMENT naming ``chat.tools``.

Both front doors call this through the router servicer (``Router.Generate``), so a gRPC chat
request and an HTTP one get the same constraint.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from kvmesh.errors import InvalidArgument
from kvmesh.sampling import OutputKind, StructuredOutput

TOOLS_FIELD = "chat.tools"


class ForcedKind(StrEnum):
    REQUIRED = "required"  # at least one call, to any of the tools
    FUNCTION = "function"  # one call to the named function


@dataclass(frozen=True, slots=True)
class ForcedChoice:
    kind: ForcedKind
    function_name: str = ""  # for FUNCTION


@dataclass(frozen=True, slots=True)
class ToolDef:
    name: str
    parameters: Mapping[str, Any] | None = None  # the arguments' JSON Schema; None: no arguments


def _params_or_empty(params: Mapping[str, Any] | None) -> dict[str, Any]:
    return dict(params) if params else {"type": "object", "properties": {}}


def _hoist_defs(tools: Sequence[ToolDef]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Each tool's parameters without ``$defs``, and all their ``$defs`` together."""
    params: list[dict[str, Any]] = []
    defs: dict[str, Any] = {}
    for tool in tools:
        p = copy.deepcopy(_params_or_empty(tool.parameters))
        own = p.pop("$defs", None)
        if own is not None and not isinstance(own, dict):
            raise InvalidArgument(
                f"{TOOLS_FIELD}: $defs in the parameters of {tool.name!r} must be an object",
                TOOLS_FIELD,
            )
        for name, schema in (own or {}).items():
            if name in defs and defs[name] != schema:
                raise InvalidArgument(
                    f"{TOOLS_FIELD}: $defs {name!r} is defined differently by two tools; a "
                    "required tool choice puts every tool in one schema, so rename one",
                    TOOLS_FIELD,
                )
            defs[name] = schema
        params.append(p)
    return params, defs


def forced_schema(choice: ForcedChoice, tools: Sequence[ToolDef]) -> dict[str, Any]:
    """The JSON Schema the completion must follow for ``choice`` over ``tools``."""
    if not tools:
        raise InvalidArgument(
            "chat.tool_choice asks for a tool call but chat.tools is empty", TOOLS_FIELD
        )
    if choice.kind is ForcedKind.FUNCTION:
        tool = next((t for t in tools if t.name == choice.function_name), None)
        if tool is None:
            raise InvalidArgument(
                f"chat.tool_choice.function_name {choice.function_name!r} is not one of "
                f"chat.tools ({', '.join(t.name for t in tools)})",
                "chat.tool_choice",
            )
        return _params_or_empty(tool.parameters)
    params, defs = _hoist_defs(tools)
    schema: dict[str, Any] = {
        "type": "array",
        "minItems": 1,
        "items": {
            "type": "object",
            "anyOf": [
                {
                    "properties": {
                        "name": {"type": "string", "enum": [tool.name]},
                        "parameters": p,
                    },
                    "required": ["name", "parameters"],
                }
                for tool, p in zip(tools, params, strict=True)
            ],
        },
    }
    if defs:
        schema["$defs"] = defs
    return schema


def forced_output(choice: ForcedChoice, tools: Sequence[ToolDef]) -> StructuredOutput:
    """``forced_schema`` as the request's structured output."""
    return StructuredOutput(
        OutputKind.JSON_SCHEMA, json.dumps(forced_schema(choice, tools), ensure_ascii=False)
    )
