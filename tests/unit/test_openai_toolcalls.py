"""Tool calls out of a completion: the hermes-style parser (whole and streamed, which must
agree), the OpenAI shapes the translator makes of them, and the HTTP server over a fake router,
read by the official openai client."""

from __future__ import annotations

import itertools
import json
from collections.abc import AsyncIterator
from typing import Any

import openai
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvmesh.v1 import common_pb2, router_pb2
from services.router.http import OpenAIServer, parsing, rendering
from services.router.http.parsing import Kind
from services.router.http.toolcalls import Call, StreamParser, Text, parse, parse_call

from .test_openai_server import FakeRouter

WEATHER = '<tool_call>\n{"name": "weather", "arguments": {"city": "Paris"}}\n</tool_call>'
WEATHER_CALL = Call("weather", '{"city": "Paris"}')

# ---- the parser ------------------------------------------------------------------------------
PARSE = [
    pytest.param("Hello there.\n", "Hello there.\n", [], id="plain-text-unchanged"),
    pytest.param(WEATHER, "", [WEATHER_CALL], id="one-call"),
    pytest.param(
        "Let me check.\n" + WEATHER + "\n" + WEATHER.replace("Paris", "Rome") + "\n",
        "Let me check.",
        [WEATHER_CALL, Call("weather", '{"city": "Rome"}')],
        id="text-then-two-calls",
    ),
    pytest.param(WEATHER + "\nDone.", "Done.", [WEATHER_CALL], id="text-after-the-call"),
    pytest.param(
        '<tool_call>{"name": "now"}</tool_call>', "", [Call("now", "{}")], id="no-arguments"
    ),
    pytest.param(
        '<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>',
        "",
        [Call("f", '{"x": 1}')],
        id="arguments-as-json-text",
    ),
    pytest.param(
        '<tool_call>{"name": "f", "parameters": {"x": 1}}</tool_call>',
        "",
        [Call("f", '{"x": 1}')],
        id="parameters-spelling",
    ),
    pytest.param(
        '<tool_call>{"name": "f", "arguments": {"q": "café ☕"}}</tool_call>',
        "",
        [Call("f", '{"q": "café ☕"}')],
        id="unicode-kept",
    ),
    pytest.param(
        "A <tool_call>{not json}</tool_call> B",
        "A <tool_call>{not json}</tool_call> B",
        [],
        id="malformed-json-stays-text",
    ),
    pytest.param(
        'x <tool_call>{"arguments": {}}</tool_call>',
        'x <tool_call>{"arguments": {}}</tool_call>',
        [],
        id="no-name-stays-text",
    ),
    pytest.param(
        '<tool_call>{"name": "f", "arguments": [1]}</tool_call>',
        '<tool_call>{"name": "f", "arguments": [1]}</tool_call>',
        [],
        id="list-arguments-stay-text",
    ),
    pytest.param(
        '<tool_call>{"name": "f", "arguments": "x"}</tool_call>',
        '<tool_call>{"name": "f", "arguments": "x"}</tool_call>',
        [],
        id="string-arguments-not-json-stay-text",
    ),
    pytest.param(
        '<tool_call>[{"name": "f"}]</tool_call>',
        '<tool_call>[{"name": "f"}]</tool_call>',
        [],
        id="not-an-object-stays-text",
    ),
    pytest.param(
        'bad <tool_call>{oops}</tool_call>\n<tool_call>{"name": "f"}</tool_call>',
        "bad <tool_call>{oops}</tool_call>",
        [Call("f", "{}")],
        id="malformed-beside-a-good-call",
    ),
    pytest.param(
        '<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n',
        "",
        [Call("f", '{"x": 1}')],
        id="unclosed-at-the-end-parses",
    ),
    pytest.param(
        '<tool_call>\n{"name": "f", "argum',
        '<tool_call>\n{"name": "f", "argum',
        [],
        id="truncated-stays-text",
    ),
    pytest.param("a <tool", "a <tool", [], id="partial-tag-at-the-end"),
    pytest.param("1 < 2 <tools>", "1 < 2 <tools>", [], id="lookalike-tags"),
]


@pytest.mark.parametrize(("text", "content", "calls"), PARSE)
def test_parse(text: str, content: str, calls: list[Call]):
    assert parse(text) == (content, calls)


@pytest.mark.parametrize(("text", "content", "calls"), PARSE)
def test_streamed_one_character_at_a_time_agrees(text: str, content: str, calls: list[Call]):
    parser = StreamParser()
    pieces = [p for ch in text for p in parser.feed(ch)] + parser.finish()
    assert [p for p in pieces if isinstance(p, Call)] == calls
    streamed = "".join(p.text for p in pieces if isinstance(p, Text))
    assert (streamed.strip() if calls else streamed) == content
    assert parser.calls == len(calls)


def test_text_that_may_open_a_tag_waits_until_known():
    parser = StreamParser()
    assert parser.feed("Sure <tool") == [Text("Sure")]  # the space waits too
    assert parser.feed("box> ok") == [Text(" <toolbox> ok")]
    assert parser.feed(" <tool_") == []
    assert parser.feed('call>{"name": "f"}') == []
    assert parser.feed("</tool_call>\n") == [Call("f", "{}")]
    assert parser.finish() == []  # whitespace after the last call is dropped


def test_parse_call_reads_one_block():
    assert parse_call(' {"name": "f", "arguments": {}} ') == Call("f", "{}")
    assert parse_call('{"name": ""}') is None
    assert parse_call("") is None


_PIECES = st.sampled_from(
    [
        *("<tool_call>", "</tool_call>", "<tool", "_call>", "</tool", "<", ">"),
        *('{"name": "f"}', '"arguments": {"x": 1}', "{", "}", " ", "\n", "hi", "é"),
    ]
)


@given(pieces=st.lists(_PIECES, max_size=12), cuts=st.lists(st.integers(0, 200), max_size=6))
def test_any_split_gives_the_same_answer(pieces: list[str], cuts: list[int]):
    """However the text is cut into deltas, the stream finds the calls the whole parse finds, and
    without calls it hands back the text unchanged."""
    text = "".join(pieces)
    bounds = sorted({0, len(text), *(c % (len(text) + 1) for c in cuts)})
    parser = StreamParser()
    out = [p for a, b in itertools.pairwise(bounds) for p in parser.feed(text[a:b])]
    out += parser.finish()
    content, calls = parse(text)
    assert [p for p in out if isinstance(p, Call)] == calls
    streamed = "".join(p.text for p in out if isinstance(p, Text))
    if calls:
        assert streamed.strip() == content
    else:
        assert streamed == text == content


# ---- the translator ----------------------------------------------------------------------------
def stream_of(*texts: str, reason: int = common_pb2.FINISH_REASON_STOP):
    msgs = [router_pb2.GenerateResponse(request_id="rid", text=t) for t in texts]
    last = router_pb2.GenerateResponse(request_id="rid")
    last.finished.reason = reason
    last.finished.usage.CopyFrom(common_pb2.Usage(prompt_tokens=5, completion_tokens=len(texts)))
    return [*msgs, last]


def ids() -> Any:
    n = itertools.count()
    return lambda: f"call_{next(n)}"


def translator(stream: bool, tools: bool = True) -> rendering.ResponseTranslator:
    request = parsing.ParsedRequest(
        Kind.CHAT, "rid", "tiny", stream, False, router_pb2.GenerateRequest(), tools
    )
    return rendering.ResponseTranslator(request, created=1, call_id=ids())


@pytest.mark.parametrize(
    ("texts", "reason", "message", "finish"),
    [
        pytest.param(
            ["I will check.", "\n" + WEATHER],
            common_pb2.FINISH_REASON_STOP,
            {
                "role": "assistant",
                "content": "I will check.",
                "tool_calls": [
                    {
                        "id": "call_0",
                        "type": "function",
                        "function": {"name": "weather", "arguments": '{"city": "Paris"}'},
                    }
                ],
            },
            "tool_calls",
            id="content-and-call",
        ),
        pytest.param(
            [WEATHER, WEATHER],
            common_pb2.FINISH_REASON_STOP,
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": f"call_{i}",
                        "type": "function",
                        "function": {"name": "weather", "arguments": '{"city": "Paris"}'},
                    }
                    for i in range(2)
                ],
            },
            "tool_calls",
            id="only-calls-null-content",
        ),
        pytest.param(
            ["<tool_call>{bad}</tool_call>"],
            common_pb2.FINISH_REASON_STOP,
            {"role": "assistant", "content": "<tool_call>{bad}</tool_call>"},
            "stop",
            id="malformed-is-content",
        ),
        pytest.param(
            [WEATHER],
            common_pb2.FINISH_REASON_ABORT,
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_0",
                        "type": "function",
                        "function": {"name": "weather", "arguments": '{"city": "Paris"}'},
                    }
                ],
            },
            "abort",
            id="abort-stays-abort",
        ),
    ],
)
def test_response_with_tool_calls(
    texts: list[str], reason: int, message: dict[str, Any], finish: str
):
    tr = translator(stream=False)
    for m in stream_of(*texts, reason=reason):
        tr.feed(m)
    choice = tr.response()["choices"][0]
    assert (choice["message"], choice["finish_reason"]) == (message, finish)


def test_without_tools_the_text_is_the_answer():
    tr = translator(stream=False, tools=False)
    for m in stream_of(WEATHER):
        tr.feed(m)
    choice = tr.response()["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": WEATHER}
    assert choice["finish_reason"] == "stop"


def test_stream_chunks_with_tool_calls():
    tr = translator(stream=True)
    texts = ["Let me", " look.", "\n<tool_", 'call>\n{"name": "weather", ', '"arguments": {}}']
    texts += ["\n</tool_call>", "\n<tool_call>", '{"name": "b"}']  # unclosed at the end
    out = [c for m in stream_of(*texts) for c in tr.feed(m)]
    deltas = [(c["choices"][0]["delta"], c["choices"][0]["finish_reason"]) for c in out]
    call = {"type": "function", "function": {"name": "weather", "arguments": "{}"}}
    assert deltas == [
        ({"role": "assistant", "content": ""}, None),
        ({"content": "Let me"}, None),
        ({"content": " look."}, None),
        ({"tool_calls": [{"index": 0, "id": "call_0", **call}]}, None),
        (
            {
                "tool_calls": [
                    {
                        "index": 1,
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "b", "arguments": "{}"},
                    }
                ]
            },
            None,
        ),
        ({}, "tool_calls"),
    ]


def test_stream_without_calls_is_plain_text():
    tr = translator(stream=True)
    out = [c for m in stream_of("a <", "b", " c ") for c in tr.feed(m)]
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in out)
    assert text == "a <b c "
    assert out[-1]["choices"][0]["finish_reason"] == "stop"


# ---- through the HTTP server, read by the openai client -------------------------------------
@pytest.fixture
async def front() -> AsyncIterator[tuple[openai.AsyncOpenAI, FakeRouter]]:
    fake = FakeRouter()
    server = OpenAIServer(port=0, backend=fake)
    await server.start()
    try:
        async with openai.AsyncOpenAI(
            base_url=server.base_url, api_key="EMPTY", max_retries=0
        ) as client:
            yield client, fake
    finally:
        await server.close()


TOOLS: Any = [
    {
        "type": "function",
        "function": {
            "name": "weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]


async def test_http_tool_calls(front: tuple[openai.AsyncOpenAI, FakeRouter]):
    client, fake = front
    fake.texts = ["Checking.\n<tool_call>\n", '{"name": "weather", "arguments": {"city": "Oslo"}}']
    fake.texts += ["\n</tool_call>"]
    resp = await client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Weather?"}], tools=TOOLS
    )
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Checking."
    calls = choice.message.tool_calls or []
    assert [(c.type, c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("function", "weather", {"city": "Oslo"})
    ]
    assert calls[0].id.startswith("call_") and len(calls[0].id) > 10
    chat = fake.requests[-1].chat
    assert [t.name for t in chat.tools] == ["weather"]
    assert json.loads(chat.tools[0].parameters_json)["properties"] == {"city": {"type": "string"}}

    stream = await client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Weather?"}], tools=TOOLS, stream=True
    )
    chunks = [c async for c in stream]
    content = "".join(c.choices[0].delta.content or "" for c in chunks)
    streamed = [t for c in chunks for t in c.choices[0].delta.tool_calls or []]
    assert content == "Checking."
    assert [(t.index, t.function and t.function.name) for t in streamed] == [(0, "weather")]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


async def test_http_tool_choice_none_returns_text(front: tuple[openai.AsyncOpenAI, FakeRouter]):
    client, fake = front
    fake.texts = [WEATHER]
    resp = await client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "x"}], tools=TOOLS, tool_choice="none"
    )
    assert resp.choices[0].message.content == WEATHER and not resp.choices[0].message.tool_calls
    assert resp.choices[0].finish_reason == "stop"


async def test_http_history_with_tool_calls_travels_structured(
    front: tuple[openai.AsyncOpenAI, FakeRouter],
):
    client, fake = front
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "weather", "arguments": '{"city": "Oslo"}'},
    }
    await client.chat.completions.create(
        model="tiny",
        messages=[
            {"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "content": "cold"},
        ],
        tools=TOOLS,
    )
    sent = fake.requests[-1].chat.messages
    assert [(c.id, c.name, c.arguments) for c in sent[1].tool_calls] == [
        ("call_1", "weather", '{"city": "Oslo"}')
    ]
    assert (sent[1].content, sent[2].tool_call_id) == ("", "call_1")
    with pytest.raises(openai.BadRequestError) as err:
        await client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "x"}],
            tools=TOOLS,
            tool_choice={"type": "function", "function": {"name": "stocks"}},
        )
    assert err.value.body["param"] == "tool_choice"  # type: ignore[index]
