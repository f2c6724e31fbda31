"""Anthropic Messages -> the router's request, and the router's answer -> Anthropic's message and
event stream (services/router/http/anthropic.py, anthropic_stream.py). Pure: every rule a row."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

from kvmesh import errors
from kvmesh.v1 import common_pb2, router_pb2
from services.router.core.auth import Identity
from services.router.core.forced_tools import ForcedKind
from services.router.http import anthropic
from services.router.http.anthropic_stream import EventStream, MessageCollector
from services.router.http.errors import BadRequest, Unauthorized
from services.router.http.extensions import Extensions

EXT = Extensions()
HI = [{"role": "user", "content": "hi"}]
WEATHER = {
    "name": "weather",
    "description": "The weather",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
    "cache_control": {"type": "ephemeral"},
}


def parse(**body: Any) -> anthropic.MessagesRequest:
    return anthropic.parse_messages({"model": "tiny", "max_tokens": 8, **body}, EXT, "msg_1")


def messages(req: anthropic.MessagesRequest) -> list[router_pb2.ChatMessage]:
    return list(req.chat.generate.chat.messages)


def test_plain_request_becomes_a_chat_request():
    req = parse(messages=HI, temperature=0.5, top_p=0.9, top_k=7, stream=True)
    g = req.chat.generate
    assert (req.id, req.model, req.stream, g.request_id) == ("msg_1", "tiny", True, "msg_1")
    assert (g.sampling.max_tokens, g.sampling.top_k) == (8, 7)
    assert g.sampling.temperature == pytest.approx(0.5)
    assert g.sampling.top_p == pytest.approx(0.9)
    assert [(m.role, m.content) for m in messages(req)] == [("user", "hi")]


@pytest.mark.parametrize(
    ("system", "expected"),
    [
        pytest.param("Be brief.", [("system", "Be brief.")], id="string"),
        pytest.param(
            [
                {"type": "text", "text": "x-anthropic-billing-header: cc_version=1; cch=abc"},
                {"type": "text", "text": "Be ", "cache_control": {"type": "ephemeral"}},
                {"type": "text", "text": "brief."},
            ],
            [("system", "Be brief.")],
            id="blocks-billing-line-dropped",
        ),
        pytest.param(None, [], id="absent"),
    ],
)
def test_system(system: Any, expected: list[tuple[str, str]]):
    req = parse(system=system, messages=HI)
    assert [(m.role, m.content) for m in messages(req)] == [*expected, ("user", "hi")]


def test_tool_use_and_tool_result_become_tool_calls_and_tool_messages():
    req = parse(
        tools=[WEATHER],
        messages=[
            {"role": "user", "content": [{"type": "text", "text": "Weather?"}]},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "hm", "signature": "s"},
                    {"type": "text", "text": "Let me look."},
                    {
                        "type": "tool_use",
                        "id": "toolu_1",
                        "name": "weather",
                        "input": {"city": "Paris"},
                    },
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"},
                    {
                        "type": "tool_result",
                        "tool_use_id": "toolu_2",
                        "content": [{"type": "text", "text": "no"}],
                        "is_error": True,
                    },
                    {"type": "text", "text": "And Rome?"},
                ],
            },
        ],
    )
    got = messages(req)
    assert [(m.role, m.content, m.tool_call_id) for m in got] == [
        ("user", "Weather?", ""),
        ("assistant", "Let me look.", ""),
        ("tool", "sunny", "toolu_1"),
        ("tool", "Error: no", "toolu_2"),
        ("user", "And Rome?", ""),
    ]
    (call,) = got[1].tool_calls
    assert (call.id, call.name, json.loads(call.arguments)) == (
        "toolu_1",
        "weather",
        {"city": "Paris"},
    )
    (tool,) = req.chat.generate.chat.tools
    assert (tool.name, tool.description) == ("weather", "The weather")
    assert json.loads(tool.parameters_json) == WEATHER["input_schema"]
    assert req.chat.parse_tool_calls and req.chat.forced is None


@pytest.mark.parametrize(
    ("choice", "mode", "forced"),
    [
        pytest.param({"type": "auto"}, router_pb2.TOOL_CHOICE_MODE_AUTO, None, id="auto"),
        pytest.param(
            {"type": "any", "disable_parallel_tool_use": True},
            router_pb2.TOOL_CHOICE_MODE_REQUIRED,
            ForcedKind.REQUIRED,
            id="any",
        ),
        pytest.param(
            {"type": "tool", "name": "weather"},
            router_pb2.TOOL_CHOICE_MODE_FUNCTION,
            ForcedKind.FUNCTION,
            id="tool",
        ),
        pytest.param({"type": "none"}, router_pb2.TOOL_CHOICE_MODE_NONE, None, id="none"),
    ],
)
def test_tool_choice(choice: Any, mode: int, forced: ForcedKind | None):
    req = parse(messages=HI, tools=[WEATHER], tool_choice=choice)
    assert req.chat.generate.chat.tool_choice.mode == mode
    assert (req.chat.forced.kind if req.chat.forced else None) == forced
    assert req.chat.parse_tool_calls == (choice["type"] != "none")


def test_stop_sequences_beyond_openais_four_and_the_session():
    stops = [f"s{i}" for i in range(6)]
    req = parse(messages=HI, stop_sequences=stops, metadata={"user_id": "user_a_session_b"})
    assert list(req.chat.generate.sampling.stop) == stops
    assert req.stop_sequences == tuple(stops)
    assert req.chat.generate.session_id == "user_a_session_b"
    header = anthropic.parse_messages(
        {"max_tokens": 4, "messages": HI, "metadata": {"user_id": "u"}},
        Extensions(session_id="from-header"),
        "msg_2",
    )
    assert header.chat.generate.session_id == "from-header"


def test_a_cache_control_marker_names_a_session_after_the_conversations_start():
    system = [{"type": "text", "text": "You are a coder.", "cache_control": {"type": "ephemeral"}}]
    turn1 = [{"role": "user", "content": "fix the bug"}]
    turn2 = [
        *turn1,
        {"role": "assistant", "content": "done"},
        {"role": "user", "content": [{"type": "text", "text": "now test it"}]},
    ]
    first = parse(system=system, messages=turn1).chat.generate.session_id
    second = parse(system=system, messages=turn2).chat.generate.session_id
    assert first.startswith(anthropic.CACHE_SESSION_PREFIX)
    assert first == second  # every later turn resends the same start
    other = parse(system=[{**system[0], "text": "You review."}], messages=turn1)
    assert other.chat.generate.session_id not in ("", first)
    # a marker on a content block counts too; no marker: no session
    marked = [{"role": "user", "content": [{"type": "text", "text": "x", "cache_control": {}}]}]
    assert parse(messages=marked).chat.generate.session_id.startswith("anthropic-cache-")
    assert parse(messages=turn1).chat.generate.session_id == ""
    # the client's own session wins: metadata.user_id, then the header
    assert (
        parse(system=system, messages=turn1, metadata={"user_id": "u1"}).chat.generate.session_id
        == "u1"
    )
    header = anthropic.parse_messages(
        {"max_tokens": 4, "system": system, "messages": turn1}, Extensions(session_id="h"), "msg_3"
    )
    assert header.chat.generate.session_id == "h"


def test_max_tokens_is_an_upper_bound_the_context_may_cut_short():
    """Claude Code sends max_tokens 32000 whatever the model's context: the router lowers it to
    the room the prompt leaves (fit_max_tokens), and an answer cut there, short of max_tokens,
    says model_context_window_exceeded, streamed or not."""
    req = parse(messages=HI, max_tokens=32000)
    assert req.chat.generate.fit_max_tokens and req.max_tokens == 32000
    length = common_pb2.FINISH_REASON_LENGTH
    assert collect(req, chunks(["a", "b"], reason=length))["stop_reason"] == (
        "model_context_window_exceeded"
    )
    streamed = parse(messages=HI, max_tokens=32000, stream=True)
    got = events(streamed, chunks(["a"], reason=length))
    assert got[-2][1]["delta"]["stop_reason"] == "model_context_window_exceeded"
    assert collect(parse(messages=HI, max_tokens=2), chunks(["a", "b"], reason=length))[
        "stop_reason"
    ] == ("max_tokens")


def test_a_mid_conversation_system_turn_is_a_system_message():
    # Claude Code sends its environment so, after the first user message.
    req = parse(
        system="You are a coder.",
        messages=[
            {"role": "user", "content": "fix it"},
            {"role": "system", "content": [{"type": "text", "text": "# Environment"}]},
        ],
    )
    got = [(m.role, m.content) for m in messages(req)]
    assert got == [("system", "You are a coder."), ("user", "fix it"), ("system", "# Environment")]


@pytest.mark.parametrize(
    ("markers", "ttl_s"),
    [
        ([{"type": "ephemeral"}], 0.0),
        ([{"type": "ephemeral", "ttl": "5m"}], 300.0),
        ([{"type": "ephemeral", "ttl": "1h"}, {"type": "ephemeral", "ttl": "5m"}], 3600.0),
        ([{"type": "ephemeral", "ttl": "5m"}, {"type": "ephemeral"}], 300.0),
        ([], 0.0),
    ],
    ids=["no-ttl", "5m", "longest-wins", "5m-and-none", "no-marker"],
)
def test_a_cache_control_ttl_is_the_sessions_retention(markers: list[Any], ttl_s: float):
    system = [
        {"type": "text", "text": f"block {i}", "cache_control": m} for i, m in enumerate(markers)
    ]
    req = parse(system=system or "plain", messages=HI, metadata={"user_id": "u"})
    assert req.chat.generate.retention_ttl_s == ttl_s
    assert req.chat.generate.session_id == "u"


def test_a_cache_control_ttl_on_a_message_block_counts_and_a_bad_one_is_a_400():
    marked = [{"type": "text", "text": "x", "cache_control": {"type": "ephemeral", "ttl": "1h"}}]
    req = parse(messages=[{"role": "user", "content": marked}])
    assert req.chat.generate.retention_ttl_s == 3600.0
    assert req.chat.generate.session_id.startswith(anthropic.CACHE_SESSION_PREFIX)
    for bad in ("10m", 300, ""):
        marked[0]["cache_control"] = {"type": "ephemeral", "ttl": bad}
        with pytest.raises(BadRequest, match=r"cache_control\.ttl: .* use '5m' or '1h'"):
            parse(messages=[{"role": "user", "content": marked}])
    marked[0]["cache_control"] = "ephemeral"
    with pytest.raises(BadRequest, match="cache_control: must be an object"):
        parse(messages=[{"role": "user", "content": marked}])


@pytest.mark.parametrize(
    ("body", "says"),
    [
        pytest.param({"messages": HI}, "max_tokens: Field required", id="no-max_tokens"),
        pytest.param({"messages": HI, "max_tokens": "8"}, "max_tokens", id="max_tokens-str"),
        pytest.param({"messages": [], "max_tokens": 8}, "messages", id="no-messages"),
        pytest.param(
            {"messages": [{"role": "tool", "content": "x"}], "max_tokens": 8},
            "use 'user', 'assistant' or 'system'",
            id="tool-role",
        ),
        pytest.param(
            {"messages": [*HI, {"role": "assistant", "content": "{"}], "max_tokens": 8},
            "prefill",
            id="last-assistant",
        ),
        pytest.param(
            {
                "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}],
                "max_tokens": 8,
            },
            "'image' blocks are not supported",
            id="image",
        ),
        pytest.param(
            {
                "messages": HI,
                "max_tokens": 8,
                "tools": [{"type": "web_search_20250305", "name": "web_search"}],
            },
            "only custom tools",
            id="server-tool",
        ),
        pytest.param(
            {"messages": HI, "max_tokens": 8, "tools": [WEATHER], "tool_choice": {"type": "x"}},
            "tool_choice.type",
            id="bad-choice",
        ),
        pytest.param(
            {
                "messages": HI,
                "max_tokens": 8,
                "tools": [WEATHER],
                "tool_choice": {"type": "tool", "name": "clock"},
            },
            "not one of the tools",
            id="unknown-tool",
        ),
        pytest.param(
            {
                "messages": [
                    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": ""}]}
                ],
                "max_tokens": 8,
            },
            "tool_use_id",
            id="result-without-id",
        ),
        pytest.param(
            {"messages": HI, "max_tokens": 8, "stop_sequences": "END"},
            "stop_sequences",
            id="stop-string",
        ),
        pytest.param(
            {"messages": HI, "max_tokens": 8, "mcp_servers": [{"url": "x"}]},
            "mcp_servers",
            id="mcp",
        ),
    ],
)
def test_bad_requests(body: dict[str, Any], says: str):
    with pytest.raises(BadRequest, match=re.escape(says)):
        anthropic.parse_messages(body, EXT, "msg_1")


def test_output_config_format_is_the_structured_output():
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}}
    req = parse(
        messages=HI,
        output_config={"effort": "low", "format": {"type": "json_schema", "schema": schema}},
    )
    out = req.chat.generate.sampling.structured_output
    assert json.loads(out.json_schema) == schema
    with pytest.raises(BadRequest, match=r"output_config\.format\.type"):
        parse(messages=HI, output_config={"format": {"type": "xml"}})


def test_count_tokens_needs_no_max_tokens():
    chat = anthropic.parse_count_tokens({"model": "tiny", "messages": HI}, EXT, "msg_1")
    assert chat.generate.sampling.max_tokens == 1
    assert not chat.stream


def test_x_api_key_is_the_api_key():
    # keys configured: the middleware checked the key, its identity is what counts
    who = Identity(tenant="team-a", priority=2)
    ext = anthropic.extensions_from_headers({"x-api-key": "sk-a"}, who)
    assert (ext.tenant, ext.priority) == ("team-a", 2)
    # an open router: x-api-key names the tenant as Authorization would
    open_ = anthropic.extensions_from_headers({"x-api-key": "sk-b", "anthropic-version": "x"})
    bearer = anthropic.extensions_from_headers({"authorization": "Bearer sk-b"})
    assert open_.tenant.startswith("key-") and open_.tenant == bearer.tenant


@pytest.mark.parametrize(
    ("prompt", "cached", "block", "expected"),
    [
        pytest.param(100, 0, 32, (4, 96, 0), id="cold"),
        pytest.param(100, 64, 32, (4, 32, 64), id="warm"),
        pytest.param(100, 96, 32, (4, 0, 96), id="all-whole-blocks-cached"),
        pytest.param(64, 32, 32, (0, 32, 32), id="whole-blocks"),
        pytest.param(100, 40, 0, (0, 60, 40), id="block-size-unknown"),
    ],
)
def test_usage_adds_up_to_the_prompt(
    prompt: int, cached: int, block: int, expected: tuple[int, int, int]
):
    usage = common_pb2.Usage(prompt_tokens=prompt, cached_prompt_tokens=cached, completion_tokens=3)
    got = anthropic.usage_json(usage, block)
    assert (
        got["input_tokens"],
        got["cache_creation_input_tokens"],
        got["cache_read_input_tokens"],
    ) == expected
    assert got["output_tokens"] == 3
    assert sum(expected) == prompt


@pytest.mark.parametrize(
    ("finish", "matched", "calls", "expected"),
    [
        pytest.param("stop", None, False, ("end_turn", None), id="eos"),
        pytest.param("stop", "END", False, ("stop_sequence", "END"), id="stop-sequence"),
        pytest.param("stop", "151645", False, ("end_turn", None), id="stop-token"),
        pytest.param("length", None, True, ("max_tokens", None), id="length"),
        pytest.param("tool_calls", None, True, ("tool_use", None), id="calls"),
        pytest.param("stop", "END", True, ("tool_use", None), id="calls-then-stop"),
    ],
)
def test_stop_reason(finish: str, matched: str | None, calls: bool, expected: tuple[Any, ...]):
    assert anthropic.stop_reason(finish, matched, calls, ("END",)) == expected


@pytest.mark.parametrize(
    ("exc", "status", "kind"),
    [
        pytest.param(BadRequest("bad"), 400, "invalid_request_error", id="bad"),
        pytest.param(Unauthorized("key"), 401, "authentication_error", id="key"),
        pytest.param(errors.NotFound("model"), 404, "not_found_error", id="model"),
        pytest.param(errors.ResourceExhausted("slow"), 429, "rate_limit_error", id="rate"),
        pytest.param(errors.Unavailable("no worker"), 529, "overloaded_error", id="unavailable"),
        pytest.param(errors.DeadlineExceeded("late"), 504, "timeout_error", id="deadline"),
        pytest.param(RuntimeError("secret"), 500, "api_error", id="internal"),
    ],
)
def test_error_body(exc: BaseException, status: int, kind: str):
    got_status, body = anthropic.error_body(exc, "rid-1")
    assert (got_status, body["type"], body["error"]["type"]) == (status, "error", kind)
    assert body["request_id"] == "rid-1"
    if status == 500:
        assert "secret" not in body["error"]["message"]


# ---- the answer ---------------------------------------------------------------------------------
def chunks(
    texts: list[str],
    reason: int = common_pb2.FINISH_REASON_STOP,
    stop_reason: str = "",
) -> list[router_pb2.GenerateResponse]:
    out = [router_pb2.GenerateResponse(text=t) for t in texts]
    last = router_pb2.GenerateResponse()
    last.finished.reason = reason
    last.finished.stop_reason = stop_reason
    last.finished.usage.CopyFrom(
        common_pb2.Usage(
            prompt_tokens=70, cached_prompt_tokens=32, completion_tokens=len(texts), worker_id="w"
        )
    )
    return [*out, last]


def collect(req: anthropic.MessagesRequest, msgs: list[router_pb2.GenerateResponse]) -> Any:
    out = MessageCollector(req, 32)
    for m in msgs:
        out.feed(m)
    assert out.finished
    return out.message()


def events(
    req: anthropic.MessagesRequest, msgs: list[router_pb2.GenerateResponse]
) -> list[tuple[str, dict[str, Any]]]:
    out = EventStream(req, 32)
    got = out.start()
    for m in msgs:
        got += out.feed(m)
    assert out.finished
    for name, data in got:
        assert name == data["type"]
    return got


def test_text_answer_whole_and_streamed():
    req = parse(messages=HI, stop_sequences=["END"])
    msgs = chunks(["Hel", "lo"], stop_reason="END")
    body = collect(req, msgs)
    assert body["content"] == [{"type": "text", "text": "Hello"}]
    assert (body["stop_reason"], body["stop_sequence"]) == ("stop_sequence", "END")
    assert body["usage"] == {
        "input_tokens": 6,
        "output_tokens": 2,
        "cache_creation_input_tokens": 32,
        "cache_read_input_tokens": 32,
    }
    assert (body["id"], body["type"], body["role"], body["model"]) == (
        "msg_1",
        "message",
        "assistant",
        "tiny",
    )
    assert body["kvmesh"]["worker_id"] == "w"

    got = events(parse(messages=HI, stream=True, stop_sequences=["END"]), msgs)
    assert [name for name, _ in got] == [
        "message_start",
        "ping",
        "content_block_start",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert got[0][1]["message"]["id"] == "msg_1"
    assert got[2][1]["content_block"] == {"type": "text", "text": ""}
    assert [d["delta"] for _, d in got[3:5]] == [
        {"type": "text_delta", "text": "Hel"},
        {"type": "text_delta", "text": "lo"},
    ]
    assert got[6][1]["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": "END"}
    assert got[6][1]["usage"] == body["usage"]


HERMES = [
    "Sure.",
    '<tool_call>\n{"name": "weather", "arguments": {"city": "Paris"}}\n</tool_call>',
]


def test_auto_tool_calls_become_tool_use_blocks():
    body = collect(parse(messages=HI, tools=[WEATHER]), chunks(HERMES))
    assert body["stop_reason"] == "tool_use"
    text, call = body["content"]
    assert text == {"type": "text", "text": "Sure."}
    assert (call["type"], call["name"], call["input"]) == ("tool_use", "weather", {"city": "Paris"})
    assert call["id"].startswith("toolu_")

    got = events(parse(messages=HI, tools=[WEATHER], stream=True), chunks(HERMES))
    starts = [d["content_block"] for n, d in got if n == "content_block_start"]
    assert [b["type"] for b in starts] == ["text", "tool_use"]
    assert (starts[1]["name"], starts[1]["input"]) == ("weather", {})
    (args,) = [d["delta"] for n, d in got if d.get("delta", {}).get("type") == "input_json_delta"]
    assert json.loads(args["partial_json"]) == {"city": "Paris"}
    stops = [d["index"] for n, d in got if n == "content_block_stop"]
    assert stops == [0, 1]
    assert got[-2][1]["delta"]["stop_reason"] == "tool_use"


def test_forced_calls():
    named = parse(messages=HI, tools=[WEATHER], tool_choice={"type": "tool", "name": "weather"})
    body = collect(named, chunks(['{"city":', ' "Rome"}']))
    assert [(b["type"], b["input"]) for b in body["content"]] == [("tool_use", {"city": "Rome"})]
    assert body["stop_reason"] == "tool_use"

    streamed = parse(
        messages=HI, tools=[WEATHER], tool_choice={"type": "tool", "name": "weather"}, stream=True
    )
    got = events(streamed, chunks(['{"city":', ' "Rome"}']))
    parts = [d["delta"]["partial_json"] for n, d in got if n == "content_block_delta"]
    assert parts == ['{"city":', ' "Rome"}']
    assert got[-2][1]["delta"]["stop_reason"] == "tool_use"

    forced: Any = {"tools": [WEATHER], "tool_choice": {"type": "tool", "name": "weather"}}
    named = parse(messages=HI, max_tokens=1, **forced)  # cut by max_tokens: 1 of 1 tokens
    cut = collect(named, chunks(['{"city":'], reason=common_pb2.FINISH_REASON_LENGTH))
    assert cut["content"] == [{"type": "text", "text": '{"city":'}]
    assert cut["stop_reason"] == "max_tokens"
    streamed = parse(messages=HI, max_tokens=1, stream=True, **forced)
    got = events(streamed, chunks(['{"city":'], reason=common_pb2.FINISH_REASON_LENGTH))
    assert got[-2][1]["delta"]["stop_reason"] == "max_tokens"

    any_ = parse(messages=HI, tools=[WEATHER], tool_choice={"type": "any"})
    body = collect(any_, chunks(['[{"name": "weather", "parameters": {"city": "Oslo"}}]']))
    assert [(b["name"], b["input"]) for b in body["content"]] == [("weather", {"city": "Oslo"})]
    assert body["stop_reason"] == "tool_use"


def test_an_aborted_answer_is_overloaded():
    aborted = chunks(["Hel"], reason=common_pb2.FINISH_REASON_ABORT)
    with pytest.raises(errors.Unavailable):
        collect(parse(messages=HI), aborted)
    with pytest.raises(errors.Unavailable):
        events(parse(messages=HI, stream=True), aborted)
