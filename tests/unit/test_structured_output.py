"""Structured output on the way in: OpenAI's response_format and vLLM's structured_outputs
extension -> SamplingParams.structured_output, the checks every service applies to it, the
proto round trip, the router error -> OpenAI param mapping, and the simulated engine's refusal."""

from __future__ import annotations

import json
from typing import Any

import pytest

from kvmesh import errors
from kvmesh.sampling import (
    STRUCTURED_FIELD,
    OutputKind,
    Sampling,
    StructuredOutput,
    check_sampling,
    sampling_from_pb,
    structured_output_pb,
)
from kvmesh.v1 import common_pb2
from services.router.http import parsing
from services.router.http.errors import BadRequest
from services.router.http.extensions import Extensions
from services.router.http.parsing import Kind
from services.router.http.structured import structured_output
from services.worker.core import GenerateRequest
from services.worker.sim.engine import SimulatedEngine

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}}
USER = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(
    ("body", "want"),
    [
        pytest.param({}, None, id="absent"),
        pytest.param({"response_format": {"type": "text"}}, None, id="text"),
        pytest.param(
            {"response_format": {"type": "json_object"}},
            StructuredOutput(OutputKind.JSON_OBJECT),
            id="json-object",
        ),
        pytest.param(
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "v", "schema": SCHEMA, "strict": True},
                }
            },
            StructuredOutput(OutputKind.JSON_SCHEMA, json.dumps(SCHEMA)),
            id="json-schema",
        ),
        pytest.param(
            {"structured_outputs": {"json": json.dumps(SCHEMA)}},
            StructuredOutput(OutputKind.JSON_SCHEMA, json.dumps(SCHEMA)),
            id="vllm-json-text",
        ),
        pytest.param(
            {"structured_outputs": {"regex": "a+"}},
            StructuredOutput(OutputKind.REGEX, "a+"),
            id="vllm-regex",
        ),
        pytest.param(
            {"structured_outputs": {"choice": ["x", "y"]}},
            StructuredOutput(OutputKind.CHOICE, choices=("x", "y")),
            id="vllm-choice",
        ),
        pytest.param(
            {"structured_outputs": {"grammar": 'root ::= "a"'}},
            StructuredOutput(OutputKind.GRAMMAR, 'root ::= "a"'),
            id="vllm-grammar",
        ),
        pytest.param(
            {"structured_outputs": {"json_object": True}},
            StructuredOutput(OutputKind.JSON_OBJECT),
            id="vllm-json-object",
        ),
    ],
)
def test_structured_output_in(body: dict[str, Any], want: StructuredOutput | None):
    assert structured_output(body) == want


@pytest.mark.parametrize(
    ("body", "param", "says"),
    [
        pytest.param({"response_format": "json"}, "response_format", "object", id="not-object"),
        pytest.param({"response_format": {"type": "xml"}}, "response_format", "xml", id="type"),
        pytest.param(
            {"response_format": {"type": "json_schema"}},
            "response_format",
            "needs json_schema",
            id="no-json-schema",
        ),
        pytest.param(
            {"response_format": {"type": "json_schema", "json_schema": {"name": "v"}}},
            "response_format",
            "no schema",
            id="no-schema",
        ),
        pytest.param(
            {"response_format": {"type": "json_schema", "json_schema": {"schema": [1]}}},
            "response_format",
            "JSON Schema object",
            id="schema-list",
        ),
        pytest.param(
            {"response_format": {"type": "json_schema", "json_schema": {"schema": "{"}}},
            "response_format",
            "not valid JSON",
            id="schema-text-bad",
        ),
        pytest.param(
            {"response_format": {"type": "json_schema", "json_schema": {"name": 3, "schema": {}}}},
            "response_format",
            "name must be a string",
            id="name",
        ),
        pytest.param(
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"schema": {}, "strict": "yes"},
                }
            },
            "response_format",
            "strict",
            id="strict",
        ),
        pytest.param(
            {"structured_outputs": {"regex": "a", "choice": ["a"]}},
            "structured_outputs",
            "exactly one",
            id="vllm-two",
        ),
        pytest.param(
            {"structured_outputs": {"structural_tag": "{}"}},
            "structured_outputs",
            "structural_tag",
            id="vllm-unknown",
        ),
        pytest.param(
            {"structured_outputs": {"json_object": False}},
            "structured_outputs",
            "true",
            id="vllm-json-object-false",
        ),
        pytest.param(
            {"structured_outputs": {"choice": "a"}},
            "structured_outputs",
            "list of strings",
            id="vllm-choice-str",
        ),
        pytest.param(
            {"structured_outputs": {"regex": 3}}, "structured_outputs", "string", id="vllm-regex"
        ),
        pytest.param(
            {"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
            "structured_outputs",
            "not both",
            id="both",
        ),
    ],
)
def test_structured_output_in_errors(body: dict[str, Any], param: str, says: str):
    with pytest.raises(BadRequest) as info:
        structured_output(body)
    assert info.value.param == param and says in str(info.value)


@pytest.mark.parametrize(
    "so",
    [
        StructuredOutput(OutputKind.JSON_SCHEMA, json.dumps(SCHEMA)),
        StructuredOutput(OutputKind.JSON_OBJECT),
        StructuredOutput(OutputKind.REGEX, "[a-z]+"),
        StructuredOutput(OutputKind.CHOICE, choices=("a", "b")),
        StructuredOutput(OutputKind.GRAMMAR, 'root ::= "a"'),
    ],
    ids=lambda so: so.kind.value,
)
def test_proto_round_trip_and_check(so: StructuredOutput):
    pb = common_pb2.SamplingParams(max_tokens=4)
    pb.structured_output.CopyFrom(structured_output_pb(so, common_pb2.StructuredOutput))
    pb = common_pb2.SamplingParams.FromString(pb.SerializeToString())
    s = sampling_from_pb(pb)
    assert s.structured_output == so
    check_sampling(s)


def test_unset_structured_output_is_none():
    assert sampling_from_pb(common_pb2.SamplingParams(max_tokens=4)).structured_output is None


@pytest.mark.parametrize(
    ("pb", "says"),
    [
        pytest.param(common_pb2.StructuredOutput(), "names no kind", id="empty"),
        pytest.param(common_pb2.StructuredOutput(json_object=False), "true", id="json-false"),
    ],
)
def test_bad_proto_structured_output(pb: common_pb2.StructuredOutput, says: str):
    msg = common_pb2.SamplingParams(max_tokens=4)
    msg.structured_output.CopyFrom(pb)
    if not msg.HasField("structured_output"):  # an empty submessage set explicitly
        msg.structured_output.SetInParent()
    with pytest.raises(errors.InvalidArgument) as info:
        sampling_from_pb(msg)
    assert info.value.field == STRUCTURED_FIELD and says in str(info.value)


@pytest.mark.parametrize(
    ("so", "says"),
    [
        pytest.param(StructuredOutput(OutputKind.JSON_SCHEMA, "{"), "not valid JSON", id="json"),
        pytest.param(StructuredOutput(OutputKind.JSON_SCHEMA, "[]"), "JSON object", id="list"),
        pytest.param(StructuredOutput(OutputKind.REGEX, " "), "empty", id="regex-blank"),
        pytest.param(StructuredOutput(OutputKind.REGEX, "a\x00"), "NUL", id="regex-nul"),
        pytest.param(StructuredOutput(OutputKind.GRAMMAR, ""), "empty", id="grammar"),
        pytest.param(StructuredOutput(OutputKind.CHOICE), "at least one", id="no-choices"),
        pytest.param(
            StructuredOutput(OutputKind.CHOICE, choices=("a", "")), "empty string", id="empty"
        ),
    ],
)
def test_check_names_the_field(so: StructuredOutput, says: str):
    with pytest.raises(errors.InvalidArgument) as info:
        check_sampling(Sampling(max_tokens=4, structured_output=so))
    assert info.value.field == STRUCTURED_FIELD and says in str(info.value)


def test_chat_request_carries_the_structured_output():
    body = {
        "messages": USER,
        "response_format": {"type": "json_object"},
        "tools": [{"type": "function", "function": {"name": "f"}}],
    }
    parsed = parsing.parse_chat(body, Extensions(), "rid", 64)
    assert parsed.generate.sampling.structured_output.json_object
    # The output is JSON content: no hermes <tool_call> blocks are read out of it.
    assert not parsed.parse_tool_calls and parsed.forced is None


def test_completion_request_carries_the_structured_output():
    body = {"prompt": "x", "structured_outputs": {"choice": ["a", "b"]}}
    parsed = parsing.parse_completion(body, Extensions(), "rid", 64)
    assert list(parsed.generate.sampling.structured_output.choice.choices) == ["a", "b"]
    assert parsed.structured_param == "structured_outputs"


@pytest.mark.parametrize(
    ("body", "field", "param"),
    [
        pytest.param(
            {"response_format": {"type": "json_object"}},
            STRUCTURED_FIELD,
            "response_format",
            id="response-format",
        ),
        pytest.param(
            {"structured_outputs": {"regex": "("}},
            STRUCTURED_FIELD,
            "structured_outputs",
            id="vllm-extension",
        ),
        pytest.param({}, "chat.tools", "tools", id="tools"),
        pytest.param({}, "chat.tool_choice", "tool_choice", id="tool-choice"),
    ],
)
def test_router_errors_name_the_openai_param(body: dict[str, Any], field: str, param: str):
    request = parsing.parse_chat({"messages": USER, **body}, Extensions(), "rid", 64)
    exc = parsing.router_error(errors.InvalidArgument("no", field), request)
    assert isinstance(exc, BadRequest) and exc.param == param
    assert request.kind is Kind.CHAT


async def test_simulated_engine_refuses_structured_output():
    engine = SimulatedEngine()
    request = GenerateRequest(
        request_id="r1",
        prompt_token_ids=tuple(range(1, 40)),
        sampling=Sampling(max_tokens=4, structured_output=StructuredOutput(OutputKind.JSON_OBJECT)),
    )
    try:
        with pytest.raises(errors.InvalidArgument) as info:
            async for _ in engine.generate(request):
                pass
        assert info.value.field == STRUCTURED_FIELD and "simulated engine" in str(info.value)
        # Without it the same request is served.
        plain = GenerateRequest("r2", request.prompt_token_ids, Sampling(max_tokens=4))
        assert [d async for d in engine.generate(plain)][-1].finish is not None
    finally:
        await engine.close()
