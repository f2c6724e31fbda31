"""Structured output and forced tool choice against a real mesh (etcd, one vLLM worker on the
tiny model, router), through the official ``openai`` client, LangChain's ``ChatOpenAI`` and the
OpenAI Agents SDK, and through the router's gRPC API.

The tiny model is random: what it writes means nothing, but constrained decoding must make it
valid. The worker runs xgrammar without free whitespace (``--structured-outputs-config``):
with whitespace allowed, a random model fills the object with spaces until max_tokens. The
schemas use booleans and enums, so a completion ends (EOS is the only token left once the JSON
is complete) well within max_tokens. Greedy (temperature 0), so every run is the same."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any, Literal

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel

from kvmesh.client import RouterClient, make_request
from kvmesh.launcher import Mesh, MeshSpec
from kvmesh.v1 import router_pb2

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

COMPACT = '{"backend": "xgrammar", "disable_any_whitespace": true}'
ASK = [{"role": "user", "content": "Answer in JSON."}]
MAX_TOKENS = 48
VERDICT: dict[str, Any] = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "color": {"enum": ["red", "green", "blue"]}},
    "required": ["ok", "color"],
}
WEATHER: dict[str, Any] = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Rome"]}, "celsius": {"type": "boolean"}},
    "required": ["city", "celsius"],
}
TOOLS: Any = [
    {"type": "function", "function": {"name": "weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "clock", "description": "The time now"}},
]
SCHEMAS = {"weather": WEATHER, "clock": {"type": "object", "properties": {}, "maxProperties": 0}}


@pytest.fixture(scope="module")
def mesh(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    spec = MeshSpec(
        model_path=tiny_model,
        served_model_name="tiny",
        workers=1,
        max_model_len=1024,
        kv_cache_bytes=64 << 20,
        kvmanager_cpu_bytes=0,
        worker_args=("--structured-outputs-config", COMPACT),
        log_dir=tmp_path_factory.mktemp("structured-mesh"),
    )
    with Mesh(spec) as m:
        yield m


@pytest.fixture(scope="module")
async def base_url(mesh: Mesh) -> str:
    async with RouterClient(mesh.router_address) as c:
        assert (await c.wait_for_models(60)).models
    return mesh.http_base_url


@pytest.fixture
async def client(base_url: str) -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai.AsyncOpenAI(base_url=base_url, api_key="EMPTY", max_retries=0) as c:
        yield c


async def chat(client: openai.AsyncOpenAI, **kwargs: Any) -> Any:
    return await client.chat.completions.create(
        model="tiny", messages=ASK, max_tokens=MAX_TOKENS, temperature=0, **kwargs
    )


async def test_json_object_is_a_json_object(client: openai.AsyncOpenAI):
    resp = await chat(client, response_format={"type": "json_object"})
    choice = resp.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(json.loads(choice.message.content), dict)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
async def test_json_schema_output_matches_the_schema(client: openai.AsyncOpenAI, stream: bool):
    fmt: Any = {"type": "json_schema", "json_schema": {"name": "verdict", "schema": VERDICT}}
    if stream:
        text, finish = "", None
        async for chunk in await chat(client, response_format=fmt, stream=True):
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
                finish = chunk.choices[0].finish_reason or finish
    else:
        resp = await chat(client, response_format=fmt)
        text, finish = resp.choices[0].message.content, resp.choices[0].finish_reason
    assert finish == "stop"
    jsonschema.validate(json.loads(text), VERDICT)


async def test_unconstrained_output_is_not_json(client: openai.AsyncOpenAI):
    """The control: without response_format the random model's text is no JSON object (so the
    tests above pass because of the constraint)."""
    text = (await chat(client)).choices[0].message.content
    with pytest.raises(json.JSONDecodeError):
        assert isinstance(json.loads(text), dict)


@pytest.mark.parametrize(
    ("spec", "check"),
    [
        ({"regex": "[a-z]{3}-[0-9]{2}"}, lambda t: re.fullmatch(r"[a-z]{3}-[0-9]{2}", t)),
        ({"choice": ["yes", "no", "maybe"]}, lambda t: t in ("yes", "no", "maybe")),
        ({"grammar": 'root ::= "ab" | "cd"'}, lambda t: t in ("ab", "cd")),
    ],
    ids=["regex", "choice", "grammar"],
)
async def test_vllm_structured_outputs_extension(client: openai.AsyncOpenAI, spec, check):
    resp = await client.completions.create(
        model="tiny",
        prompt="Pick:",
        max_tokens=MAX_TOKENS,
        temperature=0,
        extra_body={"structured_outputs": spec},
    )
    assert resp.choices[0].finish_reason == "stop"
    assert check(resp.choices[0].text), resp.choices[0].text


@pytest.mark.parametrize(
    ("fmt", "param"),
    [
        (
            {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "frob"}}},
            "response_format",
        ),
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": "{"}}, "response_format"),
    ],
    ids=["engine-refuses", "not-json"],
)
async def test_bad_schema_is_a_400_naming_response_format(
    client: openai.AsyncOpenAI, fmt: Any, param: str
):
    with pytest.raises(openai.BadRequestError) as info:
        await chat(client, response_format=fmt)
    assert info.value.body["param"] == param  # type: ignore[index]


async def test_a_tool_schema_the_engine_refuses_is_a_400_naming_tools(client: openai.AsyncOpenAI):
    bad: Any = [{"type": "function", "function": {"name": "f", "parameters": {"type": "frob"}}}]
    with pytest.raises(openai.BadRequestError) as info:
        await chat(client, tools=bad, tool_choice="required")
    assert info.value.body["param"] == "tools"  # type: ignore[index]
    assert "tool_choice" in info.value.message


def check_calls(calls: list[Any], names: set[str]) -> None:
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


async def test_required_tool_choice_yields_tool_calls(client: openai.AsyncOpenAI):
    resp = await chat(client, tools=TOOLS, tool_choice="required")
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert not choice.message.content
    check_calls(choice.message.tool_calls, {"weather", "clock"})


async def test_named_tool_choice_calls_that_function(client: openai.AsyncOpenAI):
    resp = await chat(
        client, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "weather"}}
    )
    choice = resp.choices[0]
    assert choice.finish_reason == "stop"  # as OpenAI and vLLM answer a named choice
    assert not choice.message.content
    check_calls(choice.message.tool_calls, {"weather"})
    assert len(choice.message.tool_calls) == 1


@pytest.mark.parametrize(
    "tool_choice",
    ["required", {"type": "function", "function": {"name": "weather"}}],
    ids=["required", "named"],
)
async def test_forced_calls_stream_as_tool_call_deltas(client: openai.AsyncOpenAI, tool_choice):
    calls: dict[int, dict[str, Any]] = {}
    content, finish = "", None
    async for chunk in await chat(client, tools=TOOLS, tool_choice=tool_choice, stream=True):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        finish = chunk.choices[0].finish_reason or finish
        for tc in delta.tool_calls or []:
            call = calls.setdefault(tc.index, {"id": tc.id, "name": "", "arguments": ""})
            call["name"] += (tc.function.name or "") if tc.function else ""
            call["arguments"] += (tc.function.arguments or "") if tc.function else ""
    assert not content
    assert finish == ("tool_calls" if tool_choice == "required" else "stop")
    assert calls
    for call in calls.values():
        assert call["id"].startswith("call_")
        jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])


async def test_grpc_forced_tool_choice_is_constrained_too(mesh: Mesh):
    """The router derives the schema for gRPC chat requests as well: the text is the array of
    calls the HTTP front door turns into tool_calls."""
    req = make_request(ASK, max_tokens=4 * MAX_TOKENS, temperature=0.0)  # tiny's tokens: ~1 char
    req.chat.tools.add(name="weather", parameters_json=json.dumps(WEATHER))
    req.chat.tool_choice.mode = router_pb2.TOOL_CHOICE_MODE_REQUIRED
    async with RouterClient(mesh.router_address) as c:
        out = await c.complete(req)
    assert out.finish_reason == "FINISH_REASON_STOP", out.text
    calls = json.loads(out.text)
    assert isinstance(calls, list) and calls
    for call in calls:
        assert call["name"] == "weather"
        jsonschema.validate(call["parameters"], WEATHER)


class Verdict(BaseModel):
    ok: bool
    color: Literal["red", "green", "blue"]


@contextlib.asynccontextmanager
async def chat_openai(base_url: str) -> AsyncIterator[Any]:
    """LangChain's ChatOpenAI on the router, on an HTTP client closed afterwards."""
    from langchain_openai import ChatOpenAI

    async with httpx.AsyncClient() as http:
        yield ChatOpenAI(
            base_url=base_url,
            api_key="EMPTY",
            model="tiny",
            temperature=0,
            max_tokens=MAX_TOKENS,
            http_async_client=http,
        )


@pytest.mark.parametrize("method", [None, "json_schema", "function_calling"])
async def test_langchain_with_structured_output(base_url: str, method: str | None):

    kwargs: dict[str, Any] = {} if method is None else {"method": method}
    async with chat_openai(base_url) as llm:
        result = await llm.with_structured_output(Verdict, **kwargs).ainvoke("Is the sky blue?")
    assert isinstance(result, Verdict)


async def test_langchain_json_mode_gives_json(base_url: str):
    """json_mode promises a JSON object, not the schema's (as with OpenAI): the raw answer
    parses; whether it fits Verdict is the model's business."""
    async with chat_openai(base_url) as llm:
        structured = llm.with_structured_output(Verdict, method="json_mode", include_raw=True)
        result: Any = await structured.ainvoke("Is the sky blue? Answer in JSON.")
    assert isinstance(json.loads(result["raw"].content), dict)


async def test_agents_sdk_required_tool_choice_runs_the_tool(base_url: str):
    from agents import (
        Agent,
        ModelSettings,
        OpenAIChatCompletionsModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )

    set_tracing_disabled(True)
    seen: list[str] = []

    @function_tool
    def paint(color: Literal["red", "green"]) -> str:
        """Paint the wall."""
        seen.append(color)
        return f"painted {color}"

    async with openai.AsyncOpenAI(base_url=base_url, api_key="EMPTY", max_retries=0) as client:
        agent = Agent(
            name="painter",
            instructions="Paint the wall.",
            model=OpenAIChatCompletionsModel(model="tiny", openai_client=client),
            tools=[paint],
            # After the call the SDK resets tool_choice to auto, so the next turn may answer.
            model_settings=ModelSettings(tool_choice="required", temperature=0, max_tokens=96),
        )
        result = await asyncio.wait_for(Runner.run(agent, "Paint it.", max_turns=3), 120)
    assert seen and seen[0] in ("red", "green"), [r.output for r in result.raw_responses]
    assert any(item.type == "tool_call_output_item" for item in result.new_items)
