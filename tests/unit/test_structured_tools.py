"""Forced tool choice: the JSON schema the router derives (core/forced_tools.py), the reading of
the constrained answer back into tool calls (http/forcedcalls.py), and how the OpenAI answer
looks, streamed and whole (ResponseTranslator)."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest

from kvmesh import errors
from kvmesh.sampling import OutputKind
from kvmesh.v1 import common_pb2, router_pb2
from services.router.core.forced_tools import (
    ForcedChoice,
    ForcedKind,
    ToolDef,
    forced_output,
    forced_schema,
)
from services.router.http import forcedcalls, parsing, rendering
from services.router.http.extensions import Extensions
from services.router.http.toolcalls import Call, Text
from services.router.prepare import forced_choice, tool_defs

CITY = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"]}
TOOLS = [ToolDef("weather", CITY), ToolDef("clock")]
REQUIRED = ForcedChoice(ForcedKind.REQUIRED)
NAMED = ForcedChoice(ForcedKind.FUNCTION, "weather")


# ---- the schema ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("choice", "value", "ok"),
    [
        pytest.param(
            REQUIRED, [{"name": "weather", "parameters": {"city": "Rome"}}], True, id="one"
        ),
        pytest.param(
            REQUIRED,
            [
                {"name": "clock", "parameters": {}},
                {"name": "weather", "parameters": {"city": "Paris"}},
            ],
            True,
            id="two",
        ),
        pytest.param(REQUIRED, [], False, id="none"),
        pytest.param(REQUIRED, [{"name": "nope", "parameters": {}}], False, id="unknown-name"),
        pytest.param(
            REQUIRED, [{"name": "weather", "parameters": {"city": "Oslo"}}], False, id="bad-args"
        ),
        pytest.param(REQUIRED, [{"name": "weather"}], False, id="no-parameters"),
        pytest.param(REQUIRED, {"name": "weather", "parameters": {}}, False, id="not-array"),
        pytest.param(NAMED, {"city": "Rome"}, True, id="named"),
        pytest.param(NAMED, {"town": "Rome"}, False, id="named-bad"),
        pytest.param(ForcedChoice(ForcedKind.FUNCTION, "clock"), {}, True, id="no-params"),
        pytest.param(ForcedChoice(ForcedKind.FUNCTION, "clock"), [], False, id="no-params-list"),
    ],
)
def test_forced_schema_accepts_exactly_the_calls(choice: ForcedChoice, value: Any, ok: bool):
    schema = forced_schema(choice, TOOLS)
    jsonschema.Draft202012Validator.check_schema(schema)
    assert jsonschema.Draft202012Validator(schema).is_valid(value) is ok


def test_defs_move_to_the_root_where_references_point():
    item = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    params = {
        "type": "object",
        "properties": {"it": {"$ref": "#/$defs/Item"}},
        "$defs": {"Item": item},
    }
    tools = [ToolDef("a", params), ToolDef("b", params)]
    schema = forced_schema(REQUIRED, tools)
    assert schema["$defs"] == {"Item": item}
    assert "$defs" not in schema["items"]["anyOf"][0]["properties"]["parameters"]
    assert "$defs" in params  # the caller's schema is left alone
    v = jsonschema.Draft202012Validator(schema)
    assert v.is_valid([{"name": "a", "parameters": {"it": {"n": 1}}}])
    assert not v.is_valid([{"name": "a", "parameters": {"it": {"n": "x"}}}])
    assert forced_schema(ForcedChoice(ForcedKind.FUNCTION, "a"), tools) == params  # as given


@pytest.mark.parametrize(
    ("choice", "tools", "field", "says"),
    [
        pytest.param(REQUIRED, [], "chat.tools", "empty", id="no-tools"),
        pytest.param(
            ForcedChoice(ForcedKind.FUNCTION, "x"),
            TOOLS,
            "chat.tool_choice",
            "not one of",
            id="name",
        ),
        pytest.param(
            REQUIRED,
            [
                ToolDef("a", {"$defs": {"X": {"type": "string"}}}),
                ToolDef("b", {"$defs": {"X": {}}}),
            ],
            "chat.tools",
            "defined differently",
            id="defs-clash",
        ),
        pytest.param(
            REQUIRED, [ToolDef("a", {"$defs": [1]})], "chat.tools", "$defs", id="defs-list"
        ),
    ],
)
def test_forced_schema_errors(choice: ForcedChoice, tools: list[ToolDef], field: str, says: str):
    with pytest.raises(errors.InvalidArgument) as info:
        forced_schema(choice, tools)
    assert info.value.field == field and says in str(info.value)


def test_forced_output_is_the_schema_as_json_text():
    out = forced_output(NAMED, TOOLS)
    assert out.kind is OutputKind.JSON_SCHEMA and json.loads(out.spec) == CITY


def test_the_servicer_reads_the_forced_choice_from_a_chat_request():
    req = router_pb2.GenerateRequest()
    req.chat.messages.add(role="user", content="hi")
    req.chat.tools.add(name="weather", parameters_json=json.dumps(CITY))
    req.chat.tools.add(name="clock")
    assert forced_choice(req) is None  # AUTO
    req.chat.tool_choice.mode = router_pb2.TOOL_CHOICE_MODE_NONE
    assert forced_choice(req) is None
    req.chat.tool_choice.mode = router_pb2.TOOL_CHOICE_MODE_REQUIRED
    assert forced_choice(req) == REQUIRED
    req.chat.tool_choice.mode = router_pb2.TOOL_CHOICE_MODE_FUNCTION
    req.chat.tool_choice.function_name = "weather"
    assert forced_choice(req) == NAMED
    assert tool_defs(req.chat) == TOOLS
    assert forced_choice(router_pb2.GenerateRequest(text="hi")) is None


# ---- reading the answer ----------------------------------------------------------------------
ANSWER = '[{"name":"weather","parameters":{"city":"Rome"}}, {"name":"clock","parameters":{}}]'
CALLS = [Call("weather", '{"city": "Rome"}'), Call("clock", "{}")]


def feed_all(parser: forcedcalls.RequiredParser, deltas: list[str]) -> list[Any]:
    pieces = [p for d in deltas for p in parser.feed(d)] + parser.finish()
    return pieces


@pytest.mark.parametrize("size", [1, 2, 3, 7, len(ANSWER)])
def test_required_parser_gives_each_call_once_its_object_closes(size: int):
    deltas = [ANSWER[i : i + size] for i in range(0, len(ANSWER), size)]
    parser = forcedcalls.RequiredParser()
    seen: list[Any] = []
    for j, delta in enumerate(deltas):
        seen += parser.feed(delta)
        done = "".join(deltas[: j + 1])
        # a call is out exactly when its closing brace has arrived, not before
        assert len(seen) == done.count("}}")
    assert seen + parser.finish() == CALLS


@pytest.mark.parametrize(
    ("text", "content", "calls"),
    [
        pytest.param(ANSWER, "", CALLS, id="two"),
        pytest.param(
            ' [ {"name":"a","parameters":{"s":"}]\\"{"}} ] ',
            "",
            [Call("a", '{"s": "}]\\"{"}')],
            id="braces-in-strings",
        ),
        pytest.param(
            '[{"name":"a","parameters":{}},{"name":"b","param',
            '{"name":"b","param',
            [Call("a", "{}")],
            id="cut-short",
        ),
        pytest.param('[{"name":"a","param', '[{"name":"a","param', [], id="cut-before-any"),
        pytest.param(
            '[{"nom":"a"},{"name":"b","parameters":{}}]',
            '{"nom":"a"}',
            [Call("b", "{}")],
            id="not-a-call",
        ),
        pytest.param("hello", "hello", [], id="not-json"),
    ],
)
def test_parse_required(text: str, content: str, calls: list[Call]):
    assert forcedcalls.parse_required(text) == (content, calls)


def test_text_that_is_no_array_streams_as_text():
    parser = forcedcalls.RequiredParser()
    assert feed_all(parser, ["he", "llo"]) == [Text("he"), Text("llo")]


def test_named_call():
    assert forcedcalls.named_call('{"city":"Rome"}', "weather") == Call(
        "weather", '{"city":"Rome"}'
    )
    assert forcedcalls.named_call("  ", "weather") is None


# ---- the OpenAI answer -----------------------------------------------------------------------
BODY: Any = {
    "messages": [{"role": "user", "content": "hi"}],
    "tools": [
        {"type": "function", "function": {"name": "weather", "parameters": CITY}},
        {"type": "function", "function": {"name": "clock"}},
    ],
}


def chunks(*texts: str, reason: int = common_pb2.FINISH_REASON_STOP) -> list[Any]:
    msgs = [router_pb2.GenerateResponse(request_id="rid", text=t, token_ids=[1]) for t in texts]
    last = router_pb2.GenerateResponse(request_id="rid")
    last.finished.reason = reason
    last.finished.usage.completion_tokens = len(texts)
    return [*msgs, last]


def translator(tool_choice: Any, stream: bool, **body: Any) -> rendering.ResponseTranslator:
    parsed = parsing.parse_chat(
        {**BODY, "tool_choice": tool_choice, "stream": stream, **body}, Extensions(), "rid", 64
    )
    ids = iter(range(100))
    return rendering.ResponseTranslator(parsed, created=1, call_id=lambda: f"call_{next(ids)}")


def deltas(tr: rendering.ResponseTranslator, msgs: list[Any]) -> list[Any]:
    return [c["choices"][0] for m in msgs for c in tr.feed(m) if c["choices"]]


@pytest.mark.parametrize(
    ("reason", "finish"),
    [(common_pb2.FINISH_REASON_STOP, "tool_calls"), (common_pb2.FINISH_REASON_LENGTH, "length")],
)
def test_required_whole_answer(reason: int, finish: str):
    tr = translator("required", False)
    for m in chunks(ANSWER[:20], ANSWER[20:], reason=reason):
        tr.feed(m)
    choice = tr.response()["choices"][0]
    assert choice["finish_reason"] == finish
    assert choice["message"]["content"] is None
    assert choice["message"]["tool_calls"] == [
        {
            "id": "call_0",
            "type": "function",
            "function": {"name": "weather", "arguments": '{"city": "Rome"}'},
        },
        {"id": "call_1", "type": "function", "function": {"name": "clock", "arguments": "{}"}},
    ]


def test_required_streamed_answer():
    tr = translator("required", True)
    out = deltas(tr, chunks(ANSWER[:30], ANSWER[30:60], ANSWER[60:]))
    calls = [tc for c in out for tc in c["delta"].get("tool_calls", [])]
    assert [(tc["index"], tc["id"], tc["function"]["name"]) for tc in calls] == [
        (0, "call_0", "weather"),
        (1, "call_1", "clock"),
    ]
    assert not any(c["delta"].get("content") for c in out)
    assert out[-1]["finish_reason"] == "tool_calls"


def test_named_whole_answer_is_one_call_finishing_stop():
    tr = translator({"type": "function", "function": {"name": "weather"}}, False)
    for m in chunks('{"city"', ':"Rome"}'):
        tr.feed(m)
    choice = tr.response()["choices"][0]
    assert choice["finish_reason"] == "stop"  # OpenAI's and vLLM's answer to a named choice
    assert choice["message"]["content"] is None
    assert choice["message"]["tool_calls"] == [
        {
            "id": "call_0",
            "type": "function",
            "function": {"name": "weather", "arguments": '{"city":"Rome"}'},
        }
    ]


def test_named_streamed_answer_streams_the_arguments():
    tr = translator({"type": "function", "function": {"name": "weather"}}, True)
    out = deltas(tr, chunks('{"city"', ':"Rome"}'))
    calls = [tc for c in out for tc in c["delta"].get("tool_calls", [])]
    assert calls == [
        {
            "index": 0,
            "id": "call_0",
            "type": "function",
            "function": {"name": "weather", "arguments": '{"city"'},
        },
        {"index": 0, "function": {"arguments": ':"Rome"}'}},
    ]
    assert out[-1]["finish_reason"] == "stop"


def test_forced_choice_wins_over_response_format():
    """The calls are the answer; response_format is about text content, which a forced turn has
    none of (vLLM and OpenAI do the same). The router replaces the constraint with the tools'."""
    tr = translator("required", False, response_format={"type": "json_object"})
    assert tr.request.forced == REQUIRED and tr.request.parse_tool_calls
    for m in chunks(ANSWER):
        tr.feed(m)
    assert len(tr.response()["choices"][0]["message"]["tool_calls"]) == 2


def test_auto_with_response_format_is_json_content():
    tr = translator("auto", False, response_format={"type": "json_object"})
    for m in chunks('{"a":"<tool_call>{\\"name\\":\\"clock\\"}</tool_call>"}'):
        tr.feed(m)
    message = tr.response()["choices"][0]["message"]
    assert "tool_calls" not in message and json.loads(message["content"])
