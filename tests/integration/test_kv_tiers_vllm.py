"""The kvmanager tiers under a real vLLM worker (the tiny model) whose own KV memory is small:
a long prompt, enough other traffic to evict it from the engine, then the prompt again: its
prefix comes back from the kvmanager's CPU tier, and after a kvmanager restart from its disk
tier, with greedy output identical to the cold recompute both times. The worker's usage says
where the cached prompt came from (``cached_{gpu,cpu,disk,peer}_tokens``, adding up to
``cached_prompt_tokens``)."""

from __future__ import annotations

import asyncio
import dataclasses
import os
from pathlib import Path

import grpc
import pytest

from kvmesh.kv.events import Tier
from kvmesh.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from services.kvmanager.config import KvManagerConfig
from services.kvmanager.core.config import StoreConfig
from services.kvmanager.main import start_kvmanager
from services.worker.config import EngineConfig, WorkerConfig
from services.worker.connector import kv_transfer_config
from services.worker.main import VLLM_ENVIRONMENT

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

BLOCK = 32
MAX_MODEL_LEN = 1024
PROMPT_TOKENS = 900  # 28 full blocks
ENGINE_KV_BYTES = 2 << 20  # 64 blocks of 32 KiB (float32): two long prompts at most
MAX_TOKENS = 8


def prompt(salt: int) -> list[int]:
    return [10 + (salt * 7919 + i * 31) % 1000 for i in range(PROMPT_TOKENS)]


TEXTS: dict[str, list[str]] = {}  # request id -> the text of each message with tokens


async def generate(
    stub, rid: str, tokens: list[int], stop: str = ""
) -> tuple[list[int], int, dict[str, int]]:
    """Greedy output, cached prompt tokens and their split by tier (which adds up)."""
    req = worker_pb2.WorkerGenerateRequest(
        request_id=rid,
        prompt_token_ids=tokens,
        sampling=common_pb2.SamplingParams(
            max_tokens=MAX_TOKENS, temperature=0.0, stop=[stop] if stop else []
        ),
    )
    out: list[int] = []
    usage = None
    TEXTS[rid] = []
    async for msg in stub.Generate(req, timeout=120):
        out.extend(msg.token_ids)
        if msg.token_ids:
            TEXTS[rid].append(msg.text)
        if msg.HasField("finished"):
            usage = msg.finished.usage
            if stop:  # vLLM's front end applies stop strings, not its engine core
                assert msg.finished.reason == common_pb2.FINISH_REASON_STOP
                assert msg.finished.stop_reason == stop
    assert usage is not None
    tiers = {
        "gpu": usage.cached_gpu_tokens,
        "cpu": usage.cached_cpu_tokens,
        "disk": usage.cached_disk_tokens,
        "peer": usage.cached_peer_tokens,
    }
    assert sum(tiers.values()) == usage.cached_prompt_tokens, (tiers, usage)
    return out, usage.cached_prompt_tokens, tiers


def stop_string(texts: list[str]) -> str:
    """A stop string that ends a request with this output (one text per token) after its first
    token and before its last."""
    for i in range(1, len(texts) - 1):
        piece = texts[i].strip()
        if piece and piece not in "".join(texts[:i]):
            return piece
    raise AssertionError(f"no stop string fits the output {texts}")


async def test_evicted_prefix_comes_back_from_cpu_then_from_disk(tiny_model, tmp_path, monkeypatch):
    for key, value in VLLM_ENVIRONMENT.items():
        monkeypatch.setenv(key, os.environ.get(key, value))
    from services.worker.engine import VllmEngine
    from services.worker.server import start_worker

    kvm_config = KvManagerConfig(
        kvmanager_id="node-1",
        node="node-1",
        etcd_endpoints=(),
        # Write-through: every block also lands on disk, so a restart finds it there.
        store=StoreConfig(
            cpu_bytes=64 << 20,
            disk_bytes=256 << 20,
            disk_dir=Path(tmp_path / "kv"),
            write_through=True,
        ),
        metrics_port=-1,
        drain_grace_s=1.0,
    )
    kvm = await start_kvmanager(kvm_config)
    port = int(kvm.address.rsplit(":", 1)[1])
    config = WorkerConfig(
        engine=EngineConfig(
            model=str(tiny_model),
            served_model_name="tiny",
            dtype="float32",
            max_model_len=MAX_MODEL_LEN,
            block_size=BLOCK,
            kv_cache_bytes=ENGINE_KV_BYTES,
            kv_transfer_config=kv_transfer_config(f"127.0.0.1:{port}", store="kvmanager"),
        ),
        worker_id="w-small",
        etcd_endpoints=(),
        drain_grace_s=2.0,
    )
    engine = await VllmEngine.start(config.engine)
    worker = await start_worker(config, engine)
    long = prompt(1)
    try:
        async with grpc.aio.insecure_channel(worker.address) as ch:
            stub = worker_pb2_grpc.WorkerStub(ch)
            cold, cached, tiers = await generate(stub, "cold", long)
            assert cached == 0

            async def evict() -> None:
                for i in range(3):  # 3 x 28 blocks through a 64-block engine cache
                    await generate(stub, f"other-{i}-{len(cold)}", prompt(100 + i))

            await evict()
            hits_before = kvm.store.stats.hits_cpu
            again, cached, tiers = await generate(stub, "from-cpu", long)
            assert again == cold, "identical greedy output from the kvmanager's CPU tier"
            assert cached == (PROMPT_TOKENS - 1) // BLOCK * BLOCK
            assert kvm.store.stats.hits_cpu - hits_before >= PROMPT_TOKENS // BLOCK
            # What the kvmanager served: from its CPU tier (the engine may have kept a few
            # leading blocks itself); nothing from disk or a peer.
            assert tiers["cpu"] >= 16 * BLOCK and tiers["disk"] == tiers["peer"] == 0, tiers

            # The same prompt at once: the engine's own prefix cache serves it all.
            _, cached, tiers = await generate(stub, "from-gpu", long)
            assert tiers == {"gpu": cached, "cpu": 0, "disk": 0, "peer": 0} and cached > 0

            # A request that a stop string ends after a few tokens: vLLM's front end, not its
            # engine core, finishes it, so the connector's report comes through vLLM's stats.
            stop = stop_string(TEXTS["cold"])
            await evict()
            again, cached, tiers = await generate(stub, "from-cpu-stop", long, stop=stop)
            assert len(again) < MAX_TOKENS and again == cold[: len(again)]
            assert tiers["cpu"] >= 16 * BLOCK and tiers["disk"] == tiers["peer"] == 0, tiers

            # Restart the kvmanager on the same port: RAM is gone, the disk tier is rebuilt.
            await kvm.stop()
            kvm = await start_kvmanager(dataclasses.replace(kvm_config, port=port))
            assert kvm.store.usage(Tier.CPU).blocks == 0
            assert kvm.store.usage(Tier.DISK).blocks >= 4 * (PROMPT_TOKENS // BLOCK)
            # The engine's connector finds the restarted kvmanager within its reconnect backoff
            # (~1 s); until then its lookups miss and it recomputes. Retry briefly for that.
            for attempt in range(5):
                await evict()
                disk_before = kvm.store.stats.hits_disk
                again, cached, tiers = await generate(stub, f"from-disk-{attempt}", long)
                if cached:
                    break
                await asyncio.sleep(1.0)
            assert again == cold, "identical greedy output from the kvmanager's disk tier"
            assert cached == (PROMPT_TOKENS - 1) // BLOCK * BLOCK
            assert kvm.store.stats.hits_disk - disk_before >= PROMPT_TOKENS // BLOCK
            assert tiers["disk"] >= 16 * BLOCK and tiers["cpu"] == tiers["peer"] == 0, tiers
    finally:
        await worker.stop()
        await kvm.stop()
