"""The OpenAI Responses API on real parts: a real vLLM worker (tiny model, float32) behind the
worker gRPC service, found through a real etcd by real routers serving HTTP, their state in a
real SQLite file or a real redis-server; driven by the official ``openai`` SDK's
``client.responses`` (streaming and not, a function-tool loop, a ``previous_response_id`` chain)
and the OpenAI Agents SDK's Responses model.

The tiny model is random: its words mean nothing, so tool calls come from forced tool choices
(constrained decoding makes them valid; xgrammar without free whitespace ends the JSON well
within max_output_tokens). Greedy decoding makes answers reproducible."""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import openai
import pytest

from services.router.config import RouterConfig
from services.router.main import RunningRouter, start_router
from services.router.state import ResponsesConfig, StoreKind, open_store
from services.worker.config import EngineConfig, WorkerConfig
from services.worker.main import VLLM_ENVIRONMENT

from .local_redis import LocalRedis

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

BLOCK = 32
CLUSTER = "responses"
INSTRUCTIONS = "You are a careful agent. Use the tools when they help. " * 8
WEATHER: dict[str, Any] = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Rome"]}, "celsius": {"type": "boolean"}},
    "required": ["city", "celsius"],
}
TOOLS: Any = [
    {"type": "function", "name": "weather", "description": "The weather", "parameters": WEATHER}
]


@dataclass
class Worker:
    endpoints: tuple[str, ...]


@pytest.fixture(scope="module")
async def worker(tiny_model: Path, etcd) -> AsyncIterator[Worker]:
    with pytest.MonkeyPatch.context() as mp:
        for key, value in VLLM_ENVIRONMENT.items():
            mp.setenv(key, os.environ.get(key, value))
        from services.worker.engine import VllmEngine
        from services.worker.server import start_worker

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
            worker_id="w-responses",
            cluster=CLUSTER,
            etcd_endpoints=endpoints,
            drain_grace_s=2.0,
            metrics_port=-1,
        )
        engine = await VllmEngine.start(config.engine)
        running = await start_worker(config, engine)
        try:
            yield Worker(endpoints)
        finally:
            await running.stop()


Router = Callable[[ResponsesConfig], Any]  # an async context manager of (router, base URL)


@pytest.fixture(scope="module")
def router(worker: Worker) -> Router:
    @asynccontextmanager
    async def start(responses: ResponsesConfig) -> AsyncIterator[tuple[RunningRouter, str]]:
        r = await start_router(
            RouterConfig(
                cluster=CLUSTER,
                etcd_endpoints=worker.endpoints,
                metrics_port=-1,
                http_port=0,
                drain_grace_s=1.0,
                responses=responses,
            )
        )
        try:
            deadline = time.monotonic() + 30
            while not r.workers.candidates("tiny"):
                assert time.monotonic() < deadline, "the router does not see the worker"
                await asyncio.sleep(0.05)
            assert r.http is not None
            yield r, r.http.base_url
        finally:
            await r.stop()

    return start


@pytest.fixture(scope="module")
def sqlite_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("responses") / "responses.sqlite3"


@pytest.fixture(scope="module")
async def base_url(router: Router, sqlite_path: Path) -> AsyncIterator[str]:
    async with router(ResponsesConfig(sqlite_path=sqlite_path)) as (_, url):
        yield url


@pytest.fixture
async def client(base_url: str) -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai.AsyncOpenAI(base_url=base_url, api_key="sk-test", max_retries=0) as c:
        yield c


def text_of(response: Any) -> str:
    return "".join(
        part.text for item in response.output if item.type == "message" for part in item.content
    )


def reused(previous: Any, current: Any) -> float:
    """The share of the previous turn's KV blocks (its prompt and output, less the last output
    token, which the engine never computed) that the current turn read from cache."""
    tokens = previous.usage.input_tokens + previous.usage.output_tokens - 1
    return current.usage.input_tokens_details.cached_tokens / ((tokens // BLOCK) * BLOCK)


async def test_text_answer_get_and_delete(client: openai.AsyncOpenAI):
    resp = await client.responses.create(
        model="tiny", input="Say hello.", max_output_tokens=8, temperature=0
    )
    assert resp.object == "response" and resp.id.startswith("resp_") and resp.model == "tiny"
    assert resp.status == "incomplete" or resp.status == "completed"
    assert (resp.status == "incomplete") == (resp.usage.output_tokens == 8)
    assert resp.output[0].type == "message" and text_of(resp)
    assert resp.usage.input_tokens > 0 and resp.usage.total_tokens == (
        resp.usage.input_tokens + resp.usage.output_tokens
    )
    got = await client.responses.retrieve(resp.id)
    assert got.id == resp.id and text_of(got) == text_of(resp)
    await client.responses.delete(resp.id)
    with pytest.raises(openai.NotFoundError):
        await client.responses.retrieve(resp.id)
    with pytest.raises(openai.NotFoundError):
        await client.responses.delete(resp.id)


async def test_stream_is_the_same_answer(client: openai.AsyncOpenAI):
    args: Any = {
        "model": "tiny",
        "instructions": INSTRUCTIONS,
        "input": [{"role": "user", "content": "Tell me a story."}],
        "max_output_tokens": 12,
        "temperature": 0,
    }
    whole = await client.responses.create(**args, store=False)
    events = [event async for event in await client.responses.create(**args, stream=True)]
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[2:4] == ["response.output_item.added", "response.content_part.added"]
    assert "response.output_text.delta" in kinds
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete" if whole.status == "incomplete" else "response.completed",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    final = events[-1].response
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == text_of(final) == text_of(whole)
    assert final.usage.output_tokens == whole.usage.output_tokens
    assert final.usage.input_tokens == whole.usage.input_tokens
    # The second found the first's prompt cached (its whole blocks).
    assert final.usage.input_tokens_details.cached_tokens >= whole.usage.input_tokens - BLOCK
    # store: false is not kept; the streamed one is.
    with pytest.raises(openai.NotFoundError):
        await client.responses.retrieve(whole.id)
    assert text_of(await client.responses.retrieve(final.id)) == deltas


async def test_a_chain_extends_each_turn_and_reads_it_from_cache(
    client: openai.AsyncOpenAI, sqlite_path: Path
):
    """Four turns chained by previous_response_id, each sending only its new message: every
    prompt extends the previous turn's prompt and output ids exactly (as stored), and reads
    >= 99% of the previous turn's blocks from the engine's cache."""
    turns: list[Any] = []
    previous = None
    for i in range(4):
        resp = await client.responses.create(
            model="tiny",
            instructions=INSTRUCTIONS,
            input=f"Question {i}: what is in the garden?",
            previous_response_id=previous,
            max_output_tokens=16,
            temperature=0,
        )
        turns.append(resp)
        previous = resp.id
    cached = [t.usage.input_tokens_details.cached_tokens for t in turns]
    assert cached == sorted(cached) and cached[-1] > cached[0], cached
    for before, after in itertools.pairwise(turns):
        assert after.model_extra["kvmesh"]["prompt"] == "extended"
        assert after.previous_response_id == before.id
        assert reused(before, after) >= 0.99, (reused(before, after), cached)
    sessions = {t.model_extra["kvmesh"]["session_id"] for t in turns}
    assert sessions == {turns[0].id}  # the chain is one session
    store = open_store(ResponsesConfig(sqlite_path=sqlite_path), CLUSTER)
    try:
        records = [await store.get(t.id) for t in turns]
    finally:
        await store.close()
    for before, after in itertools.pairwise(records):
        assert before is not None and after is not None
        previous_ids = [*before.prompt_ids, *before.output_ids]
        assert list(after.prompt_ids[: len(previous_ids)]) == previous_ids
        assert len(after.prompt_ids) == turns[records.index(after)].usage.input_tokens


async def test_function_tool_loop(client: openai.AsyncOpenAI):
    """Turn 1 is forced to call weather (streamed: the call's argument events); its
    function_call_output goes back on turn 2, chained, with the same tools: the prompt extends
    turn 1's and the model answers."""
    args: Any = {"model": "tiny", "instructions": INSTRUCTIONS, "tools": TOOLS, "temperature": 0}
    stream = await client.responses.create(
        **args,
        input="Weather in Paris?",
        tool_choice="required",
        max_output_tokens=160,
        stream=True,
    )
    events = [e async for e in stream]
    kinds = [e.type for e in events]
    assert "response.function_call_arguments.delta" in kinds, events
    assert "response.function_call_arguments.done" in kinds
    first = events[-1].response
    assert first.status == "completed"
    calls = [item for item in first.output if item.type == "function_call"]
    assert calls and calls[0].name == "weather", first.output
    assert json.loads(calls[0].arguments)["city"] in ("Paris", "Rome")
    second = await client.responses.create(
        **args,
        previous_response_id=first.id,
        input=[
            {"type": "function_call_output", "call_id": calls[0].call_id, "output": "Sunny, 21C"}
        ],
        max_output_tokens=8,
    )
    assert second.model_extra["kvmesh"]["prompt"] == "extended"
    assert reused(first, second) >= 0.99
    assert text_of(second) or any(i.type == "function_call" for i in second.output)
    # The same loop without server state: the whole conversation as items.
    third = await client.responses.create(
        **args,
        input=[
            {"role": "user", "content": "Weather in Paris?"},
            calls[0].model_dump(exclude_none=True),
            {"type": "function_call_output", "call_id": calls[0].call_id, "output": "Sunny, 21C"},
        ],
        max_output_tokens=8,
        store=False,
    )
    assert third.usage.input_tokens > first.usage.input_tokens


async def test_errors(client: openai.AsyncOpenAI):
    with pytest.raises(openai.NotFoundError) as nf:
        await client.responses.create(
            model="tiny", input="hi", previous_response_id="resp_nope", max_output_tokens=4
        )
    assert nf.value.code == "previous_response_not_found"
    assert nf.value.body["param"] == "previous_response_id"  # type: ignore[index]
    bad: list[tuple[dict[str, Any], str]] = [
        ({"input": [{"type": "web_search_call", "id": "x"}]}, "input[0].type"),
        ({"input": "hi", "tools": [{"name": "f"}]}, "tools[0].type"),
        ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, "input_image"),
        ({"input": "hi", "tool_choice": "sometimes"}, "tool_choice"),
        ({"input": "hi", "max_output_tokens": 100_000}, "max_output_tokens"),
        ({}, "input: Field required"),
    ]
    for body, says in bad:
        with pytest.raises(openai.BadRequestError) as br:
            await client.responses.create(model="tiny", **body)
        param = br.value.body.get("param")  # type: ignore[union-attr]
        assert says in str(br.value) or says == param, (body, str(br.value), param)


async def test_a_conversation_survives_a_router_restart(router: Router, tmp_path: Path):
    """SQLite: turn 1 on a router, the router stops, a new one on the same file serves turn 2
    from the stored conversation, extending it (and the worker still has its blocks)."""
    config = ResponsesConfig(sqlite_path=tmp_path / "restart.sqlite3")
    async with router(config) as (_, url), openai.AsyncOpenAI(base_url=url, api_key="x") as c:
        first = await c.responses.create(
            model="tiny", instructions=INSTRUCTIONS, input="Hi.", max_output_tokens=8
        )
    async with router(config) as (_, url), openai.AsyncOpenAI(base_url=url, api_key="x") as c:
        second = await c.responses.create(
            model="tiny",
            instructions=INSTRUCTIONS,
            input="And then?",
            previous_response_id=first.id,
            max_output_tokens=8,
        )
        assert (await c.responses.retrieve(first.id)).id == first.id
    assert second.model_extra["kvmesh"]["prompt"] == "extended"
    assert reused(first, second) >= 0.99


async def test_two_routers_share_a_conversation_through_redis(
    router: Router, redis_server: LocalRedis
):
    config = ResponsesConfig(store=StoreKind.REDIS, redis_url=redis_server.url)
    async with router(config) as (_, url_a), router(config) as (_, url_b):
        async with openai.AsyncOpenAI(base_url=url_a, api_key="x") as a:
            first = await a.responses.create(
                model="tiny", instructions=INSTRUCTIONS, input="Hi.", max_output_tokens=8
            )
        async with openai.AsyncOpenAI(base_url=url_b, api_key="x") as b:
            second = await b.responses.create(
                model="tiny",
                instructions=INSTRUCTIONS,
                input="And then?",
                previous_response_id=first.id,
                max_output_tokens=8,
            )
            await b.responses.delete(first.id)
        async with openai.AsyncOpenAI(base_url=url_a, api_key="x") as a:
            with pytest.raises(openai.NotFoundError):
                await a.responses.retrieve(first.id)  # deleted through the other router
    assert second.model_extra["kvmesh"]["prompt"] == "extended"
    assert reused(first, second) >= 0.99


async def test_agents_sdk_responses_model_chains_turns(base_url: str):
    """The Agents SDK on its Responses model, chaining with previous_response_id: turn 1 is
    forced to call the tool, the SDK runs it and sends the result on turn 2 (tool_choice reset
    to auto), whose output is constrained to the agent's output type."""
    from agents import (
        Agent,
        ModelSettings,
        OpenAIResponsesModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )
    from pydantic import BaseModel

    set_tracing_disabled(True)
    seen: list[str] = []

    class Verdict(BaseModel):
        ok: bool
        color: Literal["red", "green"]

    @function_tool
    def paint(color: Literal["red", "green"]) -> str:
        """Paint the wall."""
        seen.append(color)
        return f"painted {color}"

    async with openai.AsyncOpenAI(base_url=base_url, api_key="EMPTY", max_retries=0) as client:
        agent = Agent(
            name="painter",
            instructions="Paint the wall, then say whether it went well.",
            model=OpenAIResponsesModel(model="tiny", openai_client=client),
            tools=[paint],
            output_type=Verdict,
            model_settings=ModelSettings(tool_choice="required", temperature=0, max_tokens=64),
        )
        result = await asyncio.wait_for(
            Runner.run(agent, "Paint it.", max_turns=3, auto_previous_response_id=True), 120
        )
        assert seen and seen[0] in ("red", "green")
        assert isinstance(result.final_output, Verdict)
        ids = [r.response_id for r in result.raw_responses]
        assert len(ids) == 2
        second = await client.responses.retrieve(ids[1])
    assert second.previous_response_id == ids[0]
    assert second.model_extra["kvmesh"]["prompt"] == "extended"
