"""Structured output on the way in: OpenAI's ``response_format`` and vLLM's
``structured_outputs`` extension -> ``kvmesh.sampling.StructuredOutput``. Pure; every malformed
field is a ``BadRequest`` naming it (``response_format`` or ``structured_outputs``, the whole
field: also what an engine's refusal of the schema names).

``response_format``: ``{"type": "text"}`` (unconstrained), ``{"type": "json_object"}`` (any JSON
object), ``{"type": "json_schema", "json_schema": {"name", "schema", "strict", "description"}}``
(a JSON value the schema accepts; decoding is always strict, ``strict: false`` included).
``structured_outputs`` (vLLM's field): exactly one of ``json`` (a schema, object or JSON text),
``json_object`` (true), ``regex``, ``choice`` (a list of strings), ``grammar``. Both fields in
one request: a 400 (say which one you mean)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from kvmesh.sampling import OutputKind, StructuredOutput

from .errors import BadRequest

_FORMATS = "'text', 'json_object' or 'json_schema'"
_VLLM_KINDS = {
    "json": OutputKind.JSON_SCHEMA,
    "json_object": OutputKind.JSON_OBJECT,
    "regex": OutputKind.REGEX,
    "choice": OutputKind.CHOICE,
    "grammar": OutputKind.GRAMMAR,
}


def _schema_text(schema: object, what: str, param: str) -> str:
    if isinstance(schema, str):  # JSON text, as vLLM also takes it
        try:
            schema = json.loads(schema)
        except ValueError as exc:
            raise BadRequest(f"{what} is not valid JSON ({exc})", param) from None
    if not isinstance(schema, dict):
        raise BadRequest(f"{what} must be a JSON Schema object", param)
    return json.dumps(schema, ensure_ascii=False)


def _response_format(fmt: object) -> StructuredOutput | None:
    param = "response_format"
    if not isinstance(fmt, dict):
        raise BadRequest(f"{param} must be an object with a type of {_FORMATS}", param)
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutput(OutputKind.JSON_OBJECT)
    if kind != "json_schema":
        raise BadRequest(f"{param}.type is {json.dumps(kind)[:40]}; use {_FORMATS}", param)
    spec = fmt.get("json_schema")
    if not isinstance(spec, dict):
        raise BadRequest(
            f"{param} of type 'json_schema' needs json_schema: {{'name': ..., 'schema': {{...}}}}",
            param,
        )
    for name in ("name", "description"):
        if spec.get(name) is not None and not isinstance(spec[name], str):
            raise BadRequest(f"{param}.json_schema.{name} must be a string", param)
    strict = spec.get("strict")  # accepted: the output follows the schema either way
    if strict is not None and not isinstance(strict, bool):
        raise BadRequest(f"{param}.json_schema.strict must be true or false", param)
    if "schema" not in spec:
        raise BadRequest(f"{param}.json_schema has no schema; send the JSON Schema", param)
    return StructuredOutput(
        OutputKind.JSON_SCHEMA, _schema_text(spec["schema"], f"{param}.json_schema.schema", param)
    )


def _vllm_structured_outputs(raw: object) -> StructuredOutput:
    param = "structured_outputs"
    if not isinstance(raw, dict):
        raise BadRequest(f"{param} must be an object with one of {', '.join(_VLLM_KINDS)}", param)
    unknown = sorted(set(raw) - set(_VLLM_KINDS))
    if unknown:
        raise BadRequest(
            f"{param} has {', '.join(unknown)}, which kvmesh does not support; use one of "
            f"{', '.join(_VLLM_KINDS)} (whitespace and backend options are the worker's "
            "--structured-outputs-config)",
            param,
        )
    given = [k for k in _VLLM_KINDS if raw.get(k) is not None]
    if len(given) != 1:
        raise BadRequest(
            f"{param} must set exactly one of {', '.join(_VLLM_KINDS)} (got {len(given)})", param
        )
    (name,) = given
    value, kind = raw[name], _VLLM_KINDS[name]
    p = f"{param}.{name}"
    if kind is OutputKind.JSON_SCHEMA:
        return StructuredOutput(kind, _schema_text(value, p, param))
    if kind is OutputKind.JSON_OBJECT:
        if value is not True:
            raise BadRequest(f"{p} must be true when set", param)
        return StructuredOutput(kind)
    if kind is OutputKind.CHOICE:
        if not isinstance(value, list) or not all(isinstance(c, str) for c in value):
            raise BadRequest(f"{p} must be a list of strings", param)
        return StructuredOutput(kind, choices=tuple(value))
    if not isinstance(value, str):
        raise BadRequest(f"{p} must be a string", param)
    return StructuredOutput(kind, spec=value)


def structured_output(body: Mapping[str, Any]) -> StructuredOutput | None:
    """The request's structured output, or None for unconstrained text."""
    fmt, ext = body.get("response_format"), body.get("structured_outputs")
    if fmt is not None and ext is not None:
        raise BadRequest(
            "send response_format or vLLM's structured_outputs, not both", "structured_outputs"
        )
    if ext is not None:
        return _vllm_structured_outputs(ext)
    return None if fmt is None else _response_format(fmt)
