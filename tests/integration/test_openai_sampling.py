"""Sampling controls, several choices and several prompts through the OpenAI front door of a real
router in front of a real vLLM worker (tiny model, real etcd), driven by the official ``openai``
client; the new sampling fields also over gRPC ``Router.Generate``.

``n`` > 1: the choices have indexes 0..n-1, the prompt is counted once in ``usage``, and the
choices after the first find the prompt's KV in the worker's prefix cache (their ``kvmesh``
entries say so); with a seed, choice j samples as seed + j does alone. Several prompts: one
choice per prompt (times n), each what that prompt gives alone. ``logit_bias``, ``min_tokens``
and the penalties change what greedy decoding produces; out-of-range values are 400s naming the
parameter; a prompt the router refuses fails the whole batch, and a client that leaves a
stream of several choices aborts all of them."""

from __future__ import annotations

import json
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import openai
import pytest
from tokenizers import Tokenizer

from kvmesh import errors
from kvmesh.client import RouterClient, make_request
from kvmesh.grpc_errors import from_rpc_error
from services.router.config import RouterConfig
from services.router.main import RunningRouter, start_router
from services.worker.config import EngineConfig, WorkerConfig
from services.worker.main import VLLM_ENVIRONMENT
from services.worker.server import start_worker
from tests.support import eventually

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

BLOCK = 32
SYSTEM = "You are a terse assistant. " * 24  # several full blocks: a prefix worth caching
MESSAGES = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Say hello."}]
PROMPT = "Once upon a time there was"  # word_token below picks a token it does not hold
EOS = 1  # the tiny model's end of sequence


@dataclass
class Mesh:
    router: RunningRouter
    base_url: str
    tokenizer: Tokenizer

    def in_flight(self) -> float:
        value = self.router.metrics.registry.get_sample_value("kvmesh_router_in_flight_requests")
        return value or 0.0

    def ended(self, code: str) -> float:
        """Router requests ended with ``code`` (OK, CANCELLED, ...) so far."""
        labels = {"model": "tiny", "code": code}
        value = self.router.metrics.registry.get_sample_value(
            "kvmesh_router_requests_total", labels
        )
        return value or 0.0


@pytest.fixture(scope="module")
async def mesh(tiny_model: Path, etcd) -> AsyncIterator[Mesh]:
    with pytest.MonkeyPatch.context() as mp:
        for key, value in VLLM_ENVIRONMENT.items():
            mp.setenv(key, os.environ.get(key, value))
        from services.worker.engine import VllmEngine

        cluster, endpoints = "openai-sampling", tuple(etcd.endpoints)
        config = WorkerConfig(
            engine=EngineConfig(
                model=str(tiny_model),
                served_model_name="tiny",
                dtype="float32",
                max_model_len=512,
                block_size=BLOCK,
                kv_cache_bytes=16 << 20,
            ),
            worker_id="w-sampling",
            cluster=cluster,
            etcd_endpoints=endpoints,
            drain_grace_s=1.0,
            metrics_port=-1,
        )
        engine = await VllmEngine.start(config.engine)
        worker = router = None
        try:
            worker = await start_worker(config, engine)
            router = await start_router(
                RouterConfig(
                    cluster=cluster,
                    etcd_endpoints=endpoints,
                    http_port=0,
                    metrics_port=-1,
                    drain_grace_s=1.0,
                )
            )
            await eventually(
                lambda: router.workers.candidates("tiny"), 30.0, "the router sees the worker"
            )
            assert router.http is not None
            tokenizer = Tokenizer.from_file(str(tiny_model / "tokenizer.json"))
            yield Mesh(router, router.http.base_url, tokenizer)
        finally:
            if router is not None:
                await router.stop()
            if worker is not None:
                await worker.stop()
            else:
                await engine.close()


@pytest.fixture
async def client(mesh: Mesh) -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai.AsyncOpenAI(base_url=mesh.base_url, api_key="none", max_retries=0) as c:
        yield c


def kvmesh_of(resp: Any) -> dict[str, Any]:
    return (resp.model_extra or {})["kvmesh"]


# ---- n > 1 -----------------------------------------------------------------------------------
async def test_n_choices_count_the_prompt_once_and_share_its_cache(client: openai.AsyncOpenAI):
    args: dict[str, Any] = {"model": "tiny", "messages": MESSAGES, "max_tokens": 6}
    extra = {"ignore_eos": True}
    resp = await client.chat.completions.create(
        **args, n=3, temperature=1.0, seed=41, extra_body=extra
    )
    assert [c.index for c in resp.choices] == [0, 1, 2]
    assert all(c.finish_reason == "length" for c in resp.choices)
    texts = [c.message.content for c in resp.choices]
    assert len(set(texts)) > 1, texts  # seeds 41, 42, 43: different samples
    one = await client.chat.completions.create(**args, temperature=1.0, seed=42, extra_body=extra)
    assert one.choices[0].message.content == texts[1]  # choice j samples as seed + j alone
    assert resp.usage is not None and one.usage is not None
    assert resp.usage.prompt_tokens == one.usage.prompt_tokens  # counted once
    assert resp.usage.completion_tokens == 3 * 6
    per_choice = kvmesh_of(resp)["choices"]
    assert [c["index"] for c in per_choice] == [0, 1, 2]
    assert {c["worker_id"] for c in per_choice} == {"w-sampling"}
    full_blocks = (one.usage.prompt_tokens - 1) // BLOCK * BLOCK
    assert full_blocks >= 4 * BLOCK
    # The later choices start once the first has computed the prompt: its KV is cached.
    assert [c["cached_tokens"] for c in per_choice[1:]] == [full_blocks, full_blocks]
    details = resp.usage.prompt_tokens_details
    assert details is not None and details.cached_tokens == per_choice[0]["cached_tokens"]
    again = await client.chat.completions.create(
        **args, n=3, temperature=1.0, seed=41, extra_body=extra
    )
    assert [c.message.content for c in again.choices] == texts  # reproducible


async def test_n_choices_stream_with_their_indexes(client: openai.AsyncOpenAI):
    stream = await client.chat.completions.create(
        model="tiny",
        messages=MESSAGES,
        max_tokens=5,
        n=2,
        temperature=1.0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = [c async for c in stream]
    text: dict[int, str] = {0: "", 1: ""}
    finish: dict[int, list[str]] = {0: [], 1: []}
    for chunk in chunks:
        for choice in chunk.choices:
            text[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finish[choice.index].append(choice.finish_reason)
    assert all(text.values()), text
    assert finish == {0: ["length"], 1: ["length"]}
    usages = [c.usage for c in chunks if c.usage is not None]
    assert len(usages) == 1 and chunks[-1].usage is not None and not chunks[-1].choices
    assert usages[0].completion_tokens == 10


async def test_a_client_leaving_a_stream_of_choices_aborts_them_all(
    mesh: Mesh, client: openai.AsyncOpenAI
):
    body = {
        "model": "tiny",
        "messages": MESSAGES,
        "max_tokens": 150,
        "n": 3,
        "stream": True,
        "ignore_eos": True,
    }
    cancelled = mesh.ended("CANCELLED")
    async with (
        aiohttp.ClientSession() as s,
        s.post(mesh.base_url + "/chat/completions", json=body) as resp,
    ):
        assert resp.status == 200, await resp.text()
        seen = set()
        async for line in resp.content:  # until all three choices stream
            if line.startswith(b"data: {"):
                seen.update(c["index"] for c in json.loads(line[6:])["choices"])
            if len(seen) == 3:
                break
        assert mesh.in_flight() == 3
    await eventually(lambda: mesh.in_flight() == 0, 10, "the choices' requests are aborted")
    assert mesh.ended("CANCELLED") - cancelled == 3  # none ran to its end


# ---- several prompts -------------------------------------------------------------------------
async def test_a_batch_of_prompts_answers_each_times_n(client: openai.AsyncOpenAI):
    prompts = ["Once upon a time", "The weather today"]
    args: dict[str, Any] = {"model": "tiny", "max_tokens": 5, "temperature": 0}
    alone = [await client.completions.create(prompt=p, **args) for p in prompts]
    resp = await client.completions.create(prompt=prompts, **args)
    assert [c.index for c in resp.choices] == [0, 1]
    assert [c.text for c in resp.choices] == [a.choices[0].text for a in alone]
    assert resp.usage is not None
    assert resp.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone if a.usage)
    twice = await client.completions.create(prompt=[prompts[0], [5, 6, 7, 8]], n=2, **args)
    ids = await client.completions.create(prompt=[5, 6, 7, 8], **args)
    assert [c.index for c in twice.choices] == [0, 1, 2, 3]  # prompt * n + j
    want = [alone[0].choices[0].text] * 2 + [ids.choices[0].text] * 2
    assert [c.text for c in twice.choices] == want  # greedy: n equal choices per prompt


async def test_a_refused_prompt_fails_the_whole_batch(mesh: Mesh, client: openai.AsyncOpenAI):
    cancelled, refused = mesh.ended("CANCELLED"), mesh.ended("INVALID_ARGUMENT")
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as bad:
            await client.completions.create(
                model="tiny",
                prompt=["fine", [5, 5000]],  # 5000: outside the vocabulary
                max_tokens=300,
                extra_body={"ignore_eos": True},
                stream=stream,
            )
        assert bad.value.body["param"] == "prompt", bad.value.body  # type: ignore[index]
    await eventually(lambda: mesh.in_flight() == 0, 10, "the good prompt's request is aborted")
    assert mesh.ended("INVALID_ARGUMENT") - refused == 2
    assert mesh.ended("CANCELLED") - cancelled == 2  # the good prompt's, not run to its end


# ---- sampling controls -----------------------------------------------------------------------
def word_token(tokenizer: Tokenizer) -> tuple[int, str]:
    """A token id (not in PROMPT's) whose text is a few ASCII letters."""
    prompt_ids = set(tokenizer.encode(PROMPT).ids)
    for token in range(300, 1024):
        text = tokenizer.decode([token])
        if token in prompt_ids:
            continue
        if len(text.strip()) >= 3 and text.strip().isalpha() and text.isascii():
            return token, text
    raise AssertionError("no word token in the tiny vocabulary")


async def test_logit_bias_makes_greedy_pick_the_token(mesh: Mesh, client: openai.AsyncOpenAI):
    x, x_text = word_token(mesh.tokenizer)
    args: dict[str, Any] = {"model": "tiny", "prompt": PROMPT, "max_tokens": 6}
    plain = await client.completions.create(**args, temperature=0)
    biased = await client.completions.create(**args, temperature=0, logit_bias={str(x): 100})
    assert plain.choices[0].text != x_text * 6
    assert biased.choices[0].text == x_text * 6
    # Sampling too: +100 leaves no mass elsewhere; -100 on every greedy pick moves it.
    sampled = await client.completions.create(**args, temperature=1.0, logit_bias={str(x): 100})
    assert sampled.choices[0].text == x_text * 6


async def test_min_tokens_holds_back_the_end_of_sequence(client: openai.AsyncOpenAI):
    args: dict[str, Any] = {
        "model": "tiny",
        "prompt": PROMPT,
        "max_tokens": 12,
        "temperature": 0,
        "logit_bias": {str(EOS): 100},  # the model now ends at once
    }
    at_once = await client.completions.create(**args)
    assert at_once.usage is not None and at_once.usage.completion_tokens == 1
    assert at_once.choices[0].finish_reason == "stop"
    held = await client.completions.create(**args, extra_body={"min_tokens": 5})
    assert held.usage is not None and held.usage.completion_tokens >= 5
    assert held.choices[0].finish_reason == "stop"


@pytest.mark.parametrize(
    "penalty",
    [
        pytest.param({"presence_penalty": 2.0}, id="presence"),
        pytest.param({"frequency_penalty": 2.0}, id="frequency"),
        pytest.param({"extra_body": {"repetition_penalty": 50.0}}, id="repetition"),
    ],
)
async def test_penalties_stop_the_repetition(
    mesh: Mesh, client: openai.AsyncOpenAI, penalty: dict[str, Any]
):
    x, x_text = word_token(mesh.tokenizer)
    args: dict[str, Any] = {
        "model": "tiny",
        "prompt": PROMPT,
        "max_tokens": 8,
        "temperature": 0,
        # Enough to win every greedy step, not enough to survive a penalty.
        "logit_bias": {str(x): 1.5},
    }
    plain = await client.completions.create(**args)
    assert plain.choices[0].text == x_text * 8  # the bias alone repeats x
    penalized = await client.completions.create(**args, **penalty)
    assert penalized.usage is not None and penalized.usage.completion_tokens == 8
    assert penalized.choices[0].text.count(x_text) <= 3, penalized.choices[0].text


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
@pytest.mark.parametrize(
    ("extra", "param"),
    [
        pytest.param({"presence_penalty": 2.5}, "presence_penalty", id="presence"),
        pytest.param({"frequency_penalty": -3}, "frequency_penalty", id="frequency"),
        pytest.param({"extra_body": {"repetition_penalty": 0}}, "repetition_penalty", id="rep"),
        pytest.param({"logit_bias": {"5000": 1}}, "logit_bias", id="bias-outside-vocab"),
        pytest.param({"logit_bias": {"5": 101}}, "logit_bias", id="bias-too-large"),
        pytest.param({"extra_body": {"min_tokens": 9}}, "min_tokens", id="min-over-max"),
        pytest.param({"n": 0}, "n", id="n0"),
        pytest.param({"best_of": 3}, "best_of", id="best-of"),
    ],
)
async def test_out_of_range_names_the_param(
    client: openai.AsyncOpenAI, extra: dict[str, Any], param: str, stream: bool
):
    with pytest.raises(openai.BadRequestError) as bad:
        await client.completions.create(
            model="tiny", prompt=PROMPT, max_tokens=8, stream=stream, **extra
        )
    assert bad.value.status_code == 400
    assert bad.value.body["param"] == param, bad.value.body  # type: ignore[index]


# ---- gRPC ------------------------------------------------------------------------------------
async def test_router_generate_takes_the_new_sampling_fields(mesh: Mesh):
    x, _ = word_token(mesh.tokenizer)
    async with RouterClient(mesh.router.address) as rc:
        req = make_request(PROMPT, max_tokens=6, temperature=0.0, request_id="grpc-bias")
        req.sampling.logit_bias[x] = 100.0
        done = await rc.complete(req)
        assert done.token_ids == [x] * 6
        req = make_request(PROMPT, max_tokens=8, temperature=0.0, request_id="grpc-min")
        req.sampling.logit_bias[EOS] = 100.0
        req.sampling.min_tokens = 3
        req.sampling.frequency_penalty = 0.5
        done = await rc.complete(req)
        assert done.usage is not None and done.usage.completion_tokens == 4
        assert done.token_ids[:3] != [EOS] * 3 and done.token_ids[-1] == EOS
        bad = make_request(PROMPT, max_tokens=4, request_id="grpc-bad")
        bad.sampling.repetition_penalty = -1.0
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await rc.complete(bad)
        assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        mapped = from_rpc_error(err.value)
        assert isinstance(mapped, errors.InvalidArgument)
        assert mapped.field == "sampling.repetition_penalty"
