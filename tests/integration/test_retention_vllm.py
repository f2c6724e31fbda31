"""Session retention under a real vLLM worker (the tiny model) whose own KV memory is small, and
a node kvmanager whose CPU tier is small: two sessions' turns, then other traffic that evicts
both from the engine and would evict both from the kvmanager's LRU. The session the router
retained (RetainSession on its chain, as ``services/router/retention.py`` sends it) gets its
whole prefix back from the kvmanager on its next turn, with greedy output identical to the cold
one; the session that was not retained recomputes."""

from __future__ import annotations

import os
import time

import grpc
import pytest

from kvmesh.kv.hashing import HashConfig, block_hashes
from kvmesh.v1 import kvmanager_pb2, kvmanager_pb2_grpc, worker_pb2_grpc
from services.kvmanager.config import KvManagerConfig, RetentionConfig
from services.kvmanager.core.config import StoreConfig
from services.worker.config import EngineConfig, WorkerConfig
from services.worker.connector import kv_transfer_config
from services.worker.main import VLLM_ENVIRONMENT
from tests.integration.test_kv_tiers_vllm import (
    BLOCK,
    ENGINE_KV_BYTES,
    MAX_MODEL_LEN,
    PROMPT_TOKENS,
    generate,
    prompt,
)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

BLOCK_BYTES = 32 << 10  # the tiny model's float32 block
CPU_BLOCKS = 64  # the kvmanager's CPU tier: two prompts of 28 blocks and a little more


async def test_a_retained_session_keeps_its_prefix_through_pressure(tiny_model, monkeypatch):
    for key, value in VLLM_ENVIRONMENT.items():
        monkeypatch.setenv(key, os.environ.get(key, value))
    from services.kvmanager.main import start_kvmanager
    from services.worker.engine import VllmEngine
    from services.worker.server import start_worker

    kvm = await start_kvmanager(
        KvManagerConfig(
            kvmanager_id="node-1",
            node="node-1",
            etcd_endpoints=(),
            store=StoreConfig(cpu_bytes=CPU_BLOCKS * BLOCK_BYTES),
            retention=RetentionConfig(bytes=CPU_BLOCKS // 2 * BLOCK_BYTES),
            metrics_port=-1,
            drain_grace_s=1.0,
        )
    )
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
    kept_prompt, lost_prompt = prompt(1), prompt(2)
    full = (PROMPT_TOKENS - 1) // BLOCK * BLOCK
    try:
        async with (
            grpc.aio.insecure_channel(worker.address) as ch,
            grpc.aio.insecure_channel(kvm.address) as kch,
        ):
            stub = worker_pb2_grpc.WorkerStub(ch)
            kstub = kvmanager_pb2_grpc.KvManagerStub(kch)
            kept_cold, _, _ = await generate(stub, "kept-1", kept_prompt)
            await generate(stub, "lost-1", lost_prompt)
            (layout_key,) = kvm.hubs.layout_keys  # the one layout the connector saved
            hashes = block_hashes(kept_prompt, HashConfig(block_size=BLOCK))
            got = await kstub.RetainSession(
                kvmanager_pb2.RetainSessionRequest(
                    layout_key=layout_key, session_id="kept", block_hashes=hashes, ttl_s=300
                ),
                timeout=5,
            )
            # The connector saved the turn's prompt blocks under vLLM's own hashes.
            assert got.retained_blocks == got.held_blocks == PROMPT_TOKENS // BLOCK

            for i in range(4):  # 4 x 28 blocks: through the engine's 64 and the tier's 64
                await generate(stub, f"other-{i}", prompt(100 + i))

            t0 = time.monotonic()
            kept, kept_cached, kept_tiers = await generate(stub, "kept-2", kept_prompt)
            kept_s = time.monotonic() - t0
            t0 = time.monotonic()
            _, lost_cached, lost_tiers = await generate(stub, "lost-2", lost_prompt)
            lost_s = time.monotonic() - t0
            print(
                f"retained: {kept_cached} cached tokens {kept_tiers} in {kept_s:.3f} s; "
                f"not retained: {lost_cached} {lost_tiers} in {lost_s:.3f} s"
            )
            assert kept_cached == full and kept_tiers["cpu"] >= 16 * BLOCK, kept_tiers
            assert kept == kept_cold, "identical greedy output from the retained blocks"
            assert lost_cached < full // 2, lost_tiers
    finally:
        await worker.stop()
        await kvm.stop()
