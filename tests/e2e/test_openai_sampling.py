"""Several choices and several prompts on the whole mesh (two vLLM workers, the router's default
policy, a node kvmanager), through the official ``openai`` client: the prompt is computed once,
by its first choice; the later ones find it cached, in the first's worker's prefix cache when
the policy sends them there, or loaded from the node's kvmanager when it balances them onto the
other worker."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from typing import Any

import openai
import pytest

from kvmesh.launcher import Mesh

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
async def client(mesh: Mesh) -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai.AsyncOpenAI(base_url=mesh.http_base_url, api_key="EMPTY", max_retries=0) as c:
        for _ in range(300):  # a fresh mesh takes a moment to list its workers
            if [m.id for m in (await c.models.list()).data]:
                break
            await asyncio.sleep(0.1)
        yield c


async def test_later_choices_find_the_prompt_cached(client: openai.AsyncOpenAI):
    block = (await client.models.retrieve("tiny")).model_extra["kvmesh"]["block_size"]  # type: ignore[index]
    for turn in range(4):
        # A fresh prompt each time (nothing cached anywhere), long enough for several blocks.
        system = f"Session {uuid.uuid4().hex}. " + "Answer briefly and politely. " * 20
        messages: Any = [
            {"role": "system", "content": system},
            {"role": "user", "content": f"Question {turn}?"},
        ]
        resp = await client.chat.completions.create(
            model="tiny", messages=messages, max_tokens=4, n=3, temperature=1.0, seed=turn
        )
        assert resp.usage is not None
        assert resp.usage.prompt_tokens_details is not None
        assert resp.usage.prompt_tokens_details.cached_tokens == 0  # the prompt, counted once
        first, *later = (resp.model_extra or {})["kvmesh"]["choices"]
        assert first["cached_tokens"] == 0
        full = (resp.usage.prompt_tokens - 1) // block * block
        for c in later:
            tiers = c["cached_tokens_by_tier"]
            if c["worker_id"] == first["worker_id"]:  # the first's worker: its own prefix cache
                assert (c["cached_tokens"], tiers["gpu"]) == (full, full), c
            else:  # the policy balanced it: loaded from the node's kvmanager (or a peer's)
                assert tiers["gpu"] == 0 and 0 < c["cached_tokens"] <= full, c
                assert tiers["cpu"] + tiers["disk"] + tiers["peer"] == c["cached_tokens"], c


async def test_prompts_of_a_batch_are_routed_on_their_own(client: openai.AsyncOpenAI):
    prompts = [f"{uuid.uuid4().hex} once upon a time " * 8 for _ in range(4)]
    resp = await client.completions.create(model="tiny", prompt=prompts, max_tokens=3, n=2)
    assert [c.index for c in resp.choices] == list(range(8))
    per_choice = (resp.model_extra or {})["kvmesh"]["choices"]
    assert [c["cached_tokens"] for c in per_choice[::2]] == [0] * 4  # fresh prompts
    assert all(c["cached_tokens"] > 0 for c in per_choice[1::2]), per_choice
    assert resp.usage is not None
    assert resp.usage.prompt_tokens == sum(c["prompt_tokens"] for c in per_choice[::2])
