"""Prefill/decode disaggregation on real vLLM workers (the tiny model): a mesh of one prefill and
one decode worker with the node's kvmanager between them. A long prompt is prefilled on the
prefill worker, handed over through the kvmanager and decoded on the decode worker, which
reports the handed-over blocks as cached (it never computed them) and answers exactly what a
cold recompute on another mesh answers; with the prefill worker gone, requests are served
aggregated on the decode worker with no error."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvmesh.client import RouterClient, make_request
from kvmesh.launcher import Mesh, MeshSpec, stop_child

pytestmark = pytest.mark.e2e

BLOCK = 32
PROMPT_TOKENS = 700


@pytest.fixture(scope="module")
def pd_mesh(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    spec = MeshSpec(
        model_path=tiny_model,
        served_model_name="tiny",
        workers=0,
        prefill_workers=1,
        decode_workers=1,
        max_model_len=2048,
        kv_cache_bytes=64 << 20,
        log_dir=tmp_path_factory.mktemp("pd-mesh"),
        router_args=("--disagg-threshold-tokens", "256"),
    )
    with Mesh(spec) as m:
        yield m


def prompt(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(5, 1000) for _ in range(PROMPT_TOKENS)]


async def test_disaggregated_output_equals_a_cold_recompute(pd_mesh: Mesh, mesh: Mesh):
    prompts = [prompt(700 + i) for i in range(3)]
    async with RouterClient(pd_mesh.router_address) as pd, RouterClient(mesh.router_address) as agg:
        await pd.wait_for_models()
        await agg.wait_for_models()
        for p in prompts:
            split = await pd.complete(make_request(p, max_tokens=12, temperature=0.0), 120)
            cold = await agg.complete(make_request(p, max_tokens=12, temperature=0.0), 120)
            assert split.usage is not None and cold.usage is not None
            assert split.token_ids == cold.token_ids, "identical greedy output"
            assert split.usage.worker_id == "decode-0"
            # The decode worker never saw this prompt: every full block but the last token's
            # came from the prefill worker through the kvmanager.
            assert split.usage.cached_prompt_tokens == (PROMPT_TOKENS - 1) // BLOCK * BLOCK
            assert cold.usage.cached_prompt_tokens == 0


async def test_without_the_prefill_worker_requests_are_served_aggregated(pd_mesh: Mesh):
    prefill = next(w for w in pd_mesh.workers if w.name == "prefill-0")
    stop_child(prefill, grace_s=30.0)  # drains, leaves etcd
    async with RouterClient(pd_mesh.router_address) as client:
        await client.wait_for_models()
        c = await client.complete(make_request(prompt(799), max_tokens=8, temperature=0.0), 120)
    assert c.usage is not None and c.usage.worker_id == "decode-0"
    assert len(c.token_ids) == 8 and c.usage.cached_prompt_tokens == 0
