"""kvmesh's block hashes equal the ones a real vLLM engine publishes in its KV events.

One helper process (``kv_hashing_engine.py``) runs three engines on the tiny model, one after
the other: sha256 without PYTHONHASHSEED (vLLM's defaults), sha256 with PYTHONHASHSEED, and
sha256_cbor with it. Each gets the same prompts (shared prefixes, a session-like extension, an
edit in the middle, a cache salt, lengths on and off block boundaries, one of 12+ blocks); its
BlockStored events are received over ZMQ. Every published block hash and parent hash must be
exactly kvmesh's, in order, and every full block of every prompt must have been published.
"""

from __future__ import annotations

import importlib.util
import json
import random
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from kvmesh.kv.events import BlockHash
from kvmesh.kv.hashing import (
    HashConfig,
    RequestKeys,
    SessionHasher,
    block_digests,
    block_hashes,
    root_digest,
    to_block_hash,
)
from tests.unit.test_kv_hashing import PINNED_TOKENS, PINNED_VECTORS

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vLLM"),
]

HELPER = Path(__file__).with_name("kv_hashing_engine.py")
BLOCK = 32
RUNS: list[dict[str, str | None]] = [
    {"algo": "sha256", "seed": None},
    {"algo": "sha256", "seed": "1234"},
    {"algo": "sha256_cbor", "seed": "1234"},
]
SALT = "tenant-a"


def _prompts() -> list[dict[str, Any]]:
    rng = random.Random(20261130)

    def fresh(n: int) -> list[int]:
        return [rng.randrange(5, 1024) for _ in range(n)]

    a = fresh(100)  # 3 full blocks + 4
    long = fresh(390)  # 12 full blocks + 6
    edited = list(long)
    edited[200] = 5 if edited[200] != 5 else 6  # block 6 differs: blocks 0-5 are shared
    return [
        {"tokens": PINNED_TOKENS},  # 2 full blocks + 6; its hashes are pinned in unit tests
        {"tokens": a},
        {"tokens": a[:64] + fresh(80)},  # shares 2 blocks with a, 4 full blocks
        {"tokens": long},
        {"tokens": long[:384] + fresh(50)},  # the next turn: 13 full blocks
        {"tokens": edited},
        {"tokens": fresh(31)},  # no full block: nothing published
        {"tokens": fresh(64)},  # exactly 2 blocks
        {"tokens": a, "cache_salt": SALT},  # same tokens as a, other hashes
    ]


@pytest.fixture(scope="module")
def golden(tiny_model: Path) -> dict[str, Any]:
    spec = {"model": str(tiny_model), "runs": RUNS, "prompts": _prompts()}
    proc = subprocess.run(
        [sys.executable, str(HELPER)],
        input=json.dumps(spec),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("GOLDEN ")]
    assert proc.returncode == 0 and lines, (
        f"helper failed ({proc.returncode}):\n{proc.stderr[-4000:]}"
    )
    result: dict[str, Any] = json.loads(lines[-1].removeprefix("GOLDEN "))
    return result


def _run(golden: dict[str, Any], algo: str, seed: str | None) -> dict[str, Any]:
    (run,) = [r for r in golden["runs"] if r["algo"] == algo and r["seed"] == seed]
    return run


def _stored(run: dict[str, Any]) -> list[dict[str, Any]]:
    events = [e for batch in run["batches"] for e in batch["events"]]
    assert all(e["type"] in ("BlockStored", "BlockRemoved", "AllBlocksCleared") for e in events)
    return [e for e in events if e["type"] == "BlockStored"]


def _keys(prompt: dict[str, Any]) -> RequestKeys:
    return RequestKeys(cache_salt=prompt.get("cache_salt"))


def _chains(run: dict[str, Any], cfg: HashConfig) -> list[tuple[list[int], list[BlockHash]]]:
    return [(p["tokens"], block_hashes(p["tokens"], cfg, keys=_keys(p))) for p in run["prompts"]]


def _check_event(
    event: dict[str, Any], chains: Sequence[tuple[list[int], list[BlockHash]]]
) -> None:
    """Asserts ``event`` is a run of consecutive blocks of one of ``chains``, with its parent and
    tokens."""
    published: list[int] = event["block_hashes"]
    assert event["block_size"] == BLOCK
    for tokens, chain in chains:
        if published[0] not in chain:
            continue
        k = chain.index(BlockHash(published[0]))
        assert chain[k : k + len(published)] == published
        assert event["parent_block_hash"] == (chain[k - 1] if k else None)
        assert event["token_ids"] == tokens[k * BLOCK : (k + len(published)) * BLOCK]
        return
    raise AssertionError(f"vLLM published block hashes kvmesh did not compute: {published}")


@pytest.mark.parametrize("run_spec", RUNS, ids=lambda r: f"{r['algo']}-seed-{r['seed']}")
def test_every_published_hash_is_kvmesh_hash(
    golden: dict[str, Any], run_spec: dict[str, str | None]
) -> None:
    run = _run(golden, str(run_spec["algo"]), run_spec["seed"])
    cfg = HashConfig(algo=run["algo"], seed=run["seed"])
    chains = _chains(run, cfg)
    stored = _stored(run)
    assert stored, "no BlockStored event received"
    published = set()
    for event in stored:
        _check_event(event, chains)
        published.update(event["block_hashes"])
    # Nothing missing: every full block of every prompt (1 output token: no decode blocks).
    # Warm-up prompts are left out: ZMQ may have dropped their events (see the helper).
    expected = {
        h
        for p, (_tokens, chain) in zip(run["prompts"], chains, strict=True)
        if not p["warmup"]
        for h in chain
    }
    assert expected <= published


@pytest.mark.parametrize("run_spec", RUNS, ids=lambda r: f"{r['algo']}-seed-{r['seed']}")
def test_pinned_vectors_are_what_vllm_publishes(
    golden: dict[str, Any], run_spec: dict[str, str | None]
) -> None:
    run = _run(golden, str(run_spec["algo"]), run_spec["seed"])
    published = {h for e in _stored(run) for h in e["block_hashes"]}
    pinned = PINNED_VECTORS[(run["algo"], run["seed"])]
    assert set(pinned) <= published


def test_the_seed_is_part_of_the_hash(golden: dict[str, Any]) -> None:
    unseeded = {h for e in _stored(_run(golden, "sha256", None)) for h in e["block_hashes"]}
    seeded = {h for e in _stored(_run(golden, "sha256", "1234")) for h in e["block_hashes"]}
    assert unseeded and seeded and not unseeded & seeded
    # kvmesh configured with the wrong seed matches none of what the engine published.
    wrong = HashConfig(seed="4321")
    run = _run(golden, "sha256", "1234")
    assert not {h for p in run["prompts"] for h in block_hashes(p["tokens"], wrong)} & seeded


def test_session_hasher_matches_the_engine(golden: dict[str, Any]) -> None:
    """The turns of one session (long prompt, its extension, an edit) through SessionHasher."""
    run = _run(golden, "sha256", None)
    published = {h for e in _stored(run) for h in e["block_hashes"]}
    prompts = [p["tokens"] for p in run["prompts"] if not p["warmup"]]
    hasher = SessionHasher(HashConfig())
    long, extended, edited = prompts[3], prompts[4], prompts[5]
    turns = [hasher.hash("s", t) for t in (long, extended, edited)]
    assert [t.reused_blocks for t in turns] == [0, 12, 6]
    for turn, tokens in zip(turns, (long, extended, edited), strict=True):
        assert list(turn.hashes) == block_hashes(tokens, HashConfig())
        assert set(turn.hashes) <= published


def test_vllm_hash_function_on_blocks_the_engine_cannot_take(golden: dict[str, Any]) -> None:
    """Token ids past 2**31 and 2**32 (other pickle and CBOR encodings), LoRA and salt keys,
    straight through vLLM's ``hash_block_tokens``."""
    assert golden["direct"]
    for vec in golden["direct"]:
        cfg = HashConfig(algo=vec["algo"], seed=vec["seed"])
        assert root_digest(cfg).hex() == vec["root"]
        lora = RequestKeys(cache_salt="tenant-1", lora_name="adapter-a", lora_path="/loras/a")
        digests = block_digests(vec["tokens"], cfg, keys=lora)
        assert [d.hex() for d in digests] == vec["digests"]
        assert [to_block_hash(d) for d in digests] == vec["published"]
