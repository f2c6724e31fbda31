"""The Responses API on the whole mesh as real processes (``kvmesh.launcher``): etcd, one vLLM
worker on the tiny model, and ``kvmesh router --processes 2``, two router processes sharing the
HTTP port and one SQLite file of stored responses. Each turn of a chain opens a new connection,
which the kernel hands to either process (SO_REUSEPORT), so a turn may be continued by the
process that did not store it: every turn's prompt extends the stored tokens and is read from
the worker's cache whichever process serves it."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from kvmesh.client import RouterClient
from kvmesh.launcher import Mesh, MeshSpec

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

BLOCK = 32
INSTRUCTIONS = "You are a careful agent working in a large repository. " * 8


@pytest.fixture(scope="module")
def mesh(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    state = tmp_path_factory.mktemp("responses-state") / "responses.sqlite3"
    spec = MeshSpec(
        model_path=tiny_model,
        served_model_name="tiny",
        workers=1,
        max_model_len=2048,
        block_size=BLOCK,
        kv_cache_bytes=64 << 20,
        kvmanager_cpu_bytes=0,
        router_processes=2,
        router_args=("--responses-sqlite-path", str(state)),
        log_dir=tmp_path_factory.mktemp("responses-mesh"),
    )
    with Mesh(spec) as m:
        yield m


@pytest.fixture(scope="module")
async def base_url(mesh: Mesh) -> str:
    async with RouterClient(mesh.router_address) as c:
        assert (await c.wait_for_models(60)).models
    return mesh.http_base_url


async def turn(base_url: str, **kwargs: Any) -> Any:
    async with openai.AsyncOpenAI(base_url=base_url, api_key="EMPTY", max_retries=0) as c:
        if not kwargs.get("stream"):
            return await c.responses.create(model="tiny", instructions=INSTRUCTIONS, **kwargs)
        stream = await c.responses.create(model="tiny", instructions=INSTRUCTIONS, **kwargs)
        events = [e async for e in stream]
        assert events[-1].type in ("response.completed", "response.incomplete")
        return events[-1].response


async def test_a_chain_across_router_processes(base_url: str):
    turns: list[Any] = []
    previous = None
    for i in range(6):
        resp = await turn(
            base_url,
            input=f"Step {i}: read the next file.",
            previous_response_id=previous,
            max_output_tokens=12,
            temperature=0,
            stream=i % 2 == 1,
        )
        turns.append(resp)
        previous = resp.id
    for before, after in itertools.pairwise(turns):
        assert after.model_extra["kvmesh"]["prompt"] == "extended"
        tokens = before.usage.input_tokens + before.usage.output_tokens - 1
        cached = after.usage.input_tokens_details.cached_tokens
        assert cached >= 0.99 * (tokens // BLOCK) * BLOCK, (before.usage, after.usage)
    async with openai.AsyncOpenAI(base_url=base_url, api_key="EMPTY", max_retries=0) as c:
        for t in turns:  # every one readable through whichever process answers
            assert (await c.responses.retrieve(t.id)).id == t.id
