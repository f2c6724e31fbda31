"""Prefill/decode hand-off across two nodes on one machine (kvmesh/netns.py): node 0 runs a
prefill worker, node 1 a decode worker, each beside its own kvmanager in its own network
namespace. A disaggregated request's KV is computed on node 0, saved to node 0's kvmanager, and
fetched by node 1's kvmanager over the link before the decode worker loads it; the output is
the one a plain vLLM engine gives (tests/e2e/reference_engine.py). Skips without netns."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvmesh.client import RouterClient, make_request
from kvmesh.launcher import MeshSpec, child_env
from kvmesh.netns import NodesMesh, unavailable_reason

from .test_multinode import counters_after, delta, peer_counters

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(bool(_why := unavailable_reason()), reason=_why or "-"),
]

BLOCK = 32
PROMPT_TOKENS = 700
MAX_TOKENS = 12
MAX_MODEL_LEN = 2048


@pytest.fixture(scope="module")
def pd_nodes(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[NodesMesh]:
    spec = MeshSpec(
        model_path=tiny_model,
        served_model_name="tiny",
        max_model_len=MAX_MODEL_LEN,
        kv_cache_bytes=64 << 20,
        kvmanager_cpu_bytes=256 << 20,
        router_args=("--disagg-threshold-tokens", "256"),
        log_dir=tmp_path_factory.mktemp("multinode-pd"),
    )
    with NodesMesh(spec, nodes=2, node_roles=[(0, 1, 0), (0, 0, 1)]) as m:
        yield m


def reference(model: Path, prompts: list[list[int]], log_dir: Path) -> list[list[int]]:
    script = Path(__file__).with_name("reference_engine.py")
    with open(log_dir / "reference.log", "w") as err:
        out = subprocess.run(
            [sys.executable, str(script), str(model), str(MAX_MODEL_LEN), str(MAX_TOKENS)],
            input=json.dumps(prompts),
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
            env={**os.environ, **child_env()},
            timeout=300,
            check=True,
        ).stdout
    line = next(x for x in out.splitlines() if x.startswith("REFERENCE "))
    return list(json.loads(line.removeprefix("REFERENCE ")))


async def test_prefill_on_one_node_decode_on_the_other(pd_nodes: NodesMesh, tiny_model: Path):
    rng = random.Random(17)
    prompts = [[rng.randrange(5, 1000) for _ in range(PROMPT_TOKENS)] for _ in range(2)]
    decode = pd_nodes.nodes[1].workers[0].name
    before = [peer_counters(pd_nodes, i) for i in range(2)]
    async with RouterClient(pd_nodes.router_address) as client:
        await client.wait_for_models()
        got = [
            await client.complete(make_request(p, max_tokens=MAX_TOKENS, temperature=0.0), 120)
            for p in prompts
        ]
    handed = (PROMPT_TOKENS - 1) // BLOCK * BLOCK  # every full block but the last token's
    for c in got:
        assert c.usage is not None and c.usage.worker_id == decode
        assert c.usage.cached_peer_tokens == handed, c.usage
    after = await counters_after(pd_nodes, before, 1, 2 * handed // BLOCK)
    fetched = delta(after[1], before[1], "kvmesh_kvmanager_peer_blocks_fetched_total")
    sent = delta(after[0], before[0], "kvmesh_kvmanager_data_plane_blocks_sent_total")
    assert fetched >= 2 * handed // BLOCK and sent >= fetched, (before, after)
    assert pd_nodes.root is not None
    refs = reference(tiny_model, prompts, pd_nodes.root.log_dir)
    assert [c.token_ids for c in got] == refs
    print(
        f"\nP/D across nodes: {fetched:.0f} blocks handed over the link, TTFTs "
        + ", ".join(f"{c.usage.time_to_first_token_s:.3f} s" for c in got if c.usage)
    )
