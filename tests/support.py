"""Helpers shared by the test layers (no fixtures here: those are in conftest.py)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pathlib import Path

    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from services.worker.config import EngineConfig, SpeculativeConfig


async def eventually(
    predicate: Callable[[], object],
    timeout_s: float = 10.0,
    what: str = "condition",
    interval_s: float = 0.02,
) -> float:
    """Waits until ``predicate()`` is truthy, polling every ``interval_s``; returns the seconds
    it took. Fails the test with ``what`` when ``timeout_s`` passes first. For what a server
    does after its client has already returned, or what arrives through a watch: never a
    fixed sleep."""
    start = time.monotonic()
    while not predicate():
        waited = time.monotonic() - start
        if waited > timeout_s:
            raise AssertionError(f"{what}: not within {timeout_s} s")
        await asyncio.sleep(interval_s)
    return time.monotonic() - start


def span_exporter(service_name: str) -> InMemorySpanExporter:
    """An in-memory exporter on the process's tracer provider, which is set once per process:
    added to the one another module set up already, or set up here with ``service_name``."""
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from kvmesh.telemetry import setup_tracing

    exporter = InMemorySpanExporter()
    provider = trace.get_tracer_provider()
    if isinstance(provider, TracerProvider):
        provider.add_span_processor(SimpleSpanProcessor(exporter))
    else:
        setup_tracing(service_name, extra_processor=SimpleSpanProcessor(exporter))
    return exporter


def tiny_engine_config(
    model: Path,
    *,
    spec: SpeculativeConfig | None = None,
    kvmanager: str = "",
    ranks: int = 1,
    block_size: int = 32,
) -> EngineConfig:
    """The tiny model's engine as the real-vLLM connector tests run it: float32 (outputs are
    compared token for token), 1,024 positions, 16 MiB of KV cache; ``kvmanager``: the
    address of the node kvmanager its KV connector saves to and loads from (empty: none)."""
    from services.worker.config import EngineConfig, SpeculativeConfig
    from services.worker.connector import kv_transfer_config

    return EngineConfig(
        model=str(model),
        served_model_name="tiny",
        dtype="float32",
        max_model_len=1024,
        block_size=block_size,
        kv_cache_bytes=16 << 20,
        speculative=spec or SpeculativeConfig(),
        data_parallel_size=ranks,
        kv_transfer_config=kv_transfer_config(kvmanager, store="kvmanager") if kvmanager else None,
    )
