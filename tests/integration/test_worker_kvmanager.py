"""A real vLLM worker (the tiny model) saving its KV blocks to a real kvmanager daemon and a
fresh engine loading them back: the second engine serves the same prompts from the kvmanager
(cached prompt tokens reported, greedy output identical to the first engine's), the bytes move
through the engine's shared-memory segment (detached when the engine stops), the kvmanager's
tier events show the blocks, and a kvmanager that is gone degrades to recompute, not to errors."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from kvmesh.kv.events import Tier
from kvmesh.kv.hashing import HashConfig, block_hashes
from kvmesh.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from services.kvmanager.config import KvManagerConfig
from services.kvmanager.core.config import StoreConfig
from services.kvmanager.main import RunningKvManager, start_kvmanager
from services.worker.config import EngineConfig, WorkerConfig
from services.worker.connector import kv_transfer_config
from services.worker.connector.kvmanager_client import kv_layout
from services.worker.main import VLLM_ENVIRONMENT

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

BLOCK = 32
VOCAB = 1024


def prompt(n: int, salt: int) -> list[int]:
    return [10 + (salt * 7919 + i * 31) % (VOCAB - 10) for i in range(n)]


PROMPTS = [prompt(300, 1), prompt(200, 2), prompt(100, 3)]


@pytest.fixture(scope="module")
async def kvm(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[RunningKvManager]:
    running = await start_kvmanager(
        KvManagerConfig(
            kvmanager_id="node-1",
            node="node-1",
            etcd_endpoints=(),
            store=StoreConfig(
                cpu_bytes=8 << 20, disk_bytes=64 << 20, disk_dir=tmp_path_factory.mktemp("kv")
            ),
            metrics_port=-1,
        )
    )
    yield running
    await running.stop()


async def serve(tiny_model: Path, kvmanager: str, name: str):
    """A worker (engine + gRPC service) whose connector talks to ``kvmanager``."""
    from services.worker.engine import VllmEngine
    from services.worker.server import start_worker

    config = WorkerConfig(
        engine=EngineConfig(
            model=str(tiny_model),
            served_model_name="tiny",
            dtype="float32",
            max_model_len=1024,
            block_size=BLOCK,
            kv_cache_bytes=32 << 20,
            kv_transfer_config=kv_transfer_config(kvmanager, store="kvmanager"),
        ),
        worker_id=name,
        etcd_endpoints=(),
        drain_grace_s=2.0,
    )
    engine = await VllmEngine.start(config.engine)
    return engine, await start_worker(config, engine)


async def run_all(address: str) -> list[tuple[list[int], int]]:
    """(output token ids, cached prompt tokens) of each prompt, greedily, one after another."""
    out = []
    async with grpc.aio.insecure_channel(address) as ch:
        stub = worker_pb2_grpc.WorkerStub(ch)
        for i, p in enumerate(PROMPTS):
            req = worker_pb2.WorkerGenerateRequest(
                request_id=f"r{i}",
                prompt_token_ids=p,
                sampling=common_pb2.SamplingParams(max_tokens=12, temperature=0.0),
            )
            tokens: list[int] = []
            cached = -1
            async for msg in stub.Generate(req, timeout=120):
                tokens.extend(msg.token_ids)
                if msg.HasField("finished"):
                    cached = msg.finished.usage.cached_prompt_tokens
            out.append((tokens, cached))
    return out


async def connector_count(worker, name: str, at_least: int) -> float:
    """The worker's ``kvmesh_worker_kv_connector_total{count=name}`` once it reaches
    ``at_least`` (vLLM's stats reach the worker shortly after the step)."""
    value = 0.0
    for _ in range(250):
        worker.refresh_metrics()
        got = worker.metrics.registry.get_sample_value(
            "kvmesh_worker_kv_connector_total", {"count": name}
        )
        value = got or 0.0
        if value >= at_least:
            break
        await asyncio.sleep(0.02)
    return value


async def detached(kvm: RunningKvManager) -> None:
    for _ in range(500):
        if kvm.shm.stats.attached == 0:
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"{kvm.shm.stats.attached} shared-memory segments still attached")


async def test_a_fresh_engine_loads_prefixes_from_the_kvmanager(tiny_model, kvm, monkeypatch):
    for key, value in VLLM_ENVIRONMENT.items():
        monkeypatch.setenv(key, os.environ.get(key, value))
    hub_blocks_before = kvm.store.usage(Tier.CPU).blocks

    engine, worker = await serve(tiny_model, kvm.address, "w-first")
    try:
        layout_key = engine.info.connector_layout
        assert layout_key, "the engine reports its connector's layout"
        first = await run_all(worker.address)
        full_blocks = sum(len(p) // BLOCK for p in PROMPTS)
        # Its connector's counters on the worker's /metrics: one lookup per prompt (no router,
        # so no count of the store's prefix to skip it), every full prompt block saved.
        assert await connector_count(worker, "lookups", len(PROMPTS)) == len(PROMPTS)
        assert await connector_count(worker, "save_blocks", full_blocks) >= full_blocks
        assert await connector_count(worker, "load_blocks", 0) == 0
    finally:
        await worker.stop()
    layout = kv_layout(layout_key)
    # Everything the first engine computed in full blocks reached the kvmanager (saves are
    # asynchronous; stopping the engine flushed them or they were already in).
    for p in PROMPTS:
        hashes = block_hashes(p, HashConfig(block_size=BLOCK))
        assert len(kvm.store.lookup(layout, hashes)) == len(hashes), "prompt blocks saved"
    assert kvm.store.usage(Tier.CPU).blocks > hub_blocks_before
    # Same node: the engine's connector attached a segment and saved through it; stopping the
    # engine detached it.
    assert kvm.shm.stats.attaches >= 1 and kvm.shm.stats.bytes_in > 0
    await detached(kvm)
    # The kvmanager's tier events for this layout carry them (what routers subscribe to).
    log = kvm.hubs.hub(layout.key).log
    assert log.held(Tier.CPU) + log.held(Tier.DISK) >= sum(len(p) // BLOCK for p in PROMPTS)

    engine2, worker2 = await serve(tiny_model, kvm.address, "w-second")
    try:
        assert engine2.info.connector_layout == layout_key
        second = await run_all(worker2.address)
        loaded = sum((len(p) - 1) // BLOCK for p in PROMPTS)
        assert await connector_count(worker2, "load_blocks", loaded) == loaded
    finally:
        await worker2.stop()
    assert kvm.shm.stats.bytes_out > 0, "loads came through shared memory"
    await detached(kvm)
    for (tokens1, cached1), (tokens2, cached2), p in zip(first, second, PROMPTS, strict=True):
        assert tokens2 == tokens1, "identical greedy output from loaded KV"
        assert cached1 == 0
        # Whole blocks, never the last token: the engine computes at least one.
        assert cached2 == (len(p) - 1) // BLOCK * BLOCK, (len(p), cached2)


async def test_without_a_kvmanager_the_engine_recomputes(tiny_model, monkeypatch):
    for key, value in VLLM_ENVIRONMENT.items():
        monkeypatch.setenv(key, os.environ.get(key, value))
    # Nothing listens on this port: every lookup, load and save fails fast and is a miss.
    _engine, worker = await serve(tiny_model, "127.0.0.1:9", "w-alone")
    try:
        results = await run_all(worker.address)
    finally:
        await worker.stop()
    assert all(len(tokens) == 12 and cached == 0 for tokens, cached in results)
