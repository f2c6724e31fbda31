"""The Anthropic Messages API on real parts: a real vLLM worker (tiny model, float32) behind the
worker gRPC service, found through a real etcd by a real router serving HTTP, driven by the
official ``anthropic`` SDK (sync, async, ``messages.stream``, count_tokens, a tool-use loop).

The tiny model is random: its words mean nothing, so tool calls are checked through forced tool
choices (constrained decoding makes them valid; the worker runs xgrammar without free
whitespace, and the schema's enums and booleans end the JSON well within max_tokens). Greedy
decoding makes every answer reproducible, so streamed and whole answers must agree."""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anthropic
import jsonschema
import pytest

from services.router.config import RouterConfig
from services.router.main import RunningRouter, start_router
from services.worker.config import EngineConfig, WorkerConfig
from services.worker.main import VLLM_ENVIRONMENT

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

BLOCK = 32
HI: Any = [{"role": "user", "content": "Say hello."}]
WEATHER: dict[str, Any] = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Rome"]}, "celsius": {"type": "boolean"}},
    "required": ["city", "celsius"],
}
NO_ARGS: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}
TOOLS: Any = [
    {"name": "weather", "description": "The weather in a city", "input_schema": WEATHER},
    {"name": "clock", "description": "The time now", "input_schema": NO_ARGS},
]
# The SDK's create() has no sampling parameters (Anthropic's newest models take none); the API
# and kvmesh take temperature, top_p and top_k in the body.
GREEDY: Any = {"temperature": 0}
SYSTEM = "You are a careful agent. Use the tools when they help. " * 6


@dataclass
class Mesh:
    router: RunningRouter
    base_url: str  # what the anthropic SDK takes (it adds /v1/messages)


@pytest.fixture(scope="module")
async def mesh(tiny_model: Path, etcd) -> AsyncIterator[Mesh]:
    with pytest.MonkeyPatch.context() as mp:
        for key, value in VLLM_ENVIRONMENT.items():
            mp.setenv(key, os.environ.get(key, value))
        from services.worker.engine import VllmEngine
        from services.worker.server import start_worker

        cluster = "anthropic"
        endpoints = tuple(etcd.endpoints)
        config = WorkerConfig(
            engine=EngineConfig(
                model=str(tiny_model),
                served_model_name="tiny",
                dtype="float32",
                max_model_len=2048,
                block_size=BLOCK,
                kv_cache_bytes=32 << 20,
                structured_outputs_config={"backend": "xgrammar", "disable_any_whitespace": True},
            ),
            worker_id="w-anthropic",
            cluster=cluster,
            etcd_endpoints=endpoints,
            drain_grace_s=2.0,
            metrics_port=-1,
        )
        engine = await VllmEngine.start(config.engine)
        worker = await start_worker(config, engine)
        router = await start_router(
            RouterConfig(
                cluster=cluster,
                etcd_endpoints=endpoints,
                metrics_port=-1,
                http_port=0,
                drain_grace_s=1.0,
            )
        )
        try:
            deadline = time.monotonic() + 30
            while not router.workers.candidates("tiny"):
                assert time.monotonic() < deadline, "the router does not see the worker"
                await asyncio.sleep(0.05)
            assert router.http is not None
            yield Mesh(router, f"http://{router.http.host}:{router.http.port}")
        finally:
            await router.stop()
            await worker.stop()


@pytest.fixture
async def client(mesh: Mesh) -> AsyncIterator[anthropic.AsyncAnthropic]:
    async with anthropic.AsyncAnthropic(
        base_url=mesh.base_url, api_key="sk-test", max_retries=0
    ) as c:
        yield c


def prompt_tokens(usage: anthropic.types.Usage) -> int:
    return (
        usage.input_tokens
        + (usage.cache_creation_input_tokens or 0)
        + (usage.cache_read_input_tokens or 0)
    )


def text_of(message: anthropic.types.Message) -> str:
    return "".join(b.text for b in message.content if b.type == "text")


async def test_sync_client(mesh: Mesh):
    """The sync SDK client (in a thread: the router serves on this test's loop)."""

    def ask() -> anthropic.types.Message:
        with anthropic.Anthropic(base_url=mesh.base_url, api_key="x", max_retries=0) as c:
            return c.messages.create(model="tiny", max_tokens=8, messages=HI, extra_body=GREEDY)

    msg = await asyncio.to_thread(ask)
    assert msg.type == "message" and msg.role == "assistant" and msg.model == "tiny"
    assert msg.stop_reason in ("end_turn", "max_tokens")
    assert 0 < msg.usage.output_tokens <= 8
    assert (msg.usage.output_tokens == 8) == (msg.stop_reason == "max_tokens")
    assert text_of(msg)


async def test_stream_matches_the_whole_answer_and_count_tokens_the_usage(
    client: anthropic.AsyncAnthropic,
):
    args: Any = {
        "model": "tiny",
        "max_tokens": 16,
        "messages": HI,
        "extra_body": GREEDY,
        "system": [
            {"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral"}},
            {"type": "text", "text": "Answer briefly."},
        ],
    }
    whole = await client.messages.create(**args)
    async with client.messages.stream(**args) as stream:
        events = [event.type async for event in stream]
        final = await stream.get_final_message()
    assert events[0] == "message_start" and events[-1] == "message_stop"
    assert "content_block_delta" in events and "message_delta" in events
    assert text_of(final) == text_of(whole)
    assert final.stop_reason == whole.stop_reason
    assert final.usage.output_tokens == whole.usage.output_tokens
    assert prompt_tokens(final.usage) == prompt_tokens(whole.usage)
    # The second answer found the first's prompt cached (its whole blocks).
    assert (final.usage.cache_read_input_tokens or 0) >= prompt_tokens(whole.usage) - BLOCK
    counted = await client.messages.count_tokens(model="tiny", messages=HI, system=args["system"])
    assert counted.input_tokens == prompt_tokens(whole.usage)
    with_tools = await client.messages.count_tokens(
        model="tiny", messages=HI, system=args["system"], tools=TOOLS
    )
    assert with_tools.input_tokens > counted.input_tokens + 20  # the tools are in the template


async def test_stop_sequence(client: anthropic.AsyncAnthropic):
    args: Any = {"model": "tiny", "max_tokens": 24, "messages": HI, "extra_body": GREEDY}
    text = text_of(await client.messages.create(**args))
    assert len(text) > 8, text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    prefix = text[: text.index(stop)]
    for stream in (False, True):
        if stream:
            async with client.messages.stream(**args, stop_sequences=[stop]) as s:
                msg = await s.get_final_message()
        else:
            msg = await client.messages.create(**args, stop_sequences=[stop])
        assert (msg.stop_reason, msg.stop_sequence) == ("stop_sequence", stop), stream
        assert text_of(msg) == prefix


async def test_tool_use_loop_with_tool_result(client: anthropic.AsyncAnthropic):
    """Turn 1 is forced to call weather; its tool_use goes back with a tool_result; turn 2
    answers freely. One session (metadata.user_id): turn 2 reads turn 1's prompt from cache."""
    messages: Any = [{"role": "user", "content": "What is the weather in Paris?"}]
    meta: Any = {"user_id": "agent-tools"}
    first = await client.messages.create(
        model="tiny",
        max_tokens=48,
        messages=messages,
        system=SYSTEM,
        tools=TOOLS,
        tool_choice={"type": "tool", "name": "weather"},
        extra_body=GREEDY,
        metadata=meta,
    )
    assert first.stop_reason == "tool_use"
    (call,) = [b for b in first.content if b.type == "tool_use"]
    assert call.name == "weather" and call.id.startswith("toolu_")
    jsonschema.validate(call.input, WEATHER)
    messages += [
        {"role": "assistant", "content": [b.model_dump() for b in first.content]},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "Sunny, 21C"}],
        },
    ]
    second = await client.messages.create(
        model="tiny",
        max_tokens=8,
        messages=messages,
        system=SYSTEM,
        tools=TOOLS,
        extra_body=GREEDY,
        metadata=meta,
    )
    assert second.stop_reason in ("end_turn", "max_tokens", "tool_use")
    assert prompt_tokens(second.usage) > prompt_tokens(first.usage)
    assert (second.usage.cache_read_input_tokens or 0) >= prompt_tokens(first.usage) - 2 * BLOCK


@pytest.mark.parametrize("choice", [{"type": "any"}, {"type": "tool", "name": "weather"}])
async def test_forced_tool_use_streams(client: anthropic.AsyncAnthropic, choice: Any):
    async with client.messages.stream(
        model="tiny",
        max_tokens=48,
        messages=[{"role": "user", "content": "Weather?"}],
        tools=TOOLS,
        tool_choice=choice,
        extra_body=GREEDY,
    ) as stream:
        kinds = [e.delta.type async for e in stream if e.type == "content_block_delta"]
        final = await stream.get_final_message()
    assert final.stop_reason == "tool_use"
    calls = [b for b in final.content if b.type == "tool_use"]
    assert calls and "input_json_delta" in kinds
    for call in calls:
        if call.name == "weather":
            jsonschema.validate(call.input, WEATHER)
        else:
            assert (call.name, call.input) == ("clock", {})


async def test_output_config_format_is_structured_output(client: anthropic.AsyncAnthropic):
    msg = await client.messages.create(
        model="tiny",
        max_tokens=48,
        messages=HI,
        output_config={"format": {"type": "json_schema", "schema": WEATHER}},
        extra_body=GREEDY,
    )
    assert msg.stop_reason == "end_turn"
    jsonschema.validate(json.loads(text_of(msg)), WEATHER)


async def test_a_session_reads_more_from_cache_turn_after_turn(client: anthropic.AsyncAnthropic):
    """A multi-turn conversation: each turn resends the history and its answer, so the cache
    covers more of the prompt turn after turn."""
    messages: Any = []
    read: list[int] = []
    prompts: list[int] = []
    for turn in range(4):
        messages.append(
            {"role": "user", "content": f"Turn {turn}: " + " ".join(f"fact{i}" for i in range(30))}
        )
        msg = await client.messages.create(
            model="tiny",
            max_tokens=6,
            system=SYSTEM,
            messages=messages,
            extra_body=GREEDY,
            metadata={"user_id": "agent-session"},
        )
        read.append(msg.usage.cache_read_input_tokens or 0)
        prompts.append(prompt_tokens(msg.usage))
        messages.append({"role": "assistant", "content": text_of(msg) or "ok"})
    assert all(b > a for a, b in itertools.pairwise(prompts)), prompts
    assert all(b > a for a, b in itertools.pairwise(read)), (read, prompts)
    assert read[-1] >= prompts[-2] - 2 * BLOCK  # nearly all of the previous turn


async def test_max_tokens_past_the_context_is_lowered_to_its_room(
    client: anthropic.AsyncAnthropic,
):
    """Claude Code sends max_tokens 32000 whatever the context (2048 here): the answer runs to
    the context's end and says so, instead of a 400."""
    messages: Any = [{"role": "user", "content": "alpha beta gamma delta " * 121}]
    counted = (await client.messages.count_tokens(model="tiny", messages=messages)).input_tokens
    assert 1900 < counted < 2048, counted  # a room of a few dozen tokens
    msg = await client.messages.create(  # a timeout: the SDK wants one for max_tokens 32000
        model="tiny", max_tokens=32000, messages=messages, extra_body=GREEDY, timeout=120
    )
    assert msg.stop_reason == "model_context_window_exceeded"
    assert msg.usage.output_tokens == 2048 - counted
    assert (await client.messages.count_tokens(model="tiny", messages=HI)).input_tokens < 100
    short = await client.messages.create(model="tiny", max_tokens=3, messages=HI, extra_body=GREEDY)
    assert short.stop_reason == "max_tokens" and short.usage.output_tokens == 3


async def test_errors(client: anthropic.AsyncAnthropic, mesh: Mesh, etcd):
    with pytest.raises(anthropic.NotFoundError) as missing:
        await client.messages.create(model="nope", max_tokens=4, messages=HI)
    assert missing.value.body["error"]["type"] == "not_found_error"  # type: ignore[index]
    with pytest.raises(anthropic.BadRequestError) as hot:
        await client.messages.create(
            model="tiny", max_tokens=4, messages=HI, extra_body={"temperature": 3.0}
        )
    assert "temperature" in hot.value.message
    too_long: Any = [{"role": "user", "content": "alpha beta gamma delta " * 200}]
    with pytest.raises(anthropic.BadRequestError) as long:  # a prompt past the context
        await client.messages.create(model="tiny", max_tokens=5, messages=too_long)
    assert long.value.body["error"]["type"] == "invalid_request_error"  # type: ignore[index]

    empty = await start_router(
        RouterConfig(
            cluster="anthropic-empty",
            etcd_endpoints=tuple(etcd.endpoints),
            metrics_port=-1,
            http_port=0,
            drain_grace_s=1.0,
        )
    )
    try:
        assert empty.http is not None
        async with anthropic.AsyncAnthropic(
            base_url=f"http://{empty.http.host}:{empty.http.port}", api_key="x", max_retries=0
        ) as none:
            with pytest.raises(anthropic.APIStatusError) as busy:
                await none.messages.create(model="tiny", max_tokens=4, messages=HI)
    finally:
        await empty.stop()
    assert busy.value.status_code == 529
    assert busy.value.body["error"]["type"] == "overloaded_error"  # type: ignore[index]
