"""KvmeshConnector on real vLLM engines (the tiny model) sharing a ``DirectoryBlockClient`` store.

Two helper processes (this module run with ``python -m``; vLLM runs in-process there, so the
helper reads both connector instances' counters and prints them as one ``KVCONN {json}`` line):

1. ``ref``: float32 without a connector (the recompute reference); ``A``: float32 with the
   connector on an empty store; ``A16``: bfloat16 with the connector.
2. ``B16``: bfloat16, the first engine of its process, whose first request is a 4-token prefill
   over 96 loaded tokens (the case that died with "Illegal instruction" in bf16 before the
   connector asked for AMX permission); ``B``: float32, fresh engine on A's store: every prompt
   again (store hits), a follow-up turn that reuses a block A filled while decoding, then the
   same prompts with blocks corrupted, cut short and deleted in the store (recompute).

Greedy outputs must match token for token everywhere. Also here: the connector's pure parts
(store file format, saver queue, request plans, layout key, config) without an engine.
"""

from __future__ import annotations

import gc
import importlib.util
import json
import os
import random
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from kvmesh.kv.hashing import HashConfig, block_hashes
from services.worker.connector import (
    BlockLayout,
    DirectoryBlockClient,
    StoreConfig,
    kv_transfer_config,
    parse_layout_key,
)
from services.worker.connector import plan as plans
from services.worker.connector.client import SaveChain
from services.worker.connector.directory import HEADER_BYTES
from services.worker.connector.saver import BlockSaver, SaveJob

pytestmark = [pytest.mark.integration]
needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vLLM")

REPO = Path(__file__).resolve().parents[2]
BLOCK = 32
MAX_TOKENS = 40  # long enough to fill a block while decoding (p100: tokens 96..127)
BLOCK_BYTES_F32 = 32768  # 2 layers x 2 KV heads x 32 tokens x (K+V) 2 x 32 dims x 4 bytes


def _prompts() -> dict[str, list[int]]:
    rng = random.Random(20261130)

    def fresh(n: int) -> list[int]:
        return [rng.randrange(5, 1024) for _ in range(n)]

    p = {
        "p100": fresh(100),  # 3 full blocks + 4: loads 96, computes 4
        "p64": fresh(64),  # exactly 2 blocks: loads 1 (never the whole prompt)
        "p33": fresh(33),  # loads 32, computes 1
        "p20": fresh(20),  # no full block
        "p300": fresh(300),  # 9 full blocks + 12
    }
    p["p300b"] = p["p300"][:200] + fresh(60)  # shares 6 blocks with p300
    p["extra"] = fresh(30)
    return p


PROMPTS = _prompts()
BASE = ["p100", "p64", "p33", "p20", "p300", "p300b"]
BF16 = ["p100", "p300"]
DEGRADED = ["p300", "p100", "p64"]
FOLLOWUP = [[0, 32, PROMPTS["extra"]]]  # p100 + its first 32 output tokens + 30 new ones


def keys(name: str) -> list[int]:
    """The store keys of a prompt's full blocks: vLLM's published block hashes (sha256, no
    PYTHONHASHSEED), as kvmesh computes them."""
    return block_hashes(PROMPTS[name], HashConfig())


def _generate(
    tag: str, names: Sequence[str], max_tokens: int = MAX_TOKENS, store_prefix: Any = None
) -> dict[str, Any]:
    """``store_prefix``: the router's count of the store's prefix to pass with each prompt (an
    int, or "full": all its full blocks); None: none."""
    prompts = [PROMPTS[n] for n in names]
    return {"op": "generate", "tag": tag, "prompts": prompts, "max": max_tokens} | (
        {"store_prefix": store_prefix} if store_prefix is not None else {}
    )


def _run(name: str, dtype: str, connector: bool, *ops: dict[str, Any]) -> dict[str, Any]:
    return {"name": name, "dtype": dtype, "connector": connector, "ops": list(ops)}


@pytest.fixture(scope="module")
def runs(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    store = tmp_path_factory.mktemp("kv-store")
    followup = {"op": "followup", "tag": "follow", "of": "base", "items": FOLLOWUP, "max": 8}
    first = [
        _run("ref", "float32", False, _generate("base", BASE), followup),
        _run("A", "float32", True, _generate("base", BASE)),
        _run("A16", "bfloat16", True, _generate("base", BF16)),
    ]
    corrupt = [
        [keys("p300")[4], "garbage"],  # fails its digest: the store reports it missing
        [keys("p100")[1], "short"],  # a sound file of the wrong size: the connector refuses it
        [keys("p64")[0], "delete"],  # gone: the lookup finds nothing
    ]
    second = [
        _run("B16", "bfloat16", True, _generate("base", BF16)),
        _run(
            "B",
            "float32",
            True,
            _generate("base", BASE),
            {"op": "reset"},  # B's own prefix cache: the follow-up must come from the store
            followup,
            {"op": "reset"},
            {"op": "corrupt", "items": corrupt},
            _generate("degraded", DEGRADED),
        ),
    ]
    hinted = [
        _run(
            "C",
            "float32",
            True,
            _generate("hint-zero", BASE, store_prefix=0),  # stale: the store holds them all
            {"op": "reset"},
            _generate("hint-full", BASE, store_prefix="full"),
        )
    ]
    out: dict[str, Any] = {"store": store}
    for spec_runs in (first, second, hinted):
        spec = {"model": str(tiny_model), "store": str(store), "runs": spec_runs}
        for run in _helper(spec):
            out[run["name"]] = run
    return out


def _helper(spec: dict[str, Any]) -> list[dict[str, Any]]:
    from services.worker.main import VLLM_ENVIRONMENT

    env = {**os.environ, **VLLM_ENVIRONMENT}
    env.pop("PYTHONHASHSEED", None)  # the engine hashes with vLLM's default root
    proc = subprocess.run(
        [sys.executable, "-m", "tests.integration.test_kv_connector"],
        input=json.dumps(spec),
        capture_output=True,
        text=True,
        timeout=400,
        check=False,
        cwd=REPO,
        env=env,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("KVCONN ")]
    assert proc.returncode == 0 and lines, (
        f"helper failed (rc {proc.returncode}):\n{proc.stderr[-4000:]}"
    )
    result: list[dict[str, Any]] = json.loads(lines[-1].removeprefix("KVCONN "))
    return result


def op(run: dict[str, Any], tag: str) -> dict[str, Any]:
    (found,) = [o for o in run["ops"] if o.get("tag") == tag]
    return found


def expected_cached(name: str) -> int:
    """Every full block but never the last token: ((len - 1) // 32) * 32."""
    return (len(PROMPTS[name]) - 1) // BLOCK * BLOCK


# ---- engines -------------------------------------------------------------------------------
@needs_vllm
def test_a_computes_like_the_reference_and_saves_every_full_block(runs: dict[str, Any]) -> None:
    ref, a = op(runs["ref"], "base"), op(runs["A"], "base")
    assert a["outputs"] == ref["outputs"]
    assert a["cached"] == [0, 0, 0, 0, 0, 192]  # p300b: p300's 6 blocks from A's own cache
    assert runs["A"]["block_bytes"] == BLOCK_BYTES_F32
    assert a["worker"]["load_blocks"] == 0 and a["worker"]["save_skipped_blocks"] == 0
    # Prompt blocks and blocks filled while decoding (40 tokens), each once.
    full = sum((len(PROMPTS[n]) + MAX_TOKENS - 1) // BLOCK for n in BASE) - 6  # p300b shares 6
    assert a["store_blocks"] == a["saver"]["saved_blocks"] == full
    assert a["worker"]["save_blocks"] + a["worker"]["save_deduped_blocks"] >= full
    store = DirectoryBlockClient(runs["store"])
    layout = runs["A"]["layout_key"]
    for name in BASE:
        assert store.lookup(layout, keys(name)) == len(keys(name))


@needs_vllm
def test_b_loads_prefixes_from_the_store_with_identical_output(runs: dict[str, Any]) -> None:
    a, b = op(runs["A"], "base"), op(runs["B"], "base")
    assert b["outputs"] == a["outputs"] == op(runs["ref"], "base")["outputs"]
    assert b["cached"] == [expected_cached(n) for n in BASE] == [96, 32, 32, 0, 288, 256]
    # Blocks from the store: 3 + 1 + 1 + 0 + 9 + 2 (p300b's first 6 are in B's own cache).
    assert b["worker"]["load_blocks"] == 16
    assert b["worker"]["load_failed_blocks"] == 0
    # One lookup per prompt with a full block (not p20); every full block was there.
    assert (b["sched"]["lookups"], b["sched"]["lookup_hit_blocks"]) == (5, 3 + 2 + 1 + 9 + 8)
    # B copied out the blocks it filled while decoding (its lookups cover prompts only), but
    # its saver found them in the store: nothing written.
    assert b["saver"]["saved_blocks"] == 0
    assert b["saver"]["present_blocks"] == b["worker"]["save_blocks"] == 6
    assert b["store_blocks"] == op(runs["A"], "base")["store_blocks"]
    assert runs["B"]["layout_key"] == runs["A"]["layout_key"]


@needs_vllm
def test_the_routers_store_prefix_count_skips_lookups_the_engine_cache_covers(
    runs: dict[str, Any],
) -> None:
    ref = op(runs["ref"], "base")
    zero, full = op(runs["C"], "hint-zero"), op(runs["C"], "hint-full")
    # A count the engine's cache covers (0 here: wrong, the store holds every block): no
    # lookup at all, every prompt recomputed, the same output.
    assert zero["outputs"] == full["outputs"] == ref["outputs"]
    assert zero["sched"]["lookups"] == 0
    assert zero["sched"]["lookups_skipped"] == len(BASE) - 1  # p20: no full block to look up
    assert zero["cached"] == [0, 0, 0, 0, 0, 192]  # p300b: p300's blocks from C's own cache
    assert zero["worker"]["load_blocks"] == 0
    # A count past the engine's cache: looked up and loaded as without a count (p20 has no
    # full block: nothing to look up either way).
    assert full["sched"]["lookups_skipped"] == 0
    assert full["sched"]["lookups"] == len(BASE) - 1
    assert full["cached"] == [expected_cached(n) for n in BASE]
    assert full["worker"]["load_blocks"] > 0


@needs_vllm
def test_a_block_filled_while_decoding_serves_the_next_turn(runs: dict[str, Any]) -> None:
    ref, b = op(runs["ref"], "follow"), op(runs["B"], "follow")
    assert b["outputs"] == ref["outputs"]
    # 162 tokens: blocks 0-2 are p100's prompt, block 3 (tokens 96..127) holds 28 tokens A
    # generated; block 4 was never computed by anyone. B's own cache was reset.
    assert b["cached"] == [128]
    assert b["worker"]["load_blocks"] == 4


@needs_vllm
def test_failed_loads_degrade_to_recompute(runs: dict[str, Any]) -> None:
    a, b = op(runs["A"], "base"), op(runs["B"], "degraded")
    assert b["outputs"] == [a["outputs"][BASE.index(n)] for n in DEGRADED]
    # p300: blocks 4-8 after the corrupt one, p100: blocks 1-2; p64's block 0 is gone, so its
    # lookup found nothing to load.
    assert b["worker"]["load_failed_blocks"] == 5 + 2
    assert b["worker"]["load_blocks"] == 4 + 1
    assert b["cached"][2] == 0
    # Recomputed blocks were saved again: the store is whole.
    store = DirectoryBlockClient(runs["store"])
    layout = runs["B"]["layout_key"]
    for name in DEGRADED:
        got = store.load(layout, keys(name))
        assert got is not None and len(got) == len(keys(name))
        assert all(len(x) == BLOCK_BYTES_F32 for x in got)


@needs_vllm
def test_bf16_short_prefill_over_loaded_kv(runs: dict[str, Any]) -> None:
    """B16 came through its first request (4 tokens computed over 96 loaded) alive."""
    a16, b16 = op(runs["A16"], "base"), op(runs["B16"], "base")
    assert b16["outputs"] == a16["outputs"]
    assert b16["cached"] == [96, 288]
    assert runs["B16"]["block_bytes"] == BLOCK_BYTES_F32 // 2
    assert "dtype=bfloat16" in runs["B16"]["layout_key"]


# ---- pure parts ------------------------------------------------------------------------------
LAYOUT = BlockLayout("tiny", 32, 2, 2, 32, "float32", 0, 1, "cpu")


def test_layout_key_round_trips() -> None:
    key = LAYOUT.key()
    assert key.startswith("kvmesh-kv1;model=tiny;block_size=32;")
    assert parse_layout_key(key) == LAYOUT
    assert LAYOUT.bytes_per_block(4) == BLOCK_BYTES_F32
    with pytest.raises(ValueError, match="not a kvmesh-kv1 layout key"):
        parse_layout_key("other;model=x")


def test_store_config_rejects_unknown_keys_and_bad_values() -> None:
    assert StoreConfig.from_extra({"store_path": "/s"}).max_pending_save_bytes > 0
    with pytest.raises(ValueError, match="unknown"):
        StoreConfig.from_extra({"store_path": "/s", "max_queue": 3})
    with pytest.raises(ValueError, match="store_path"):
        StoreConfig.from_extra({})
    cfg = kv_transfer_config("/s")
    assert cfg["kv_load_failure_policy"] == "recompute" and cfg["kv_role"] == "kv_both"


def test_directory_client_round_trip_and_damage(tmp_path: Path) -> None:
    store, key = DirectoryBlockClient(tmp_path), LAYOUT.key()
    blocks = [bytes([i]) * 64 for i in range(3)]
    store.save(key, [11, 12, 13], None, blocks)
    assert store.lookup(key, [11, 12, 13, 14]) == 3
    assert store.lookup(key, [12, 11]) == 2 and store.lookup(key, [99, 11]) == 0
    assert [bytes(b) for b in store.load(key, [11, 12, 13]) or []] == blocks
    assert store.lookup("other layout", [11]) == 0
    # One flipped byte: the block and everything after it is missing, the file is removed.
    path = store.block_path(key, 12)
    data = bytearray(path.read_bytes())
    data[HEADER_BYTES + 5] ^= 0xFF
    path.write_bytes(bytes(data))
    assert len(store.load(key, [11, 12, 13]) or []) == 1
    assert not path.exists()
    # A block file moved under another key is refused too.
    store.block_path(key, 13).rename(store.block_path(key, 14))
    assert store.load(key, [14]) == []
    # Saving again repairs; a file of the wrong size is replaced.
    store.save(key, [12], 11, [bytes(64)])
    store.save(key, [12], 11, [bytes(32)])
    assert [len(b) for b in store.load(key, [11, 12]) or []] == [64, 32]


class _GatedClient:
    """Saves block only once ``gate`` is set."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.saved: list[int] = []

    def lookup(self, layout_key: str, block_hashes: Sequence[int]) -> int:
        return 0

    def load(self, layout_key: str, block_hashes: Sequence[int]) -> None:
        return None

    def save(self, layout_key: str, hashes: Sequence[int], parent: int | None, blocks: Any) -> None:
        assert self.gate.wait(10)
        self.saved.extend(hashes)

    def discard(self, layout_key: str, block_hashes: Sequence[int]) -> None:
        pass

    def close(self) -> None:
        pass


def _job(hashes: list[int], nbytes: int) -> SaveJob:
    return SaveJob("k", hashes, None, [b"x"] * len(hashes), nbytes)


def test_saver_skips_instead_of_waiting_when_full() -> None:
    client = _GatedClient()
    saver = BlockSaver(client, max_pending_bytes=100)
    try:
        assert saver.try_submit(_job([1], 60))
        assert not saver.has_room(60)
        assert not saver.try_submit(_job([2, 3], 60))  # refused at once: the client is stuck
        assert saver.try_submit(_job([4], 40))
        assert not saver.flush(0.05)
        client.gate.set()
        assert saver.flush(10)
        stats = saver.stats()
        assert client.saved == [1, 4]
        assert (stats.saved_blocks, stats.refused_blocks, stats.pending_bytes) == (2, 2, 0)
    finally:
        client.gate.set()
        saver.close(5)
    assert not saver.try_submit(_job([5], 1))


class _GatedBatchClient(_GatedClient):
    """A store that takes many chains per call (``BatchedSave``) and says which it held."""

    def __init__(self, held: set[int]) -> None:
        super().__init__()
        self.held = held
        self.calls: list[list[tuple[list[int], int | None]]] = []
        self.entered = threading.Event()

    def lookup(self, layout_key: str, block_hashes: Sequence[int]) -> int:
        raise AssertionError("a batched store is never looked up before a save")

    def save_chains(self, layout_key: str, chains: Sequence[SaveChain]) -> int:
        self.entered.set()
        assert self.gate.wait(10)
        self.calls.append([(list(c.block_hashes), c.parent_hash) for c in chains])
        hashes = [h for c in chains for h in c.block_hashes]
        self.saved.extend(hashes)
        return sum(h in self.held for h in hashes)


def test_saver_sends_everything_queued_in_one_call_to_a_batched_store() -> None:
    client = _GatedBatchClient(held={4})
    saver = BlockSaver(client, max_pending_bytes=1000)
    try:
        assert saver.try_submit(_job([1], 10))
        assert client.entered.wait(10)
        # The first call is stuck on the gate: what queues meanwhile goes in the next call.
        assert saver.try_submit(SaveJob("k", [2, 3], 1, [b"x", b"x"], 20))
        assert saver.try_submit(_job([4], 10))
        client.gate.set()
        assert saver.flush(10)
        stats = saver.stats()
        assert sorted(client.saved) == [1, 2, 3, 4]
        assert client.calls == [[([1], None)], [([2, 3], 1), ([4], None)]]
        assert (stats.saved_blocks, stats.present_blocks, stats.pending_bytes) == (3, 1, 0)
    finally:
        client.gate.set()
        saver.close(5)


def test_saver_holds_jobs_for_its_interval_then_sends_them_in_one_call() -> None:
    client = _GatedBatchClient(held=set())
    client.gate.set()
    saver = BlockSaver(client, max_pending_bytes=1000, batch_interval_s=0.4)
    try:
        assert saver.try_submit(_job([1], 10))
        assert saver.flush(10)  # a flush sends at once, whatever the interval
        assert client.calls == [[([1], None)]]
        sent = time.monotonic()
        for h in (2, 3, 4):  # within the interval after a call: held, then one call
            assert saver.try_submit(_job([h], 10))
        time.sleep(0.1)
        assert len(client.calls) == 1
        deadline = time.monotonic() + 10
        while len(client.calls) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert time.monotonic() - sent >= 0.35
        assert client.calls[1] == [([2], None), ([3], None), ([4], None)]
        # Half the queue's bytes waiting: sent without waiting out the interval.
        assert saver.try_submit(_job([5], 300))
        time.sleep(0.05)
        assert len(client.calls) == 2
        assert saver.try_submit(_job([6], 300))
        deadline = time.monotonic() + 0.3
        while len(client.calls) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert client.calls[2:] == [[([5], None), ([6], None)]]
        assert saver.stats().saved_blocks == 6
        # An urgent job (a prefill's hand-off) takes what is held along at once.
        assert saver.try_submit(_job([7], 10))
        time.sleep(0.05)
        assert len(client.calls) == 3
        urgent = SaveJob("k", [8], None, [b"x"], 10, urgent=True)
        assert saver.try_submit(urgent)
        deadline = time.monotonic() + 0.3
        while len(client.calls) < 4 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert client.calls[3:] == [[([7], None), ([8], None)]]
    finally:
        saver.close(5)


def test_saver_holds_the_first_job_after_a_quiet_spell_for_its_interval() -> None:
    # Sent at once, the call would run beside the engine step that queued it (the first token
    # of an idle engine's prefill); it waits out the interval like any other.
    client = _GatedBatchClient(held=set())
    client.gate.set()
    saver = BlockSaver(client, max_pending_bytes=1000, batch_interval_s=0.3)
    try:
        queued = time.monotonic()
        assert saver.try_submit(_job([1], 10))
        time.sleep(0.1)
        assert client.calls == []
        assert saver.try_submit(_job([2], 10))
        deadline = time.monotonic() + 10
        while not client.calls and time.monotonic() < deadline:
            time.sleep(0.01)
        assert time.monotonic() - queued >= 0.25
        assert client.calls == [[([1], None), ([2], None)]]
        # Without an interval (a store that is not batched, or 0 s) nothing waits.
        unbatched = BlockSaver(client, max_pending_bytes=1000, batch_interval_s=0.0)
        try:
            assert unbatched.try_submit(_job([3], 10))
            deadline = time.monotonic() + 10
            while len(client.calls) < 2 and time.monotonic() < deadline:
                time.sleep(0.01)
            assert client.calls[1] == [([3], None)]
        finally:
            unbatched.close(5)
    finally:
        saver.close(5)


@pytest.mark.parametrize(
    ("store_blocks", "local", "num_tokens", "expected"),
    [
        (3, 0, 100, 96),  # all three full blocks, 4 tokens left to compute
        (2, 0, 64, 32),  # never the whole prompt: the last block is computed
        (1, 0, 33, 32),
        (0, 0, 300, 0),
        (9, 192, 300, 96),  # only what the engine's own cache does not have
        (4, 192, 300, 0),  # the engine's cache is longer than the store's prefix
        (5, 0, 20, 0),  # more in the store than the request has full blocks (no keys)
    ],
    ids=["prefix", "whole-prompt", "one-left", "miss", "beyond-local", "local-longer", "keys"],
)
def test_loadable_tokens(store_blocks: int, local: int, num_tokens: int, expected: int) -> None:
    p = plans.RequestPlan(keys=list(range(num_tokens // BLOCK)))
    plans.after_lookup(p, local, store_blocks)
    assert plans.loadable_tokens(p, num_tokens, BLOCK) == expected


def test_save_plan_follows_the_engine() -> None:
    p = plans.RequestPlan(keys=list(range(9)))
    plans.after_lookup(p, 0, 3)
    assert plans.load_blocks(p, 96, BLOCK) == range(0, 3)
    assert plans.save_blocks(p, 96, 200, BLOCK) == range(3, 9)  # 296 tokens: blocks 3-8
    assert plans.save_blocks(p, 296, 4, BLOCK) == range(0)  # 300: still 9 blocks
    # The engine rolled back to block 1 (a failed load): blocks 1.. are saved again.
    assert plans.save_blocks(p, 32, 268, BLOCK) == range(1, 9)
    # Drafts and tokens whose block has no key yet are not saved.
    assert plans.save_blocks(p, 300, 100, BLOCK) == range(0)


# ---- the helper process ------------------------------------------------------------------------
def _run_engine(model: str, store: str, run: dict[str, Any]) -> dict[str, Any]:
    from vllm import LLM, SamplingParams, TokensPrompt
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    kwargs: dict[str, Any] = {}
    if run["connector"]:
        kwargs["kv_transfer_config"] = kv_transfer_config(store)
    llm = LLM(
        model=model,
        dtype=run["dtype"],
        block_size=BLOCK,
        max_model_len=1024,
        enforce_eager=True,
        enable_prefix_caching=True,
        kv_cache_memory_bytes=8 << 20,
        seed=0,
        **kwargs,
    )
    sched = llm.llm_engine.engine_core.engine_core.scheduler.connector
    worker = get_kv_transfer_group() if run["connector"] else None
    out: dict[str, Any] = {"name": run["name"], "ops": []}
    if worker is not None:
        out |= {"layout_key": worker.layout_key, "block_bytes": worker.block_bytes}
        out["kv_cache_shapes"] = worker.kv_cache_shapes
    results: dict[str, dict[str, Any]] = {}
    for o in run["ops"]:
        if o["op"] == "reset":
            assert llm.reset_prefix_cache()
            continue
        if o["op"] == "corrupt":
            _corrupt(DirectoryBlockClient(store), out["layout_key"], out["block_bytes"], o["items"])
            continue
        prompts = o.get("prompts") or [
            results[o["of"]]["prompts"][i] + results[o["of"]]["outputs"][i][:take] + extra
            for i, take, extra in o["items"]
        ]
        before = None
        if worker is not None:
            before = (dict(sched.totals), dict(worker.totals), worker.saver_stats())
        res: dict[str, Any] = {"tag": o["tag"], "prompts": prompts, "outputs": [], "cached": []}
        for p in prompts:
            extra = None
            if "store_prefix" in o:
                n = len(p) // BLOCK if o["store_prefix"] == "full" else o["store_prefix"]
                extra = {"kv_transfer_params": {plans.STORE_PREFIX_PARAM: n}}
            params = SamplingParams(
                temperature=0.0, max_tokens=o["max"], ignore_eos=True, extra_args=extra
            )
            (r,) = llm.generate([TokensPrompt(prompt_token_ids=p)], params, use_tqdm=False)
            res["outputs"].append(list(r.outputs[0].token_ids))
            res["cached"].append(r.num_cached_tokens)
        if worker is not None and before is not None:
            assert worker.flush(30)
            res["sched"] = {k: v - before[0][k] for k, v in sched.totals.items()}
            res["worker"] = {k: v - before[1][k] for k, v in worker.totals.items()}
            saver = worker.saver_stats()
            res["saver"] = {k: v - before[2].get(k, 0) for k, v in saver.items()}
            layout_dir = DirectoryBlockClient(store).layout_dir(out["layout_key"])
            res["store_blocks"] = sum(1 for _ in layout_dir.glob("*/*.kvb"))
        results[o["tag"]] = res
        out["ops"].append(res)
    llm.llm_engine.engine_core.shutdown()  # flushes the saver, clears vLLM's connector global
    del llm
    gc.collect()
    assert not has_kv_transfer_group()
    return out


def _corrupt(
    store: DirectoryBlockClient, layout: str, block_bytes: int, items: list[list[Any]]
) -> None:
    for key, how in items:
        path = store.block_path(layout, key)
        if how == "garbage":
            data = bytearray(path.read_bytes())
            data[HEADER_BYTES:] = random.Random(key).randbytes(len(data) - HEADER_BYTES)
            path.write_bytes(bytes(data))
        elif how == "short":
            path.unlink()
            store.save(layout, [key], None, [bytes(block_bytes // 2)])
        else:
            path.unlink()


def main() -> None:
    spec = json.load(sys.stdin)
    runs = [_run_engine(spec["model"], spec["store"], run) for run in spec["runs"]]
    print("KVCONN " + json.dumps(runs), flush=True)


if __name__ == "__main__":
    main()
