"""The OpenAI translation layer, table-driven: JSON requests -> GenerateRequest, router stream ->
OpenAI chunks/responses, errors -> HTTP status and the OpenAI error shape."""

from __future__ import annotations

from typing import Any

import grpc
import pytest
from google.protobuf import json_format

from kvmesh import errors
from kvmesh.grpc_errors import ERROR_OF
from kvmesh.v1 import common_pb2, router_pb2
from services.router.core.auth import Identity, tenant_of_key
from services.router.http import extensions, parsing, rendering
from services.router.http.errors import (
    BadRequest,
    PayloadTooLarge,
    Unauthorized,
    error_body,
    http_status_for,
)
from services.router.http.extensions import Extensions
from services.router.http.parsing import Kind

EXT = Extensions()
USER = [{"role": "user", "content": "hi"}]


def as_dict(req: router_pb2.GenerateRequest) -> dict[str, Any]:
    return json_format.MessageToDict(req, preserving_proto_field_name=True)


# ---- requests --------------------------------------------------------------------------------
CHAT_OK = [
    pytest.param(
        {"model": "tiny", "messages": USER},
        {
            "request_id": "rid",
            "model": "tiny",
            "chat": {"messages": [{"role": "user", "content": "hi"}]},
            "sampling": {"max_tokens": 64},
        },
        id="minimal",
    ),
    pytest.param(
        {
            "model": "tiny",
            "messages": USER,
            "max_tokens": 5,
            "temperature": 0,
            "top_p": 0.5,
            "seed": 7,
            "stop": "###",
            "user": "alice",
        },
        {
            "request_id": "rid",
            "model": "tiny",
            "chat": {"messages": [{"role": "user", "content": "hi"}]},
            "sampling": {
                "max_tokens": 5,
                "temperature": 0.0,
                "top_p": 0.5,
                "seed": "7",
                "stop": ["###"],
            },
        },
        id="sampling-stop-str",
    ),
    pytest.param(
        {
            "model": "tiny",
            "messages": USER,
            "max_tokens": 5,
            "max_completion_tokens": 9,
            "stop": ["a", "b"],
            "n": 1,
            "presence_penalty": 0,
            "response_format": {"type": "text"},
            "tools": [{"type": "function", "function": {"name": "f"}}],
            "tool_choice": "auto",
            "parallel_tool_calls": False,
        },
        {
            "request_id": "rid",
            "model": "tiny",
            "chat": {
                "messages": [{"role": "user", "content": "hi"}],
                "tools": [{"type": "function", "name": "f"}],
                "tool_choice": {"mode": "TOOL_CHOICE_MODE_AUTO"},
            },
            "sampling": {"max_tokens": 9, "stop": ["a", "b"], "presence_penalty": 0.0},
        },
        id="max-completion-tokens-wins-stop-list-n1-tools",
    ),
    pytest.param(
        {
            "messages": [
                {"role": "developer", "content": "be brief"},
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                    "name": "bob",
                },
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": "c1",
                            "type": "function",
                            "function": {"name": "get", "arguments": '{"x": 1}'},
                        },
                        {
                            "id": "c2",
                            "type": "function",
                            "function": {"name": "put", "arguments": ""},
                        },
                    ],
                },
                {"role": "tool", "tool_call_id": "c1", "content": "42"},
                {
                    "role": "assistant",
                    "content": "ok",
                    "function_call": {"name": "old", "arguments": "{}"},
                },
                {"role": "function", "name": "old", "content": "done"},
            ]
        },
        {
            "request_id": "rid",
            "chat": {
                "messages": [
                    {"role": "system", "content": "be brief"},
                    {"role": "user", "content": "ab", "name": "bob"},
                    {
                        "role": "assistant",
                        "tool_calls": [
                            {
                                "id": "c1",
                                "type": "function",
                                "name": "get",
                                "arguments": '{"x": 1}',
                            },
                            {"id": "c2", "type": "function", "name": "put", "arguments": "{}"},
                        ],
                    },
                    {"role": "tool", "content": "42", "tool_call_id": "c1"},
                    {
                        "role": "assistant",
                        "content": "ok",
                        "tool_calls": [
                            {"id": "old", "type": "function", "name": "old", "arguments": "{}"}
                        ],
                    },
                    {"role": "tool", "content": "done", "name": "old", "tool_call_id": "old"},
                ]
            },
            "sampling": {"max_tokens": 64},
        },
        id="roles-parts-tool-calls-legacy-function",
    ),
    pytest.param(
        {
            "messages": USER,
            "tools": [
                {
                    "type": "function",
                    "function": {
                        "name": "weather",
                        "description": "Today's weather",
                        "parameters": {"type": "object", "properties": {"city": {}}},
                        "strict": True,
                    },
                },
                {"type": "function", "function": {"name": "time"}},
            ],
            "tool_choice": {"type": "function", "function": {"name": "time"}},
        },
        {
            "request_id": "rid",
            "chat": {
                "messages": [{"role": "user", "content": "hi"}],
                "tools": [
                    {
                        "type": "function",
                        "name": "weather",
                        "description": "Today's weather",
                        "parameters_json": '{"type": "object", "properties": {"city": {}}}',
                    },
                    {"type": "function", "name": "time"},
                ],
                "tool_choice": {"mode": "TOOL_CHOICE_MODE_FUNCTION", "function_name": "time"},
            },
            "sampling": {"max_tokens": 64},
        },
        id="tools-named-choice",
    ),
    pytest.param(
        {
            "messages": USER,
            "functions": [{"name": "f", "parameters": {"type": "object"}}],
            "function_call": {"name": "f"},
        },
        {
            "request_id": "rid",
            "chat": {
                "messages": [{"role": "user", "content": "hi"}],
                "tools": [
                    {"type": "function", "name": "f", "parameters_json": '{"type": "object"}'}
                ],
                "tool_choice": {"mode": "TOOL_CHOICE_MODE_FUNCTION", "function_name": "f"},
            },
            "sampling": {"max_tokens": 64},
        },
        id="legacy-functions-and-function-call",
    ),
]


@pytest.mark.parametrize(("body", "want"), CHAT_OK)
def test_chat_request(body: dict[str, Any], want: dict[str, Any]):
    parsed = parsing.parse_chat(body, EXT, "rid", 64)
    assert parsed.kind is Kind.CHAT and parsed.id == "rid"
    assert as_dict(parsed.generate) == want
    assert parsed.parse_tool_calls is bool(body.get("tools") or body.get("functions"))


TOOL = {"type": "function", "function": {"name": "f"}}


@pytest.mark.parametrize(
    ("extra", "parse_calls"),
    [
        pytest.param({}, False, id="no-tools"),
        pytest.param({"tools": []}, False, id="empty-tools"),
        pytest.param({"tool_choice": "none"}, False, id="choice-none-no-tools"),
        pytest.param({"tools": [TOOL]}, True, id="tools"),
        pytest.param({"tools": [TOOL], "tool_choice": "required"}, True, id="required"),
        pytest.param({"tools": [TOOL], "tool_choice": "none"}, False, id="none"),
        pytest.param({"functions": [{"name": "f"}], "function_call": "none"}, False, id="legacy"),
    ],
)
def test_tool_calls_are_parsed_only_with_tools_offered(extra: dict[str, Any], parse_calls: bool):
    parsed = parsing.parse_chat({"messages": USER, **extra}, EXT, "rid", 64)
    assert parsed.parse_tool_calls is parse_calls
    if extra.get("tool_choice") == "none" and "tools" in extra:  # the router drops them
        assert parsed.generate.chat.tool_choice.mode == router_pb2.TOOL_CHOICE_MODE_NONE
        assert [t.name for t in parsed.generate.chat.tools] == ["f"]


def test_extensions_travel_and_stream_flags():
    ext = Extensions(session_id="s1", tenant="t1", priority=-3)
    body = {
        "model": "m",
        "messages": USER,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    p = parsing.parse_chat(body, ext, "rid", 8)
    assert (p.stream, p.include_usage, p.model) == (True, True, "m")
    g = p.generate
    assert (g.session_id, g.tenant, g.priority) == ("s1", "t1", -3)


@pytest.mark.parametrize(
    ("sent", "ext", "want"),
    [
        pytest.param(None, Extensions(), "", id="open-none"),
        pytest.param("mine", Extensions(), "mine", id="open-client-salt-as-vllm"),
        pytest.param(None, Extensions(cache_salt="tenant-salt"), "tenant-salt", id="keyed"),
        pytest.param(
            "other", Extensions(cache_salt="tenant-salt"), "tenant-salt", id="keyed-strips"
        ),
        pytest.param(
            7, Extensions(cache_salt="tenant-salt"), "tenant-salt", id="keyed-ignores-any"
        ),
    ],
)
def test_cache_salt(sent: object, ext: Extensions, want: str):
    """With API keys the tenant's salt, whatever the body says (a client cannot pick the blocks
    it shares); open, vLLM's body field."""
    body: dict[str, Any] = {"model": "m", "messages": USER}
    prompt: dict[str, Any] = {"model": "m", "prompt": ["a", "b"]}
    if sent is not None:
        body["cache_salt"] = prompt["cache_salt"] = sent
    assert parsing.parse_chat(body, ext, "rid", 8).generate.cache_salt == want
    batch = parsing.parse_completion(prompt, ext, "rid", 8).batch
    assert [g.cache_salt for g in batch] == [want, want]


@pytest.mark.parametrize(
    ("sent", "says"),
    [
        pytest.param("", "cache_salt is empty", id="empty"),
        pytest.param(3, "must be a string", id="int"),
    ],
)
def test_open_cache_salt_refused(sent: object, says: str):
    with pytest.raises(BadRequest, match=says) as bad:
        parsing.parse_chat({"messages": USER, "cache_salt": sent}, Extensions(), "rid", 8)
    assert bad.value.param == "cache_salt"


COMPLETION_OK = [
    pytest.param({"prompt": "once"}, {"text": "once"}, id="text"),
    pytest.param({"prompt": ["once"]}, {"text": "once"}, id="batch-of-one"),
    pytest.param({"prompt": [1, 2, 3]}, {"token_ids": {"ids": [1, 2, 3]}}, id="ids"),
    pytest.param({"prompt": [[4, 5]]}, {"token_ids": {"ids": [4, 5]}}, id="ids-batch-of-one"),
]


@pytest.mark.parametrize(("body", "want"), COMPLETION_OK)
def test_completion_request(body: dict[str, Any], want: dict[str, Any]):
    p = parsing.parse_completion({"model": "tiny", "max_tokens": 3, **body}, EXT, "rid", 64)
    got = as_dict(p.generate)
    assert p.kind is Kind.COMPLETION
    assert {k: v for k, v in got.items() if k in ("text", "token_ids")} == want
    assert got["sampling"] == {"max_tokens": 3}


BAD = [
    pytest.param(Kind.CHAT, [1], None, "JSON object", id="not-an-object"),
    pytest.param(Kind.CHAT, {"messages": USER, "n": 0}, "n", "n must be in [1, 128]", id="n0"),
    pytest.param(Kind.CHAT, {"messages": []}, "messages", "non-empty", id="no-messages"),
    pytest.param(Kind.CHAT, {"messages": USER, "max_tokens": 0}, "max_tokens", "> 0", id="max0"),
    pytest.param(
        Kind.CHAT, {"messages": USER, "max_tokens": "5"}, "max_tokens", "integer", id="max-str"
    ),
    pytest.param(
        Kind.CHAT, {"messages": USER, "temperature": True}, "temperature", "number", id="temp-bool"
    ),
    pytest.param(Kind.CHAT, {"messages": USER, "stop": [1]}, "stop", "strings", id="stop-ints"),
    pytest.param(
        Kind.COMPLETION, {"prompt": "x", "stop": list("abcde")}, "stop", "at most 4", id="5-stops"
    ),
    pytest.param(
        Kind.CHAT, {"messages": USER, "stream": "yes"}, "stream", "true or false", id="stream-str"
    ),
    pytest.param(
        Kind.CHAT,
        {"messages": USER, "stream_options": {"include_usage": True}},
        "stream_options",
        "stream: true",
        id="usage-without-stream",
    ),
    pytest.param(
        Kind.CHAT, {"messages": USER, "logprobs": 1}, "logprobs", "true or false", id="logprobs"
    ),
    pytest.param(
        Kind.CHAT,
        {"messages": USER, "frequency_penalty": "0.5"},
        "frequency_penalty",
        "a number",
        id="penalty-str",
    ),
    pytest.param(
        Kind.CHAT,
        {"messages": USER, "response_format": {"type": "xml"}},
        "response_format",
        "json_schema",
        id="unknown-format",
    ),
    pytest.param(
        Kind.CHAT,
        {"messages": [{"role": "robot", "content": "x"}]},
        "messages[0].role",
        "robot",
        id="bad-role",
    ),
    pytest.param(
        Kind.CHAT,
        {"messages": [{"role": "tool", "content": "x"}]},
        "messages[0].tool_call_id",
        "tool_call_id",
        id="tool-no-id",
    ),
    pytest.param(
        Kind.CHAT,
        {
            "messages": [
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}
            ]
        },
        "messages[0].content[0]",
        "image_url",
        id="image-part",
    ),
    pytest.param(
        Kind.CHAT,
        {"messages": [{"role": "assistant", "tool_calls": [{"function": {"arguments": "{}"}}]}]},
        "messages[0].tool_calls[0].function.name",
        "name",
        id="tool-call-no-name",
    ),
    *[
        pytest.param(
            Kind.CHAT,
            {"messages": [{"role": "assistant", "tool_calls": [call]}]},
            "messages[0].tool_calls[0]" + suffix,
            says,
            id=name,
        )
        for name, call, suffix, says in [
            (
                "call-args-object",
                {"function": {"name": "f", "arguments": {"x": 1}}},
                ".function.arguments",
                "json.dumps",
            ),
            (
                "call-args-bad-json",
                {"function": {"name": "f", "arguments": "{x: 1}"}},
                ".function.arguments",
                "not valid JSON",
            ),
            (
                "call-args-not-object",
                {"function": {"name": "f", "arguments": "[1]"}},
                ".function.arguments",
                "JSON object",
            ),
            (
                "call-unknown-type",
                {"type": "custom", "function": {"name": "f"}},
                ".type",
                "only 'function'",
            ),
            ("call-no-function", {"id": "c"}, "", "function"),
            ("call-id-int", {"id": 3, "function": {"name": "f"}}, ".id", "string"),
        ]
    ],
    pytest.param(
        Kind.CHAT,
        {"messages": [{"role": "assistant", "tool_calls": {"function": {"name": "f"}}}]},
        "messages[0].tool_calls",
        "list",
        id="tool-calls-not-list",
    ),
    pytest.param(
        Kind.CHAT,
        {"messages": [{"role": "assistant", "function_call": {"name": "f", "arguments": "1"}}]},
        "messages[0].function_call.arguments",
        "JSON object",
        id="legacy-call-args",
    ),
    pytest.param(Kind.CHAT, {"messages": USER, "tools": TOOL}, "tools", "list", id="tools-dict"),
    pytest.param(
        Kind.CHAT,
        {"messages": USER, "tools": [{"type": "code_interpreter"}]},
        "tools[0].type",
        "only 'function' tools",
        id="tool-unknown-type",
    ),
    pytest.param(
        Kind.CHAT,
        {"messages": USER, "tools": [{"type": "function", "function": {"name": ""}}]},
        "tools[0].function.name",
        "non-empty",
        id="tool-no-name",
    ),
    pytest.param(
        Kind.CHAT,
        {"messages": USER, "tools": [{"type": "function"}]},
        "tools[0].function",
        "object",
        id="tool-no-function",
    ),
    pytest.param(
        Kind.CHAT,
        {
            "messages": USER,
            "tools": [{"type": "function", "function": {"name": "f", "parameters": "{}"}}],
        },
        "tools[0].function.parameters",
        "JSON Schema object",
        id="tool-parameters-str",
    ),
    pytest.param(
        Kind.CHAT,
        {"messages": USER, "tools": [TOOL, TOOL]},
        "tools[1].function.name",
        "defined twice",
        id="tool-twice",
    ),
    pytest.param(
        Kind.CHAT,
        {"messages": USER, "tools": [TOOL], "functions": [{"name": "g"}]},
        "functions",
        "not both",
        id="tools-and-functions",
    ),
    pytest.param(
        Kind.CHAT,
        {"messages": USER, "tools": [TOOL], "tool_choice": "always"},
        "tool_choice",
        "'always'",
        id="choice-unknown",
    ),
    pytest.param(
        Kind.CHAT,
        {
            "messages": USER,
            "tools": [TOOL],
            "tool_choice": {"type": "function", "function": {"name": "g"}},
        },
        "tool_choice",
        "'g', which is not one of the tools (f)",
        id="choice-names-unknown-tool",
    ),
    pytest.param(
        Kind.CHAT,
        {"messages": USER, "tool_choice": "required"},
        "tool_choice",
        "no tools",
        id="required-without-tools",
    ),
    pytest.param(
        Kind.CHAT,
        {"messages": USER, "functions": [{"name": "f"}], "function_call": {"name": "g"}},
        "function_call",
        "'g'",
        id="legacy-choice-unknown",
    ),
    pytest.param(
        Kind.CHAT,
        {"messages": USER, "tools": [TOOL], "parallel_tool_calls": "yes"},
        "parallel_tool_calls",
        "true or false",
        id="parallel-str",
    ),
    pytest.param(Kind.COMPLETION, {"prompt": ["a", 5]}, "prompt[1]", "must be", id="batch-int"),
    pytest.param(Kind.COMPLETION, {"prompt": ""}, "prompt", "empty", id="empty-prompt"),
    pytest.param(Kind.COMPLETION, {}, "prompt", "must be", id="no-prompt"),
    pytest.param(Kind.COMPLETION, {"prompt": [-1]}, "prompt", "must be", id="negative-id"),
    pytest.param(Kind.COMPLETION, {"prompt": "x", "echo": 1}, "echo", "true or false", id="echo"),
    pytest.param(
        Kind.COMPLETION, {"prompt": "x", "best_of": 3}, "best_of", "best_of", id="best-of"
    ),
]


@pytest.mark.parametrize(("kind", "body", "param", "says"), BAD)
def test_bad_request(kind: Kind, body: object, param: str | None, says: str):
    parse = parsing.parse_chat if kind is Kind.CHAT else parsing.parse_completion
    with pytest.raises(BadRequest) as err:
        parse(body, EXT, "rid", 64)
    assert err.value.param == param
    assert says in str(err.value)
    status, shape = error_body(err.value)
    assert status == 400
    assert shape["error"]["param"] == param and shape["error"]["type"] == "invalid_request_error"


# ---- headers ---------------------------------------------------------------------------------
HEADERS = [
    pytest.param({}, None, Extensions(), id="none"),
    pytest.param(
        {"x-kvmesh-session-id": "s", "x-kvmesh-tenant": "t", "x-kvmesh-priority": "5"},
        None,
        Extensions("s", "t", 5),
        id="all-headers",
    ),
    pytest.param(
        {"authorization": "Bearer sk-1"},
        None,
        Extensions(tenant=tenant_of_key("sk-1")),
        id="open-server-key-names-tenant",
    ),
    pytest.param(
        {"authorization": "Bearer sk-1", "x-kvmesh-tenant": "t"},
        None,
        Extensions(tenant="t"),
        id="open-server-header-wins",
    ),
    pytest.param(
        {"x-api-key": "sk-1"},
        None,
        Extensions(tenant=tenant_of_key("sk-1")),
        id="anthropic-style-key",
    ),
    pytest.param(
        {"authorization": "Bearer sk-1", "x-kvmesh-tenant": "other", "x-kvmesh-priority": "9"},
        Identity("team-a", 3, "salt-a"),
        Extensions(tenant="team-a", priority=3, cache_salt="salt-a"),
        id="authenticated-identity-wins",
    ),
]


@pytest.mark.parametrize(("headers", "identity", "want"), HEADERS)
def test_headers(headers: dict[str, str], identity: Identity | None, want: Extensions):
    assert extensions.extensions_from_headers(headers, identity) == want
    assert tenant_of_key("sk-1") != "sk-1"  # never the secret itself


@pytest.mark.parametrize(
    ("headers", "exc"),
    [
        pytest.param({"x-kvmesh-priority": "high"}, BadRequest, id="priority"),
        pytest.param({"x-kvmesh-priority": str(2**31)}, BadRequest, id="priority-past-int32"),
    ],
)
def test_header_errors(headers: dict[str, str], exc: type[Exception]):
    with pytest.raises(exc):
        extensions.extensions_from_headers(headers)


# ---- responses -------------------------------------------------------------------------------
def chunks(*texts: str, reason: int = common_pb2.FINISH_REASON_STOP, stop: str = ""):
    msgs = [router_pb2.GenerateResponse(request_id="rid", text=t, token_ids=[1]) for t in texts]
    last = router_pb2.GenerateResponse(request_id="rid")
    last.finished.reason = reason
    last.finished.stop_reason = stop
    last.finished.usage.CopyFrom(
        common_pb2.Usage(
            prompt_tokens=10,
            cached_prompt_tokens=4,
            completion_tokens=len(texts),
            worker_id="w1",
            time_to_first_token_s=0.25,
            cached_gpu_tokens=1,
            cached_cpu_tokens=2,
            cached_peer_tokens=1,
        )
    )
    return [*msgs, last]


def parsed(kind: Kind, stream: bool = True, include_usage: bool = False):
    return parsing.ParsedRequest(
        kind, "rid", "tiny", stream, include_usage, router_pb2.GenerateRequest()
    )


USAGE = {
    "prompt_tokens": 10,
    "completion_tokens": 2,
    "total_tokens": 12,
    "prompt_tokens_details": {"cached_tokens": 4},
}
KVMESH = {
    "request_id": "rid",
    "worker_id": "w1",
    "cached_tokens": 4,
    "cached_tokens_by_tier": {"gpu": 1, "cpu": 2, "disk": 0, "peer": 1},
    "prompt_tokens": 10,
    "time_to_first_token_s": 0.25,
    "resumes": 0,
    "resume_recomputed_tokens": 0,
}


def test_chat_stream_chunks():
    tr = rendering.ResponseTranslator(parsed(Kind.CHAT, include_usage=True), created=100)
    out = [p for m in chunks("Hel", "lo") for p in tr.feed(m)]
    assert [(c["choices"] and c["choices"][0]["delta"], c.get("usage")) for c in out] == [
        ({"role": "assistant", "content": ""}, None),
        ({"content": "Hel"}, None),
        ({"content": "lo"}, None),
        ({}, None),
        ([], USAGE),
    ]
    assert all(c["object"] == "chat.completion.chunk" and c["id"] == "rid" for c in out)
    assert out[3]["choices"][0]["finish_reason"] == "stop"
    assert out[3]["kvmesh"] == KVMESH


def test_completion_stream_chunks_without_usage():
    tr = rendering.ResponseTranslator(parsed(Kind.COMPLETION), created=100)
    out = [p for m in chunks("a", "", reason=common_pb2.FINISH_REASON_LENGTH) for p in tr.feed(m)]
    assert [c["choices"][0]["text"] for c in out] == ["a", ""]  # empty text: no chunk
    assert out[-1]["choices"][0]["finish_reason"] == "length"
    assert all("usage" not in c for c in out)


@pytest.mark.parametrize(
    ("kind", "reason", "stop", "want_finish"),
    [
        pytest.param(Kind.CHAT, common_pb2.FINISH_REASON_STOP, "###", "stop", id="chat-stop"),
        pytest.param(
            Kind.COMPLETION, common_pb2.FINISH_REASON_LENGTH, "", "length", id="cmpl-length"
        ),
        pytest.param(Kind.CHAT, common_pb2.FINISH_REASON_ABORT, "", "abort", id="chat-abort"),
    ],
)
def test_full_response(kind: Kind, reason: int, stop: str, want_finish: str):
    tr = rendering.ResponseTranslator(parsed(kind, stream=False), created=100)
    for m in chunks("Hel", "lo", reason=reason, stop=stop):
        tr.feed(m)
    body = tr.response()
    choice = body["choices"][0]
    text = choice["message"]["content"] if kind is Kind.CHAT else choice["text"]
    assert text == "Hello"
    assert (choice["finish_reason"], choice["stop_reason"]) == (want_finish, stop or None)
    assert body["object"] == kind.value and body["usage"] == USAGE and body["kvmesh"] == KVMESH
    assert rendering.response_headers("rid", tr.usage) == {
        "x-request-id": "rid",
        "x-kvmesh-worker": "w1",
        "x-kvmesh-cached-tokens": "4",
        "x-kvmesh-cached-tokens-by-tier": "gpu=1,cpu=2,disk=0,peer=1",
        "x-kvmesh-prompt-tokens": "10",
    }


@pytest.mark.parametrize(
    ("usage", "by_tier", "header"),
    [
        pytest.param(
            common_pb2.Usage(cached_prompt_tokens=96, cached_disk_tokens=64, cached_gpu_tokens=32),
            {"gpu": 32, "cpu": 0, "disk": 64, "peer": 0},
            "gpu=32,cpu=0,disk=64,peer=0",
            id="gpu-and-disk",
        ),
        pytest.param(
            common_pb2.Usage(cached_prompt_tokens=320, cached_peer_tokens=320),
            {"gpu": 0, "cpu": 0, "disk": 0, "peer": 320},
            "gpu=0,cpu=0,disk=0,peer=320",
            id="all-peer",
        ),
        pytest.param(
            common_pb2.Usage(),
            {"gpu": 0, "cpu": 0, "disk": 0, "peer": 0},
            "gpu=0,cpu=0,disk=0,peer=0",
            id="nothing-cached",
        ),
        pytest.param(  # a worker from before the split: the total alone
            common_pb2.Usage(cached_prompt_tokens=64),
            {"gpu": 0, "cpu": 0, "disk": 0, "peer": 0},
            "gpu=0,cpu=0,disk=0,peer=0",
            id="old-worker",
        ),
    ],
)
def test_cached_tokens_by_tier(usage: common_pb2.Usage, by_tier: dict[str, int], header: str):
    assert rendering.kvmesh_json("r", usage)["cached_tokens_by_tier"] == by_tier
    assert rendering.usage_json(usage)["prompt_tokens_details"] == {
        "cached_tokens": usage.cached_prompt_tokens
    }
    assert rendering.response_headers("r", usage)["x-kvmesh-cached-tokens-by-tier"] == header


def test_models_json():
    resp = router_pb2.ListModelsResponse(
        models=[router_pb2.ModelInfo(name="tiny", max_model_len=2048, block_size=32, workers=2)]
    )
    assert rendering.models_json(resp, 5) == {
        "object": "list",
        "data": [
            {
                "id": "tiny",
                "object": "model",
                "created": 5,
                "owned_by": "kvmesh",
                "max_model_len": 2048,
                "kvmesh": {"block_size": 32, "workers": 2},
            }
        ],
    }


# ---- errors ----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("code", "status", "type_"),
    [
        pytest.param(grpc.StatusCode.INVALID_ARGUMENT, 400, "invalid_request_error", id="invalid"),
        pytest.param(grpc.StatusCode.NOT_FOUND, 404, "invalid_request_error", id="not-found"),
        pytest.param(grpc.StatusCode.RESOURCE_EXHAUSTED, 429, "rate_limit_error", id="exhausted"),
        pytest.param(grpc.StatusCode.UNAVAILABLE, 503, "server_error", id="unavailable"),
        pytest.param(grpc.StatusCode.DEADLINE_EXCEEDED, 504, "server_error", id="deadline"),
        pytest.param(
            grpc.StatusCode.UNAUTHENTICATED, 401, "invalid_request_error", id="unauthenticated"
        ),
        pytest.param(
            grpc.StatusCode.PERMISSION_DENIED, 403, "invalid_request_error", id="permission"
        ),
    ],
)
def test_grpc_status_to_http(code: grpc.StatusCode, status: int, type_: str):
    exc = ERROR_OF[code]("why")
    assert (http_status_for(exc).status, http_status_for(exc).type) == (status, type_)
    assert error_body(exc)[1]["error"]["message"] == "why"


@pytest.mark.parametrize(
    ("exc", "status"),
    [
        pytest.param(Unauthorized("k"), 401, id="unauthorized"),
        pytest.param(PayloadTooLarge("big"), 413, id="too-large"),
        pytest.param(errors.KvmeshError("odd"), 500, id="unmapped-domain"),
        pytest.param(RuntimeError("secret trace"), 500, id="unexpected"),
    ],
)
def test_local_errors_to_http(exc: Exception, status: int):
    got, body = error_body(exc, "rid")
    assert got == status
    if status == 500:
        assert "secret" not in body["error"]["message"] and "rid" in body["error"]["message"]
    assert set(body["error"]) == {"message", "type", "param", "code"}


# ---- router errors naming a field ------------------------------------------------------------
def request_of(kind: Kind, **body: Any) -> parsing.ParsedRequest:
    parse = parsing.parse_chat if kind is Kind.CHAT else parsing.parse_completion
    base = {"messages": USER} if kind is Kind.CHAT else {"prompt": "x"}
    return parse({**base, **body}, EXT, "rid", 64)


@pytest.mark.parametrize(
    ("kind", "body", "field", "param"),
    [
        pytest.param(Kind.CHAT, {}, "sampling.temperature", "temperature", id="temperature"),
        pytest.param(Kind.CHAT, {}, "sampling.top_p", "top_p", id="top_p"),
        pytest.param(Kind.CHAT, {}, "sampling.max_tokens", "max_tokens", id="max_tokens"),
        pytest.param(
            Kind.CHAT,
            {"max_completion_tokens": 5},
            "sampling.max_tokens",
            "max_completion_tokens",
            id="max_completion_tokens",
        ),
        pytest.param(Kind.CHAT, {}, "model", "model", id="model"),
        pytest.param(Kind.CHAT, {}, "input", "messages", id="chat-prompt"),
        pytest.param(Kind.COMPLETION, {}, "input", "prompt", id="completion-prompt"),
        pytest.param(Kind.COMPLETION, {}, "text", "prompt", id="text"),
        pytest.param(
            Kind.CHAT, {}, "chat.messages[1].role", "messages[1].role", id="message-field"
        ),
        pytest.param(Kind.CHAT, {}, "sampling.ignore_eos", None, id="unmapped"),
        pytest.param(Kind.CHAT, {}, None, None, id="no-field"),
    ],
)
def test_router_errors_name_the_param(
    kind: Kind, body: dict[str, Any], field: str | None, param: str | None
):
    exc = parsing.router_error(
        errors.InvalidArgument("out of range", field), request_of(kind, **body)
    )
    status, shape = error_body(exc)
    assert (status, shape["error"]["param"], shape["error"]["message"]) == (
        400,
        param,
        "out of range",
    )


def test_other_router_errors_pass_unchanged():
    exc = errors.NotFound("model 'x' is not served")
    assert parsing.router_error(exc, request_of(Kind.CHAT)) is exc


def test_with_model_names_the_request_and_the_answer():
    p = parsing.with_model(request_of(Kind.COMPLETION), "tiny")
    assert (p.model, p.generate.model) == ("tiny", "tiny")
    assert parsing.with_model(p, "") is p
