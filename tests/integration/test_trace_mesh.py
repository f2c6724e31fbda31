"""One trace per request across the whole mesh, in one process with an in-memory exporter: a
real etcd, a kvmanager, a real vLLM worker (tiny model) whose KV connector saves to and loads
from that kvmanager, and a router finding the worker through etcd. A prompt computed once,
saved to the kvmanager and then forgotten by the engine is served again with its prefix loaded
from the kvmanager; that request's spans form one tree under the router's ``Router/Generate``
span: ``tokenize``, ``hash``, ``route``, then the worker's ``Worker/Generate`` (through gRPC
metadata), its ``engine.generate`` with ``engine.prefill`` (holding ``engine.queue`` and the
kvmanager's ``Lookup`` / ``GetBlocks`` spans) and ``engine.decode``, in time order.

Also: a client leaving an HTTP stream mid-way (the OpenAI front door) leaves no
"Failed to detach context" error (the server spans' context is never held across a yield), and
the OTLP exporter every service configures (``--trace-exporter otlp --otlp-endpoint``) delivers
to a collector."""

from __future__ import annotations

import asyncio
import functools
import logging
import os
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from kvmesh.client import RouterClient, make_request
from kvmesh.kv.hashing import HashConfig, block_hashes
from kvmesh.telemetry import Exporter, otlp_target, span_processor
from services.kvmanager.config import KvManagerConfig
from services.kvmanager.core.config import StoreConfig
from services.kvmanager.main import start_kvmanager
from services.router.config import RouterConfig
from services.router.main import RunningRouter, start_router
from services.worker.config import EngineConfig, WorkerConfig
from services.worker.connector import kv_transfer_config
from services.worker.connector.kvmanager_client import kv_layout
from services.worker.main import VLLM_ENVIRONMENT
from services.worker.server import start_worker
from services.worker.sim.engine import SimEngineConfig, SimulatedEngine
from services.worker.sim.model import SimWorkerConfig
from services.worker.traced import TracedEngine
from tests.support import eventually, span_exporter

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

BLOCK = 32
VOCAB = 1024
PROMPT = [10 + (7331 * 7919 + i * 31) % (VOCAB - 10) for i in range(200)]  # 6 full blocks
MAX_TOKENS = 8
# Spans of different services' clocks: the engine's phases are monotonic readings turned into
# wall-clock time, the others are wall-clock readings; allow this much between the two.
CLOCK_SLACK_NS = 5_000_000


@pytest.fixture(scope="module")
def spans() -> InMemorySpanExporter:
    """An in-memory exporter on the process's tracer provider (set once per process)."""
    return span_exporter("kvmesh-trace-mesh-test")


def _trace_of(spans: InMemorySpanExporter, request_id: str) -> int:
    (top,) = [
        s
        for s in spans.get_finished_spans()
        if s.name == "engine.generate" and s.attributes.get("request_id") == request_id
    ]
    return top.context.trace_id


def _one(got: list[ReadableSpan], name: str, kind: SpanKind | None = None) -> ReadableSpan:
    found = [s for s in got if s.name == name and (kind is None or s.kind is kind)]
    assert len(found) == 1, f"{name}: {len(found)} spans in {sorted(s.name for s in got)}"
    return found[0]


def _child_of(span: ReadableSpan, parent: ReadableSpan) -> bool:
    return span.parent is not None and span.parent.span_id == parent.context.span_id


def _within(span: ReadableSpan, outer: ReadableSpan, slack_ns: int = 0) -> bool:
    assert span.start_time is not None and span.end_time is not None
    assert outer.start_time is not None and outer.end_time is not None
    return (
        outer.start_time - slack_ns <= span.start_time
        and span.end_time <= outer.end_time + slack_ns
    )


async def test_one_trace_from_router_through_worker_to_kvmanager(
    tiny_model: Path, etcd, tmp_path: Path, spans: InMemorySpanExporter, monkeypatch
) -> None:
    for key, value in VLLM_ENVIRONMENT.items():
        monkeypatch.setenv(key, os.environ.get(key, value))
    from services.worker.engine import VllmEngine

    cluster, node = "trace-mesh", "node-trace"
    endpoints = tuple(etcd.endpoints)
    kvm = await start_kvmanager(
        KvManagerConfig(
            kvmanager_id="kvm-trace",
            node=node,
            cluster=cluster,
            etcd_endpoints=endpoints,
            store=StoreConfig(cpu_bytes=8 << 20, disk_bytes=16 << 20, disk_dir=tmp_path / "kv"),
            drain_grace_s=1.0,
            metrics_port=-1,
        )
    )
    engine = None
    worker = router = None
    try:
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
            node=node,
            cluster=cluster,
            etcd_endpoints=endpoints,
            drain_grace_s=2.0,
            metrics_port=-1,
        )
        engine = await VllmEngine.start(config.engine)
        worker = await start_worker(config, TracedEngine(engine))
        router = await start_router(
            RouterConfig(
                cluster=cluster,
                etcd_endpoints=endpoints,
                http_port=-1,
                metrics_port=-1,
                drain_grace_s=1.0,
            )
        )
        await eventually(
            lambda: router.workers.candidates("tiny"), 30.0, "the router sees the worker"
        )
        async with RouterClient(router.address) as client:
            # Cold: computed, then saved to the kvmanager in the background.
            cold = await client.complete(
                make_request(PROMPT, max_tokens=2, temperature=0.0, request_id="cold")
            )
            assert cold.usage is not None and cold.usage.cached_prompt_tokens == 0
            layout = kv_layout(engine.info.connector_layout)
            hashes = block_hashes(PROMPT, HashConfig(block_size=BLOCK))
            await eventually(
                lambda: len(kvm.store.lookup(layout, hashes)) == len(hashes),
                30.0,
                "the prompt's blocks reach the kvmanager",
            )
            # Forget the engine's own copy: the prefix now comes from the kvmanager.
            assert await engine.llm.reset_prefix_cache()
            warm = await client.complete(
                make_request(
                    PROMPT,
                    max_tokens=MAX_TOKENS,
                    temperature=0.0,
                    ignore_eos=True,
                    request_id="warm",
                )
            )
    finally:
        if router is not None:
            await router.stop()
        if worker is not None:
            await worker.stop()
        await kvm.stop()
    loadable = (len(PROMPT) - 1) // BLOCK  # whole blocks, never the last token
    assert warm.usage is not None and warm.usage.cached_prompt_tokens == loadable * BLOCK

    trace_id = _trace_of(spans, "warm")

    def in_trace() -> list[ReadableSpan]:
        return [s for s in spans.get_finished_spans() if s.context.trace_id == trace_id]

    # Server spans end as their calls wind down, after the client has its last message.
    await eventually(
        lambda: {"/kvmesh.v1.Router/Generate", "kv.get_blocks"} <= {s.name for s in in_trace()},
        5,
        "the router's and the kvmanager's spans end",
    )
    got = in_trace()
    by_id = {s.context.span_id: s for s in got}

    # One tree: the router's request span is the root and every span leads to it.
    root = _one(got, "/kvmesh.v1.Router/Generate", SpanKind.SERVER)
    assert root.parent is None
    assert [s for s in got if s.parent is None] == [root]
    assert root.attributes["request_id"] == "warm" and root.attributes["model"] == "tiny"
    assert root.attributes["rpc.grpc.status_code"] == 0
    assert [e.name for e in root.events] == ["first_token"]
    for s in got:
        hops = 0
        cur = s
        while cur.parent is not None:
            assert cur.parent.span_id in by_id, f"{cur.name}'s parent is not in the trace"
            cur = by_id[cur.parent.span_id]
            hops += 1
        assert cur is root and hops < 10

    # Router: tokenize -> hash -> route, then the worker call.
    tokenize, hashing, route = (_one(got, n) for n in ("tokenize", "hash", "route"))
    call = _one(got, "/kvmesh.v1.Worker/Generate", SpanKind.CLIENT)
    for s in (tokenize, hashing, route, call):
        assert _child_of(s, root), s.name
        assert _within(s, root), s.name
    assert tokenize.attributes["prompt_tokens"] == len(PROMPT)
    assert hashing.attributes["blocks"] == len(PROMPT) // BLOCK
    assert route.attributes["worker_id"] == "w-trace"
    assert tokenize.end_time <= hashing.start_time <= hashing.end_time <= route.start_time
    assert route.end_time <= call.start_time

    # Worker: its server span continues the router's call (W3C context in gRPC metadata).
    served = _one(got, "/kvmesh.v1.Worker/Generate", SpanKind.SERVER)
    assert _child_of(served, call) and _within(served, call)
    generate = _one(got, "engine.generate")
    prefill, queue, decode = (
        _one(got, n) for n in ("engine.prefill", "engine.queue", "engine.decode")
    )
    assert _child_of(generate, served) and _within(generate, served, CLOCK_SLACK_NS)
    assert _child_of(prefill, generate) and _child_of(decode, generate)
    assert _child_of(queue, prefill) and _within(queue, prefill)
    # The phases are laid end to end inside the request.
    assert generate.start_time == prefill.start_time == queue.start_time
    assert prefill.end_time == decode.start_time < decode.end_time <= generate.end_time
    assert prefill.attributes["prompt_tokens"] == len(PROMPT)
    assert prefill.attributes["cached_tokens"] == loadable * BLOCK
    assert decode.attributes["completion_tokens"] == MAX_TOKENS
    assert decode.attributes["finish_reason"] == "length"
    assert generate.attributes["cached_tokens"] == loadable * BLOCK

    # kvmanager: the connector's Lookup and GetBlocks for this request, inside its prefill.
    lookups = [s for s in got if s.name == "/kvmesh.v1.KvManager/Lookup"]
    gets = [s for s in got if s.name == "/kvmesh.v1.KvManager/GetBlocks"]
    assert lookups and gets, sorted(s.name for s in got)
    for s in lookups + gets:
        assert s.kind is SpanKind.SERVER and _child_of(s, prefill), s.name
        assert _within(s, prefill, CLOCK_SLACK_NS), s.name
    kv_lookups = [s for s in got if s.name == "kv.lookup"]
    (kv_get,) = [s for s in got if s.name == "kv.get_blocks"]
    assert kv_lookups and all(by_id[s.parent.span_id] in lookups for s in kv_lookups if s.parent)
    assert kv_get.parent is not None and by_id[kv_get.parent.span_id] in gets
    assert max(s.attributes["kv.blocks_found"] for s in kv_lookups) == len(hashes)
    assert kv_get.attributes["kv.blocks_sent"] == loadable
    # Saves are batched on the connector's saver thread: never part of a request's trace.
    assert not any(s.name.endswith("KvManager/PutBlocks") for s in got)


# ---- a client leaving mid-stream ----------------------------------------------------------------
@pytest.fixture
async def sim_mesh(etcd, spans: InMemorySpanExporter) -> AsyncIterator[RunningRouter]:
    """A router with its HTTP front door and one fast simulated worker (no engine)."""
    cluster = "trace-disconnect"
    endpoints = tuple(etcd.endpoints)
    engine = SimulatedEngine(
        SimEngineConfig(
            worker=SimWorkerConfig(capacity_blocks=1024, block_size=BLOCK),
            model="sim",
            max_model_len=4096,
            vocab_size=VOCAB,
            speedup=50.0,
        ),
        hasher=functools.partial(block_hashes, cfg=HashConfig(block_size=BLOCK)),
    )
    worker = await start_worker(
        WorkerConfig(worker_id="w-sim", cluster=cluster, etcd_endpoints=endpoints, metrics_port=-1),
        TracedEngine(engine),
    )
    router = await start_router(
        RouterConfig(cluster=cluster, etcd_endpoints=endpoints, metrics_port=-1, drain_grace_s=1.0)
    )
    try:
        await eventually(
            lambda: router.workers.candidates("sim"), 30.0, "the router sees the worker"
        )
        yield router
    finally:
        await router.stop()
        await worker.stop()


async def test_client_leaving_mid_stream_detaches_no_context(
    sim_mesh: RunningRouter, caplog: pytest.LogCaptureFixture
) -> None:
    """The router and worker each cancel their stream while gRPC may be sending a message; the
    abandoned handler generators are closed later from other tasks, where a context attached
    across their yield could not be detached (OpenTelemetry logs that at ERROR)."""
    assert sim_mesh.http is not None
    url = sim_mesh.http.base_url + "/completions"
    body = {"model": "sim", "prompt": PROMPT, "max_tokens": 2000, "stream": True}
    caplog.set_level(logging.ERROR, logger="opentelemetry.context")
    async with aiohttp.ClientSession() as session:
        for i in range(10):
            resp = await session.post(url, json=body)
            assert resp.status == 200
            for _ in range(1 + i % 4):  # leave after a few events
                assert await resp.content.readline()
            resp.close()
            await asyncio.sleep(0.1)
    await eventually(lambda: sim_mesh.servicer.in_flight == 0, 10, "the router call ends")
    await asyncio.sleep(0.5)  # abandoned generators are closed from tasks of their own
    errors = [r for r in caplog.records if "detach" in r.getMessage().lower()]
    assert not errors, errors[0].getMessage()


# ---- OTLP --------------------------------------------------------------------------------------
class _Collector(trace_service_pb2_grpc.TraceServiceServicer):
    """The receiving end of OTLP/gRPC, as a collector serves it (plaintext)."""

    def __init__(self) -> None:
        self.spans: list[tuple[str, str]] = []  # (service.name, span name)

    async def Export(
        self, request: trace_service_pb2.ExportTraceServiceRequest, context: object
    ) -> trace_service_pb2.ExportTraceServiceResponse:
        for rs in request.resource_spans:
            attrs = {a.key: a.value.string_value for a in rs.resource.attributes}
            for ss in rs.scope_spans:
                self.spans.extend((attrs.get("service.name", ""), s.name) for s in ss.spans)
        return trace_service_pb2.ExportTraceServiceResponse()


@pytest.mark.parametrize("form", ["host:port", "http://host:port"])
async def test_otlp_exporter_sends_to_the_configured_collector(form: str) -> None:
    """``--trace-exporter otlp --otlp-endpoint`` (every service's flags) reaches a plaintext
    collector given as host:port or http://host:port."""
    collector = _Collector()
    server = grpc.aio.server()
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(collector, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    endpoint = form.replace("host:port", f"127.0.0.1:{port}")
    provider = TracerProvider(resource=Resource.create({"service.name": "kvmesh-otlp-test"}))
    processor = span_processor(Exporter.OTLP, endpoint)
    assert processor is not None
    provider.add_span_processor(processor)
    try:
        with provider.get_tracer(__name__).start_as_current_span("probe"):
            pass
        assert await asyncio.to_thread(provider.force_flush, 10_000)
    finally:
        await asyncio.to_thread(provider.shutdown)
        await server.stop(0)
    assert collector.spans == [("kvmesh-otlp-test", "probe")]


def test_otlp_endpoint_forms() -> None:
    assert otlp_target("collector:4317") == ("collector:4317", True)
    assert otlp_target("http://collector:4317") == ("http://collector:4317", True)
    assert otlp_target("https://collector:4317") == ("https://collector:4317", False)
    with pytest.raises(ValueError, match="otlp-endpoint"):
        otlp_target("grpc://collector:4317")
    assert span_processor(Exporter.NONE) is None
