"""One trace per request reaches the kvmanager: a real vLLM worker (tiny model) whose KV connector
talks to a real kvmanager serves a prompt whose blocks the kvmanager holds, and the worker's
Generate span, the kvmanager's Lookup and GetBlocks RPC spans and its ``kv.lookup`` /
``kv.get_blocks`` domain spans share the client's trace, each kvmanager span's parent chain
leading to the worker's span. The trace context crosses the worker's engine-core process as the
request's ``kv_transfer_params`` and reaches the kvmanager as gRPC metadata. Also: a peer fetch
carries its request's context to the pool thread that makes the call."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import grpc
import pytest
from opentelemetry import propagate, trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from kvmesh.kv.hashing import HashConfig, block_hashes
from kvmesh.telemetry import setup_tracing
from kvmesh.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from services.kvmanager.config import KvManagerConfig
from services.kvmanager.core.config import StoreConfig
from services.kvmanager.main import RunningKvManager, start_kvmanager
from services.worker.config import EngineConfig, WorkerConfig
from services.worker.connector import kv_transfer_config
from services.worker.connector.kvmanager_client import (
    TRACE_PARAM,
    call_metadata,
    kv_layout,
    trace_metadata,
)
from services.worker.connector.peer_prefetch import FetchOutcome, PeerFetchConfig, PeerPrefetcher
from services.worker.connector.plan import PeerSource
from services.worker.main import VLLM_ENVIRONMENT

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

BLOCK = 32
VOCAB = 1024
PROMPT = [10 + (4242 * 7919 + i * 31) % (VOCAB - 10) for i in range(200)]  # 6 full blocks


def _span_exporter() -> InMemorySpanExporter:
    """An in-memory exporter on the process's tracer provider (set once per process)."""
    exporter = InMemorySpanExporter()
    provider = trace.get_tracer_provider()
    if isinstance(provider, TracerProvider):  # another module set one up already
        provider.add_span_processor(SimpleSpanProcessor(exporter))
    else:
        setup_tracing("kvmesh-kv-trace-test", extra_processor=SimpleSpanProcessor(exporter))
    return exporter


@pytest.fixture(scope="module")
def spans() -> InMemorySpanExporter:
    return _span_exporter()


@pytest.fixture
async def kvm(tmp_path: Path, spans: InMemorySpanExporter) -> AsyncIterator[RunningKvManager]:
    running = await start_kvmanager(
        KvManagerConfig(
            kvmanager_id="node-trace",
            node="node-trace",
            etcd_endpoints=(),
            store=StoreConfig(cpu_bytes=8 << 20, disk_bytes=16 << 20, disk_dir=tmp_path / "kv"),
            metrics_port=-1,
        )
    )
    yield running
    await running.stop()


async def _generate(address: str, rid: str) -> tuple[int, int]:
    """Generates under a fresh client root span: (its trace id, cached prompt tokens)."""
    tracer = trace.get_tracer(__name__)
    with tracer.start_as_current_span("test.client") as root:
        carrier: dict[str, str] = {}
        propagate.inject(carrier)
        req = worker_pb2.WorkerGenerateRequest(
            request_id=rid,
            prompt_token_ids=PROMPT,
            sampling=common_pb2.SamplingParams(max_tokens=4, temperature=0.0),
        )
        cached = -1
        async with grpc.aio.insecure_channel(address) as ch:
            stub = worker_pb2_grpc.WorkerStub(ch)
            async for msg in stub.Generate(req, timeout=120, metadata=tuple(carrier.items())):
                if msg.HasField("finished"):
                    cached = msg.finished.usage.cached_prompt_tokens
    return root.get_span_context().trace_id, cached


def _in_trace(spans: InMemorySpanExporter, trace_id: int) -> list[ReadableSpan]:
    return [s for s in spans.get_finished_spans() if s.context.trace_id == trace_id]


def _leads_to(span: ReadableSpan, ancestor: ReadableSpan, by_id: dict[int, ReadableSpan]) -> bool:
    """Whether ``span``'s parent chain reaches ``ancestor``."""
    cur: ReadableSpan | None = span
    while cur is not None and cur.parent is not None:
        if cur.parent.span_id == ancestor.context.span_id:
            return True
        cur = by_id.get(cur.parent.span_id)
    return False


async def test_kvmanager_spans_join_the_request_trace(tiny_model, kvm, spans, monkeypatch):
    for key, value in VLLM_ENVIRONMENT.items():
        monkeypatch.setenv(key, os.environ.get(key, value))
    from services.worker.engine import VllmEngine
    from services.worker.server import start_worker

    config = WorkerConfig(
        engine=EngineConfig(
            model=str(tiny_model),
            served_model_name="tiny",
            dtype="float32",
            max_model_len=512,
            block_size=BLOCK,
            kv_cache_bytes=16 << 20,
            kv_transfer_config=kv_transfer_config(kvm.address, store="kvmanager"),
        ),
        worker_id="w-trace",
        etcd_endpoints=(),
        drain_grace_s=2.0,
    )
    engine = await VllmEngine.start(config.engine)
    worker = await start_worker(config, engine)
    try:
        # Cold: computed, then saved to the kvmanager in the background.
        _, cached = await _generate(worker.address, "cold")
        assert cached == 0
        layout = kv_layout(engine.info.connector_layout)
        hashes = block_hashes(PROMPT, HashConfig(block_size=BLOCK))
        deadline = time.monotonic() + 30
        while len(kvm.store.lookup(layout, hashes)) < len(hashes):
            assert time.monotonic() < deadline, "the prompt's blocks never reached the kvmanager"
            await asyncio.sleep(0.05)
        # Forget the engine's own copy: the next request loads its prefix from the kvmanager.
        assert await engine.llm.reset_prefix_cache()
        trace_id, cached = await _generate(worker.address, "warm")
    finally:
        await worker.stop()
    loadable = (len(PROMPT) - 1) // BLOCK  # whole blocks, never the last token
    assert cached == loadable * BLOCK

    got = _in_trace(spans, trace_id)
    deadline = time.monotonic() + 5  # server spans end as their calls wind down
    while not any(s.name == "kv.get_blocks" for s in got) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
        got = _in_trace(spans, trace_id)
    by_id = {s.context.span_id: s for s in got}
    names = [s.name for s in got]
    (root,) = [s for s in got if s.name == "test.client"]
    (generate,) = [s for s in got if s.name.endswith("Worker/Generate")]
    assert generate.parent is not None and generate.parent.span_id == root.context.span_id
    lookups = [s for s in got if s.name.endswith("KvManager/Lookup")]
    gets = [s for s in got if s.name.endswith("KvManager/GetBlocks")]
    kv_lookups = [s for s in got if s.name == "kv.lookup"]
    kv_gets = [s for s in got if s.name == "kv.get_blocks"]
    assert lookups and gets and kv_lookups and kv_gets, names
    for s in lookups + gets + kv_lookups + kv_gets:
        assert _leads_to(s, generate, by_id), f"{s.name} is not under the worker's span"
    for s in kv_lookups:
        assert s.parent is not None and by_id[s.parent.span_id] in lookups
    for s in kv_gets:
        assert s.parent is not None and by_id[s.parent.span_id] in gets
    assert max(s.attributes["kv.blocks_found"] for s in kv_lookups) == len(hashes)
    assert all(s.attributes["kv.blocks_asked"] == len(hashes) for s in kv_lookups)
    get = kv_gets[0]
    assert get.attributes["kv.blocks_asked"] == get.attributes["kv.blocks_sent"] == loadable
    assert get.attributes["kv.bytes_sent"] == loadable * layout.block_bytes
    tier_counts = [v for k, v in get.attributes.items() if k.startswith("kv.blocks_from_")]
    assert sum(tier_counts) == loadable
    # Saves are batched on the connector's saver thread: never part of a request's trace.
    assert not any(n.endswith("KvManager/PutBlocks") for n in names)


def test_peer_fetch_carries_the_request_trace() -> None:
    """The fetch runs on a pool thread: the request's context is set there for its calls."""
    seen: list[tuple[str, object]] = []
    done = threading.Event()

    def fetch(layout_key: str, keys: Sequence[int], peer: PeerSource, timeout_s: float):
        seen.append((threading.current_thread().name, call_metadata()))
        done.set()
        return FetchOutcome(len(keys))

    params = {TRACE_PARAM: {"traceparent": "00-" + "ab" * 16 + "-" + "cd" * 8 + "-01"}}
    metadata = trace_metadata(params)
    assert metadata == (("traceparent", params[TRACE_PARAM]["traceparent"]),)
    assert trace_metadata({}) is None and trace_metadata({TRACE_PARAM: {"traceparent": ""}}) is None
    prefetcher = PeerPrefetcher(PeerFetchConfig(), fetch)
    try:
        assert prefetcher.start("r", PeerSource("peer", 2), ["layout"], [1, 2], metadata)
        assert done.wait(5)
        assert not prefetcher.pending("r")
    finally:
        prefetcher.close()
    assert call_metadata() is None  # only the fetch's own thread had it
    ((thread, got),) = seen
    assert thread.startswith("kvmesh-peer") and got == metadata
