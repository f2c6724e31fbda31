"""Log probabilities and echo on real parts: a real vLLM worker (tiny model, float32) behind the
worker gRPC service, found through a real etcd by a real router serving the OpenAI front door,
driven by the official ``openai`` client (and aiohttp for ``vllm bench serve``'s request), and by
gRPC (``Router.Generate`` over the worker's ``GenerateMany`` stream and over the unary
``Worker.Generate`` with ``--no-worker-mux``). Greedy decoding makes each answer reproducible, so
streamed and whole answers, and the two data paths, must agree token for token."""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import openai
import pytest

from kvmesh.client import RouterClient, make_request
from services.router.config import RouterConfig
from services.router.main import RunningRouter, start_router
from services.worker.config import EngineConfig, WorkerConfig
from services.worker.main import VLLM_ENVIRONMENT

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

HI = [{"role": "user", "content": "Say hello."}]
GREEDY: dict[str, Any] = {"temperature": 0, "extra_body": {"ignore_eos": True}}
MAX_LOGPROBS = 20  # vLLM's default max_logprobs, which the worker enforces


@dataclass
class Mesh:
    router: RunningRouter  # data path: GenerateMany
    unary: RunningRouter  # data path: one Worker.Generate per request
    client: openai.AsyncOpenAI
    base_url: str


@pytest.fixture(scope="module")
async def mesh(tiny_model: Path, etcd) -> AsyncIterator[Mesh]:
    with pytest.MonkeyPatch.context() as mp:
        for key, value in VLLM_ENVIRONMENT.items():
            mp.setenv(key, os.environ.get(key, value))
        from services.worker.engine import VllmEngine
        from services.worker.server import start_worker

        cluster = "logprobs"
        endpoints = tuple(etcd.endpoints)
        config = WorkerConfig(
            engine=EngineConfig(
                model=str(tiny_model),
                served_model_name="tiny",
                dtype="float32",
                max_model_len=512,
                block_size=32,
                kv_cache_bytes=32 << 20,
            ),
            worker_id="w-logprobs",
            cluster=cluster,
            etcd_endpoints=endpoints,
            drain_grace_s=2.0,
            metrics_port=-1,
        )
        engine = await VllmEngine.start(config.engine)
        worker = await start_worker(config, engine)
        routers = [
            await start_router(
                RouterConfig(
                    cluster=cluster,
                    etcd_endpoints=endpoints,
                    metrics_port=-1,
                    http_port=-1 if not mux else 0,
                    worker_mux=mux,
                    drain_grace_s=1.0,
                )
            )
            for mux in (True, False)
        ]
        try:
            deadline = time.monotonic() + 30
            while not all(r.workers.candidates("tiny") for r in routers):
                assert time.monotonic() < deadline, "the routers do not see the worker"
                await asyncio.sleep(0.05)
            http = routers[0].http
            assert http is not None
            async with openai.AsyncOpenAI(
                base_url=http.base_url, api_key="none", max_retries=0
            ) as client:
                yield Mesh(routers[0], routers[1], client, http.base_url)
        finally:
            for r in routers:
                await r.stop()
            await worker.stop()


def check_chat_entries(content: Any, n_tokens: int, top: int) -> None:
    assert content is not None and len(content) == n_tokens
    for e in content:
        assert e.logprob <= 0.0
        assert e.bytes == list(e.token.encode("utf-8", errors="replace"))
        assert len(e.top_logprobs) == top
        lps = [t.logprob for t in e.top_logprobs]
        assert lps == sorted(lps, reverse=True)  # most likely first
        # Greedy: the sampled token is the most likely one.
        assert e.top_logprobs[0].token == e.token
        assert e.top_logprobs[0].logprob == pytest.approx(e.logprob)


async def test_chat_logprobs_one_per_token_with_three_alternatives(mesh: Mesh):
    resp = await mesh.client.chat.completions.create(
        model="tiny", messages=HI, max_tokens=6, logprobs=True, top_logprobs=3, **GREEDY
    )
    choice = resp.choices[0]
    assert resp.usage is not None and resp.usage.completion_tokens == 6
    assert choice.logprobs is not None
    check_chat_entries(choice.logprobs.content, 6, 3)

    stream = await mesh.client.chat.completions.create(
        model="tiny",
        messages=HI,
        max_tokens=6,
        logprobs=True,
        top_logprobs=3,
        stream=True,
        **GREEDY,
    )
    streamed = [e async for c in stream if c.choices and c.choices[0].logprobs
                for e in c.choices[0].logprobs.content or []]  # fmt: skip
    assert [e.model_dump() for e in streamed] == [
        e.model_dump() for e in choice.logprobs.content or []
    ]


async def test_chat_logprobs_without_alternatives_and_without_logprobs(mesh: Mesh):
    own = await mesh.client.chat.completions.create(
        model="tiny", messages=HI, max_tokens=3, logprobs=True, **GREEDY
    )
    assert own.choices[0].logprobs is not None
    content = own.choices[0].logprobs.content
    assert content is not None and len(content) == 3
    assert all(e.top_logprobs == [] and e.logprob <= 0 for e in content)
    plain = await mesh.client.chat.completions.create(
        model="tiny", messages=HI, max_tokens=3, **GREEDY
    )
    assert plain.choices[0].logprobs is None
    assert plain.choices[0].message.content == own.choices[0].message.content


def check_completion_logprobs(lp: Any, n_tokens: int, top: int) -> None:
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == n_tokens
    assert len(lp.text_offset) == n_tokens
    for i, (token, logprob, alternatives) in enumerate(
        zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True)
    ):
        assert logprob <= 0.0
        assert alternatives[token] == pytest.approx(logprob)
        assert 1 <= len(alternatives) <= top + 1  # the token itself and the top n
        assert max(alternatives.values()) == pytest.approx(logprob)  # greedy: the top-1
        if i:
            assert lp.text_offset[i] == lp.text_offset[i - 1] + len(lp.tokens[i - 1])


async def test_completions_logprobs_shape_streamed_equals_whole(mesh: Mesh):
    args: dict[str, Any] = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 5}
    whole = await mesh.client.completions.create(**args, logprobs=2, **GREEDY)
    lp = whole.choices[0].logprobs
    assert lp is not None and lp.text_offset is not None and lp.text_offset[0] == 0
    check_completion_logprobs(lp, 5, 2)
    stream = await mesh.client.completions.create(**args, logprobs=2, stream=True, **GREEDY)
    chunks = [c.choices[0] async for c in stream if c.choices]
    got = [c.logprobs for c in chunks if c.logprobs is not None]
    for name in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        assert [x for g in got for x in getattr(g, name)] == getattr(lp, name), name
    assert "".join(c.text for c in chunks) == whole.choices[0].text


async def test_echo_returns_the_prompt_then_the_completion(mesh: Mesh):
    prompt = "The capital of France is"
    plain = await mesh.client.completions.create(
        model="tiny", prompt=prompt, max_tokens=4, **GREEDY
    )
    echoed = await mesh.client.completions.create(
        model="tiny", prompt=prompt, max_tokens=4, echo=True, **GREEDY
    )
    assert echoed.choices[0].text == prompt + plain.choices[0].text
    assert echoed.choices[0].logprobs is None
    stream = await mesh.client.completions.create(
        model="tiny", prompt=prompt, max_tokens=4, echo=True, stream=True, **GREEDY
    )
    assert "".join([c.choices[0].text async for c in stream if c.choices]) == (
        echoed.choices[0].text
    )


async def test_echo_with_logprobs_scores_the_prompt(mesh: Mesh):
    """What evaluation harnesses send for log-likelihoods (lm-eval's local-completions): token
    ids, echo, logprobs, one token."""
    ids = [20 + 3 * i for i in range(12)]
    resp = await mesh.client.completions.create(
        model="tiny", prompt=ids, max_tokens=1, echo=True, logprobs=1, **GREEDY
    )
    choice = resp.choices[0]
    lp = choice.logprobs
    assert lp is not None and lp.token_logprobs is not None and lp.top_logprobs is not None
    assert lp.tokens is not None and len(lp.tokens) == len(ids) + 1
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # nothing precedes it
    assert all(x is not None and x <= 0 for x in lp.token_logprobs[1:])
    assert choice.text == "".join(lp.tokens)
    prompt_logprobs = (choice.model_extra or {})["prompt_logprobs"]  # vLLM's extension
    assert len(prompt_logprobs) == len(ids) and prompt_logprobs[0] is None
    for position, token_id, logprob in zip(
        prompt_logprobs[1:], ids[1:], lp.token_logprobs[1 : len(ids)], strict=True
    ):
        assert position[str(token_id)]["logprob"] == pytest.approx(logprob)
    # The prompt's own tokens: scored the same whatever follows (same ids, more tokens).
    longer = await mesh.client.completions.create(
        model="tiny", prompt=ids, max_tokens=3, echo=True, logprobs=1, **GREEDY
    )
    assert longer.choices[0].logprobs is not None
    assert longer.choices[0].logprobs.token_logprobs is not None
    assert longer.choices[0].logprobs.token_logprobs[0] is None
    assert longer.choices[0].logprobs.token_logprobs[1 : len(ids)] == pytest.approx(
        lp.token_logprobs[1 : len(ids)], rel=1e-4, abs=1e-4
    )


@pytest.mark.parametrize(
    ("kind", "args", "param"),
    [
        pytest.param("chat", {"logprobs": True, "top_logprobs": 21}, "top_logprobs", id="top21"),
        pytest.param("chat", {"top_logprobs": 2}, "top_logprobs", id="top-without-logprobs"),
        pytest.param("chat", {"logprobs": True, "top_logprobs": -1}, "top_logprobs", id="neg"),
        pytest.param("completions", {"logprobs": 21}, "logprobs", id="logprobs21"),
        pytest.param("completions", {"echo": True, "logprobs": 25}, "logprobs", id="echo25"),
    ],
)
@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
async def test_bad_values_are_400_naming_the_param(
    mesh: Mesh, kind: str, args: dict[str, Any], param: str, stream: bool
):
    if kind == "chat":
        create: Any = mesh.client.chat.completions.create
        body: dict[str, Any] = {"messages": HI}
    else:
        create, body = mesh.client.completions.create, {"prompt": "x"}
    with pytest.raises(openai.BadRequestError) as bad:
        await create(model="tiny", max_tokens=2, stream=stream, **body, **args)
    assert bad.value.status_code == 400
    assert bad.value.body["param"] == param, bad.value.body  # type: ignore[index]


async def test_grpc_generate_returns_logprobs_on_both_data_paths(mesh: Mesh):
    answers = []
    for router in (mesh.router, mesh.unary):
        request = make_request([30, 31, 32, 33], max_tokens=5, temperature=0.0, ignore_eos=True)
        request.sampling.logprobs = 2
        request.sampling.prompt_logprobs = 1
        async with RouterClient(router.address) as client:
            chunks = [c async for c in client.stream(request, timeout_s=60)]
        got = [
            (e.token_id, e.token, e.rank, e.logprob, len(e.top)) for c in chunks for e in c.logprobs
        ]
        for c in chunks:
            assert len(c.logprobs) == len(c.token_ids)
            for e in c.logprobs:
                assert e.rank == 1 and e.top[0].token_id == e.token_id  # greedy
                assert len(e.top) == 2 and e.top[0].logprob >= e.top[1].logprob
        assert [e.token_id for c in chunks for e in c.logprobs] == [
            t for c in chunks for t in c.token_ids
        ]
        assert len(got) == 5
        prompt = [e for c in chunks for e in c.prompt_logprobs]
        assert [e.token_id for e in prompt] == [30, 31, 32, 33]
        assert not prompt[0].HasField("logprob") and prompt[0].token
        assert all(e.HasField("logprob") and len(e.top) == 1 for e in prompt[1:])
        assert chunks[0].prompt_logprobs and not any(c.prompt_logprobs for c in chunks[1:])
        answers.append(got)
    assert answers[0] == answers[1]
    plain = make_request([30, 31, 32, 33], max_tokens=5, temperature=0.0, ignore_eos=True)
    async with RouterClient(mesh.router.address) as client:
        chunks = [c async for c in client.stream(plain, timeout_s=60)]
    assert not any(c.logprobs or c.prompt_logprobs for c in chunks)
    bad = make_request([30, 31], max_tokens=2)
    bad.sampling.logprobs = MAX_LOGPROBS + 1
    async with RouterClient(mesh.unary.address) as client:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await client.complete(bad)
    assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "sampling.logprobs" in (refused.value.details() or "")


@pytest.mark.parametrize("logprobs", [None, 2], ids=["default", "logprobs"])
async def test_vllm_bench_serve_request_streams(mesh: Mesh, logprobs: int | None):
    """The body ``vllm bench serve`` (openai backend) sends, read as it reads the stream."""
    payload = {
        "model": "tiny",
        "prompt": "Benchmarks stream completions",
        "repetition_penalty": 1.0,
        "max_tokens": 6,
        "logprobs": logprobs,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
        "temperature": 0,
    }
    text, usage, seen = "", None, []
    async with (
        aiohttp.ClientSession() as session,
        session.post(f"{mesh.base_url}/completions", json=payload) as resp,
    ):
        assert resp.status == 200
        async for raw in resp.content:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line.removeprefix("data: "))
            if chunk["choices"]:
                text += chunk["choices"][0]["text"]
                seen.append(chunk["choices"][0]["logprobs"])
            if chunk.get("usage"):
                usage = chunk["usage"]
    assert usage is not None and usage["completion_tokens"] == 6 and text
    if logprobs is None:
        assert all(x is None for x in seen)
    else:
        assert sum(len(x["tokens"]) for x in seen if x) == 6
