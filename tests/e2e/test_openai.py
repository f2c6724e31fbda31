"""The OpenAI front door against the real mesh (etcd, kvmanager, two vLLM workers on the tiny
model, router), driven by the official ``openai`` client, sync and async, streaming and not.
The router process serves it (--http-port) beside its gRPC API."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import aiohttp
import openai
import pytest

from kvmesh.launcher import Mesh

from .test_mesh import wait_idle

pytestmark = pytest.mark.e2e

HI = [{"role": "user", "content": "Say hello."}]
TOOLS: Any = [
    {
        "type": "function",
        "function": {
            "name": "weather",
            "description": "Today's weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]


@dataclass(frozen=True)
class Front:
    """The router process's own OpenAI-compatible front door (its --http-port)."""

    base_url: str


@pytest.fixture(scope="module")
async def http(mesh: Mesh) -> Front:
    front = Front(mesh.http_base_url)
    # A fresh mesh takes a moment to list its workers.
    async with openai.AsyncOpenAI(base_url=front.base_url, api_key="EMPTY") as c:
        for _ in range(300):
            if [m.id for m in (await c.models.list()).data]:
                break
            await asyncio.sleep(0.1)
    return front


@pytest.fixture
async def aclient(http: Front) -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai.AsyncOpenAI(base_url=http.base_url, api_key="EMPTY", max_retries=0) as c:
        yield c


def sync_client(http: Front) -> openai.OpenAI:
    """A sync client; callers close it (``with``), or its connections outlive the test."""
    return openai.OpenAI(base_url=http.base_url, api_key="EMPTY", max_retries=0)


def worker_ids(mesh: Mesh) -> set[str]:
    return {w.ready["worker_id"] for w in mesh.workers}


async def test_models_lists_tiny(aclient: openai.AsyncOpenAI, http: Front):
    assert [m.id for m in (await aclient.models.list()).data] == ["tiny"]

    def sync_call() -> Any:
        with sync_client(http) as c:
            return c.models.retrieve("tiny")

    got = await asyncio.to_thread(sync_call)
    assert got.id == "tiny"


async def test_chat_async_and_sync(aclient: openai.AsyncOpenAI, http: Front, mesh: Mesh):
    raw = await aclient.chat.completions.with_raw_response.create(
        model="tiny", messages=HI, max_tokens=6, temperature=0, seed=1, user="u1"
    )
    resp = raw.parse()
    assert isinstance(resp.choices[0].message.content, str)
    assert resp.choices[0].finish_reason in ("stop", "length")
    assert resp.usage is not None and 0 < resp.usage.completion_tokens <= 6
    assert resp.usage.prompt_tokens_details is not None
    assert raw.headers["x-kvmesh-worker"] in worker_ids(mesh)
    assert (resp.model_extra or {})["kvmesh"]["worker_id"] == raw.headers["x-kvmesh-worker"]

    def sync_call() -> Any:
        with sync_client(http) as c:
            return c.chat.completions.create(
                model="tiny", messages=HI, max_completion_tokens=6, temperature=0, seed=1
            )

    again = await asyncio.to_thread(sync_call)
    # Greedy, same prompt: the same answer, now from the prefix cache.
    assert again.choices[0].message.content == resp.choices[0].message.content
    assert again.usage is not None and again.usage.prompt_tokens == resp.usage.prompt_tokens


async def test_completions_async_and_sync(aclient: openai.AsyncOpenAI, http: Front):
    resp = await aclient.completions.create(
        model="tiny", prompt="Once upon a time", max_tokens=5, temperature=0, stop=["\n\n"]
    )
    assert isinstance(resp.choices[0].text, str)
    assert resp.usage is not None and resp.usage.completion_tokens <= 5

    def sync_call() -> Any:
        with sync_client(http) as c:
            return c.completions.create(
                model="tiny", prompt=[5, 6, 7, 8], max_tokens=3, temperature=0
            )

    ids = await asyncio.to_thread(sync_call)
    assert ids.usage is not None and ids.usage.prompt_tokens == 4


async def test_streaming_async_and_sync(aclient: openai.AsyncOpenAI, http: Front):
    stream = await aclient.chat.completions.create(
        model="tiny",
        messages=HI,
        max_tokens=8,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = [c async for c in stream]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    usage = chunks[-1].usage
    assert finish in (["stop"], ["length"])
    assert usage is not None and 0 < usage.completion_tokens <= 8
    assert not chunks[-1].choices

    def sync_stream() -> str:
        with sync_client(http) as client:
            s = client.completions.create(
                model="tiny", prompt="Hello", max_tokens=8, temperature=0, stream=True
            )
            return "".join(c.choices[0].text for c in s if c.choices)

    assert isinstance(await asyncio.to_thread(sync_stream), str)
    assert text is not None


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
async def test_errors_map(aclient: openai.AsyncOpenAI, stream: bool):
    with pytest.raises(openai.NotFoundError) as nf:
        await aclient.chat.completions.create(model="nope", messages=HI, stream=stream)
    assert "tiny" in nf.value.message  # says which models are served
    with pytest.raises(openai.BadRequestError) as n0:
        await aclient.chat.completions.create(model="tiny", messages=HI, n=0, stream=stream)
    assert n0.value.body["param"] == "n"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError, match="max_tokens") as long:
        await aclient.completions.create(model="tiny", prompt="x", max_tokens=5000, stream=stream)
    assert long.value.body["param"] == "max_tokens"  # type: ignore[index]  # found by the router
    with pytest.raises(openai.BadRequestError) as hot:
        await aclient.chat.completions.create(
            model="tiny", messages=HI, temperature=2.5, stream=stream
        )
    assert hot.value.body["param"] == "temperature"  # type: ignore[index]


async def test_agent_loop_cached_tokens_rise(aclient: openai.AsyncOpenAI):
    """A small agent: system prompt, tools, a growing history with structured tool calls and
    tool results, one session. The chat template renders all of them (hermes-style for the tiny
    model); each turn re-sends the history, so the cache covers more of it turn after turn."""
    tool_output = " ".join(f"row{i}=value{i * 7}" for i in range(40))
    messages: list[Any] = [
        {"role": "system", "content": "You are a careful agent. Use tools. " * 8},
        {"role": "user", "content": "Find the weather in Paris, then in Rome, then in Oslo."},
    ]
    cached: list[int] = []
    prompts: list[int] = []
    for turn, city in enumerate(["Paris", "Rome", "Oslo", "Lima"]):
        resp = await aclient.chat.completions.create(
            model="tiny",
            messages=messages,
            max_tokens=4,
            temperature=0,
            tools=TOOLS,
            tool_choice="auto",
            extra_headers={"x-kvmesh-session-id": "agent-1"},
        )
        assert resp.choices[0].finish_reason in ("stop", "length", "tool_calls")
        assert resp.usage is not None and resp.usage.prompt_tokens_details is not None
        cached.append(resp.usage.prompt_tokens_details.cached_tokens or 0)
        prompts.append(resp.usage.prompt_tokens)
        call_id = f"call-{turn}"
        messages += [
            {
                "role": "assistant",
                "content": resp.choices[0].message.content,
                "tool_calls": [
                    {
                        "id": call_id,
                        "type": "function",
                        "function": {"name": "weather", "arguments": f'{{"city": "{city}"}}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": call_id, "content": f"{city}: {tool_output}"},
        ]
    assert prompts == sorted(prompts) and len(set(prompts)) == len(prompts)
    assert all(b > a for a, b in itertools.pairwise(cached)), (cached, prompts)
    assert cached[-1] >= prompts[-2] - 64  # nearly all of the previous turn, in full blocks
    # The tools reach the template: without them (tool_choice "none") the first prompt is shorter.
    hidden = await aclient.chat.completions.create(
        model="tiny", messages=messages[:2], max_tokens=1, tools=TOOLS, tool_choice="none"
    )
    assert hidden.usage is not None and hidden.usage.prompt_tokens < prompts[0] - 50


async def test_client_disconnect_aborts_in_the_engine(http: Front, mesh: Mesh):
    body = {
        "model": "tiny",
        "prompt": [7, 300, 12, 999] * 10,
        "max_tokens": 1500,
        "ignore_eos": True,
        "stream": True,
    }
    async with aiohttp.ClientSession() as s:
        resp = await s.post(http.base_url + "/completions", json=body)
        assert resp.status == 200
        for _ in range(3):
            await resp.content.readline()
        resp.close()
    loads = await wait_idle(mesh)
    assert all(ld.running_requests == 0 for ld in loads)
