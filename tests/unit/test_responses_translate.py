"""OpenAI Responses -> the router's chat request, and the router's answer -> a Response and its
event stream (services/router/http/responses.py, responses_stream.py). Pure: every rule a row."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

from kvmesh import errors
from kvmesh.v1 import common_pb2, router_pb2
from services.router.core.forced_tools import ForcedKind
from services.router.http import responses
from services.router.http.errors import BadRequest, ResponseNotFound, error_body
from services.router.http.extensions import Extensions
from services.router.http.responses_http import token_request
from services.router.http.responses_stream import ResponseCollector, ResponseEvents
from services.router.state import StoredResponse

EXT = Extensions(tenant="team")
FN: Any = {
    "type": "function",
    "name": "weather",
    "description": "The weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    "strict": True,
}


def build(previous: StoredResponse | None = None, **body: Any) -> responses.ResponsesRequest:
    turn = responses.parse_input({"model": "tiny", **body})
    return responses.build(turn, previous, EXT, "resp_1", 512)


def chat(req: responses.ResponsesRequest) -> list[tuple[str, str]]:
    return [(m.role, m.content) for m in req.chat.generate.chat.messages]


def stored(**kw: Any) -> StoredResponse:
    base: dict[str, Any] = {
        "id": "resp_0",
        "tenant": "team",
        "session_id": "resp_0",
        "created_at": 1.0,
        "model": "tiny",
        "response": {},
        "history": (
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "hello"},
        ),
        "instructions": "Be terse.",
        "tools_key": "",
        "prompt_ids": [1, 2, 3],
        "output_ids": [4],
    }
    return StoredResponse(**{**base, **kw})


# ---- the request ----------------------------------------------------------------------------
def test_text_input_with_instructions_and_sampling():
    req = build(
        input="hi", instructions="Be terse.", max_output_tokens=9, temperature=0.5, top_p=0.9
    )
    g = req.chat.generate
    assert chat(req) == [("system", "Be terse."), ("user", "hi")]
    assert (g.sampling.max_tokens, g.request_id, g.tenant) == (9, "resp_1", "team")
    assert g.sampling.temperature == pytest.approx(0.5) and g.sampling.top_p == pytest.approx(0.9)
    assert (req.new_from, req.session_id, req.input.store, req.stream) == (1, "resp_1", True, False)
    assert req.chat.max_tokens_param == "max_output_tokens"


def test_items_become_messages_tool_calls_and_results():
    req = build(
        input=[
            {"role": "developer", "content": "Rules."},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "go"}]},
            {"type": "reasoning", "id": "rs_1", "summary": []},
            {
                "type": "message",
                "role": "assistant",
                "content": [{"type": "output_text", "text": "Let me look.", "annotations": []}],
            },
            {"type": "function_call", "call_id": "c1", "name": "weather", "arguments": "{}"},
            {"type": "function_call", "call_id": "c2", "name": "weather", "arguments": '{"a":1}'},
            {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
            {
                "type": "function_call_output",
                "call_id": "c2",
                "output": [{"type": "input_text", "text": "rain"}],
            },
        ],
        tools=[FN],
    )
    msgs = list(req.chat.generate.chat.messages)
    assert [(m.role, m.content) for m in msgs] == [
        ("system", "Rules."),
        ("user", "go"),
        ("assistant", "Let me look."),
        ("tool", "sunny"),
        ("tool", "rain"),
    ]
    assert [(c.id, c.name, c.arguments) for c in msgs[2].tool_calls] == [
        ("c1", "weather", "{}"),
        ("c2", "weather", '{"a":1}'),
    ]
    assert [m.tool_call_id for m in msgs[3:]] == ["c1", "c2"]
    tool = req.chat.generate.chat.tools[0]
    assert (tool.name, tool.description) == ("weather", "The weather")
    assert req.chat.parse_tool_calls and req.tools_key


@pytest.mark.parametrize(
    ("choice", "mode", "forced"),
    [
        pytest.param("auto", router_pb2.TOOL_CHOICE_MODE_AUTO, None, id="auto"),
        pytest.param(
            "required", router_pb2.TOOL_CHOICE_MODE_REQUIRED, ForcedKind.REQUIRED, id="required"
        ),
        pytest.param(
            {"type": "function", "name": "weather"},
            router_pb2.TOOL_CHOICE_MODE_FUNCTION,
            ForcedKind.FUNCTION,
            id="named",
        ),
    ],
)
def test_tool_choice(choice: Any, mode: int, forced: ForcedKind | None):
    req = build(input="hi", tools=[FN], tool_choice=choice)
    assert req.chat.generate.chat.tool_choice.mode == mode
    assert (req.chat.forced.kind if req.chat.forced else None) == forced


def test_tool_choice_none_renders_no_tools():
    assert build(input="hi", tools=[FN], tool_choice="none").tools_key == ""


def test_text_format_is_structured_output():
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}}
    req = build(input="hi", text={"format": {"type": "json_schema", "name": "v", "schema": schema}})
    assert req.chat.generate.sampling.HasField("structured_output")
    assert not build(input="hi", text={"format": {"type": "text"}}).chat.generate.sampling.HasField(
        "structured_output"
    )


@pytest.mark.parametrize(
    ("body", "param", "says"),
    [
        pytest.param({}, "input", "Field required", id="no-input"),
        pytest.param({"input": []}, "input", "non-empty", id="empty-input"),
        pytest.param(
            {"input": [{"type": "web_search_call"}]},
            "input[0].type",
            "function_call_output",
            id="builtin-item",
        ),
        pytest.param(
            {"input": [{"type": "item_reference", "id": "x"}]},
            "input[0]",
            "item_reference",
            id="reference",
        ),
        pytest.param(
            {"input": [{"role": "tool", "content": "x"}]}, "input[0].role", "developer", id="role"
        ),
        pytest.param(
            {"input": [{"role": "user", "content": [{"type": "input_image"}]}]},
            "input[0].content[0]",
            "input_text",
            id="image",
        ),
        pytest.param(
            {"input": [{"type": "function_call", "call_id": "", "name": "f"}]},
            "input[0]",
            "call_id",
            id="call-without-id",
        ),
        pytest.param(
            {"input": [{"type": "function_call_output", "call_id": "c"}]},
            "input[0].output",
            "required",
            id="output-missing",
        ),
        pytest.param(
            {"input": "x", "tools": [{"name": "f"}]}, "tools[0].type", "type", id="untyped-tool"
        ),
        pytest.param(
            {"input": "x", "tools": [{"type": "namespace", "name": "ns", "tools": {}}]},
            "tools[0].tools",
            "function tools",
            id="namespace-not-a-list",
        ),
        pytest.param(
            {"input": "x", "tool_choice": "sometimes"}, "tool_choice", "required", id="choice"
        ),
        pytest.param(
            {"input": "x", "instructions": [{"role": "system"}]},
            "instructions",
            "string",
            id="instructions",
        ),
        pytest.param({"input": "x", "store": "yes"}, "store", "true or false", id="store"),
        pytest.param(
            {"input": "x", "previous_response_id": ""},
            "previous_response_id",
            "stored",
            id="previous",
        ),
        pytest.param(
            {"input": "x", "background": True}, "background", "not supported", id="background"
        ),
        pytest.param(
            {"input": "x", "conversation": "conv_1"},
            "conversation",
            "previous_response_id",
            id="conversation",
        ),
        pytest.param(
            {"input": "x", "text": {"format": {"type": "xml"}}},
            "text.format",
            "json_schema",
            id="format",
        ),
    ],
)
def test_bad_requests_name_what_to_fix(body: dict[str, Any], param: str, says: str):
    with pytest.raises(BadRequest, match=says) as exc:
        build(**body)
    assert exc.value.param == param


@pytest.mark.parametrize(
    ("body", "param", "says"),
    [
        pytest.param(
            {"input": "x", "max_output_tokens": "9"},
            "max_output_tokens",
            "max_output_tokens",
            id="max",
        ),
        pytest.param(
            {"input": "x", "tools": [{"type": "function"}]},
            "tools[0].name",
            "tools[0].name",
            id="tool",
        ),
        pytest.param(
            {"input": "x", "temperature": "hot"}, "temperature", "temperature", id="temperature"
        ),
    ],
)
def test_chat_path_errors_name_the_responses_parameter(body: dict[str, Any], param: str, says: str):
    with pytest.raises(BadRequest, match=re.escape(says)) as exc:
        build(**body)
    assert exc.value.param == param


def test_previous_turn_rebuilds_the_conversation():
    prev = stored()
    req = build(prev, input="next", instructions="Be terse.")
    assert chat(req) == [
        ("system", "Be terse."),
        ("user", "hi"),
        ("assistant", "hello"),
        ("user", "next"),
    ]
    assert (req.new_from, req.session_id, req.extends) == (3, "resp_0", True)
    assert req.history[-1] == {"role": "user", "content": "next"}


@pytest.mark.parametrize(
    ("body", "extends"),
    [
        pytest.param({"instructions": "Be terse."}, True, id="same"),
        pytest.param({"instructions": "Be verbose."}, False, id="other-instructions"),
        pytest.param({}, False, id="no-instructions"),
        pytest.param({"instructions": "Be terse.", "tools": [FN]}, False, id="tools-added"),
        pytest.param({"instructions": "Be terse.", "model": "other"}, False, id="other-model"),
    ],
)
def test_only_the_same_instructions_tools_and_model_extend(body: dict[str, Any], extends: bool):
    turn = responses.parse_input({"model": "tiny", "input": "next", **body})
    assert responses.build(turn, stored(), EXT, "resp_1", 512).extends is extends


def test_the_session_header_wins_then_the_chain_then_prompt_cache_key():
    turn = responses.parse_input({"input": "x", "prompt_cache_key": "k"})
    assert responses.build(turn, None, EXT, "resp_1", 8).session_id == "k"
    assert responses.build(turn, stored(), EXT, "resp_1", 8).session_id == "resp_0"
    ext = Extensions(session_id="hdr")
    assert responses.build(turn, stored(), ext, "resp_1", 8).session_id == "hdr"


def test_visibility_is_per_tenant():
    assert responses.visible(stored(), "team") is not None
    assert responses.visible(stored(), "other") is None
    assert responses.visible(None, "team") is None


def test_not_found_errors_in_openai_shape():
    status, body = error_body(responses.previous_not_found("resp_x"))
    assert status == 404
    assert body["error"]["code"] == "previous_response_not_found"
    assert body["error"]["param"] == "previous_response_id"
    assert "resp_x" in body["error"]["message"]
    assert isinstance(responses.not_found("resp_y"), ResponseNotFound)
    assert error_body(responses.not_found("resp_y"))[0] == 404


def test_token_request_carries_ids_and_the_forced_constraint():
    req = build(input="hi", tools=[FN], tool_choice="required")
    out = token_request(req.chat, [5, 6, 7])
    assert out.WhichOneof("input") == "token_ids" and list(out.token_ids.ids) == [5, 6, 7]
    schema = json.loads(out.sampling.structured_output.json_schema)
    assert schema["type"] == "array" and schema["minItems"] == 1
    plain = token_request(build(input="hi").chat, [1])
    assert not plain.sampling.HasField("structured_output")


# ---- the answer -------------------------------------------------------------------------------
def chunks(texts: list[str], reason: int = common_pb2.FINISH_REASON_STOP) -> list[Any]:
    out = [router_pb2.GenerateResponse(text=t, token_ids=[100 + i]) for i, t in enumerate(texts)]
    last = router_pb2.GenerateResponse(token_ids=[4])
    last.finished.reason = reason
    last.finished.usage.CopyFrom(
        common_pb2.Usage(
            prompt_tokens=70, cached_prompt_tokens=32, completion_tokens=len(texts) + 1
        )
    )
    return [*out, last]


def collect(
    req: responses.ResponsesRequest, msgs: list[Any]
) -> tuple[dict[str, Any], ResponseCollector]:
    out = ResponseCollector(req, 1000, 32, True)
    for m in msgs:
        out.feed(m)
    return out.response(), out


def test_a_text_answer():
    body, out = collect(build(input="hi", instructions="I."), chunks(["Hel", "lo"]))
    assert body["status"] == "completed" and body["incomplete_details"] is None
    assert body["output"][0]["type"] == "message"
    assert body["output"][0]["content"][0]["text"] == "Hello"
    assert body["instructions"] == "I." and body["created_at"] == 1000
    assert body["usage"] == {
        "input_tokens": 70,
        "input_tokens_details": {"cached_tokens": 32, "cache_write_tokens": 32},
        "output_tokens": 3,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": 73,
    }
    assert body["kvmesh"]["prompt"] == "extended" and body["kvmesh"]["session_id"] == "resp_1"
    assert out.output_ids == [100, 101, 4]


def test_cut_by_max_output_tokens_is_incomplete():
    body, _ = collect(build(input="hi"), chunks(["a"], common_pb2.FINISH_REASON_LENGTH))
    assert body["status"] == "incomplete"
    assert body["incomplete_details"] == {"reason": "max_output_tokens"}


def test_an_aborted_answer_is_unavailable():
    with pytest.raises(errors.Unavailable):
        collect(build(input="hi"), chunks(["a"], common_pb2.FINISH_REASON_ABORT))


def test_hermes_tool_calls_become_function_call_items_and_the_stored_history():
    req = build(input="hi", tools=[FN])
    text = '<tool_call>\n{"name": "weather", "arguments": {"city": "Rome"}}\n</tool_call>'
    body, out = collect(req, chunks([text]))
    call = body["output"][0]
    assert (call["type"], call["name"], json.loads(call["arguments"])) == (
        "function_call",
        "weather",
        {"city": "Rome"},
    )
    assert call["call_id"].startswith("call_") and call["id"].startswith("fc_")
    rec = responses.record(req, body, 2.0, [1, 2], out.output_ids)
    assert rec.history[-1]["tool_calls"][0]["id"] == call["call_id"]
    assert (rec.tenant, rec.session_id, list(rec.prompt_ids)) == ("team", "resp_1", [1, 2])


def test_the_event_stream():
    req = build(input="hi", stream=True)
    out = ResponseEvents(req, 1000, 32, False)
    events = out.start()
    for m in chunks(["Hel", "lo"]):
        events += out.feed(m)
    kinds = [k for k, _ in events]
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [d["sequence_number"] for _, d in events] == list(range(len(events)))
    assert events[0][1]["response"]["status"] == "in_progress"
    final = events[-1][1]["response"]
    assert final["output"][0]["content"][0]["text"] == "Hello"
    assert final["output"][0]["id"] == events[2][1]["item"]["id"]
    assert out.final is final and out.output_ids == [100, 101, 4]


def test_a_streamed_forced_call():
    req = build(
        input="hi", tools=[FN], tool_choice={"type": "function", "name": "weather"}, stream=True
    )
    out = ResponseEvents(req, 1000)
    events = out.start()
    for m in chunks(['{"city":', '"Rome"}']):
        events += out.feed(m)
    kinds = [k for k, _ in events]
    assert kinds[2:] == [
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    item = events[-1][1]["response"]["output"][0]
    assert (item["name"], item["arguments"], item["status"]) == (
        "weather",
        '{"city":"Rome"}',
        "completed",
    )
    assert out.error({"error": {"code": "x", "message": "m"}})[1]["type"] == "error"


NAMESPACE: Any = {
    "type": "namespace",
    "name": "multi_agent_v1",
    "description": "Sub-agents",
    "tools": [{**FN, "name": "spawn_agent"}, {"type": "custom", "name": "freeform"}],
}


def test_codex_tools_built_in_ones_are_not_offered_namespaced_calls_name_their_namespace():
    """What Codex sends: function tools, a namespace of functions, and web_search (which kvmesh
    does not run): the functions (the namespace's too) are offered, the rest is not."""
    web = {"type": "web_search", "external_web_access": False}
    req = build(input="hi", tools=[FN, NAMESPACE, web])
    offered = [t.name for t in req.chat.generate.chat.tools]
    assert offered == ["weather", "spawn_agent"]
    assert req.input.namespaces == {"spawn_agent": "multi_agent_v1"}
    text = (
        '<tool_call>\n{"name": "spawn_agent", "arguments": {"city": "Rome"}}\n</tool_call>'
        '<tool_call>\n{"name": "weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    )
    body, _ = collect(req, chunks([text]))
    calls = [(c["name"], c.get("namespace")) for c in body["output"]]
    assert calls == [("spawn_agent", "multi_agent_v1"), ("weather", None)]
    assert body["tools"][1:] == [NAMESPACE, web]  # echoed as sent
    # Streamed, the item names its namespace from its first event.
    out = ResponseEvents(build(input="hi", tools=[NAMESPACE], stream=True), 1000, 32, False)
    events = out.start()
    for m in chunks([text.split("<tool_call>", 2)[1].join(["<tool_call>", ""])]):
        events += out.feed(m)
    added = [d["item"] for k, d in events if k == "response.output_item.added"]
    assert added[0]["namespace"] == "multi_agent_v1"
