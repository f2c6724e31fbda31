"""The worker process: ``kvmesh worker`` (or ``python -m services.worker.main``).

Sets vLLM's environment before vLLM is imported, starts the engine, serves it over gRPC,
registers in etcd, prints ``KVMESH_WORKER_READY worker_id=... address=host:port port=...
metrics=URL`` on stdout, and on SIGTERM/SIGINT drains and exits 0.

vLLM starts its engine core with ``spawn``, which imports this module again in the child as
``__mp_main__``: keep module-level imports light and everything else inside functions.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
from typing import Any

from kvmesh.discovery.keys import Role
from kvmesh.telemetry import Exporter, setup_logging, setup_tracing
from kvmesh.units import parse_bytes

from .config import EngineConfig, WorkerConfig

log = logging.getLogger(__name__)

VLLM_ENVIRONMENT = {
    # The engine core child runs the model itself (no third process); start ~10 s instead of
    # ~15 s. AsyncLLM keeps the core in a child process either way.
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    # vLLM logs to stdout by default; stdout carries our ready line.
    "VLLM_LOGGING_STREAM": "ext://sys.stderr",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
}
"""Set (unless already set) before vLLM is imported; the engine core child inherits them."""


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("want a JSON object ({...})")
    return value


def _cpu_list(text: str) -> tuple[int, ...]:
    from kvmesh.cpus import parse_cpu_list

    try:
        return parse_cpu_list(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def parse_args(argv: list[str] | None) -> WorkerConfig:
    from .connector import kv_transfer_config

    d, e = WorkerConfig(), EngineConfig()
    p = argparse.ArgumentParser(prog="kvmesh worker", description="Run a kvmesh vLLM worker.")
    g = p.add_argument_group("engine")
    g.add_argument(
        "--engine",
        default=d.engine_kind,
        choices=["vllm", "simulated"],
        help="vllm (default), or simulated: a simulator for scale tests (fake tokens, modelled "
        "timing, real block cache and KV events; clients must send token ids)",
    )
    g.add_argument(
        "--sim-capacity-blocks",
        type=int,
        default=d.sim_capacity_blocks,
        help="simulated: KV blocks",
    )
    g.add_argument(
        "--sim-speedup",
        type=float,
        default=d.sim_speedup,
        help="simulated: virtual seconds per real second (below 1: a slower model)",
    )
    g.add_argument(
        "--sim-max-running",
        type=int,
        default=d.sim_max_running,
        help="simulated: most requests running at once (vLLM's max_num_seqs)",
    )
    g.add_argument("--model", default="", metavar="PATH", help="model directory (vllm: required)")
    g.add_argument("--served-model-name", default=e.served_model_name, help="default: dir name")
    g.add_argument("--dtype", default=e.dtype, help="auto, float32, bfloat16, float16")
    g.add_argument("--max-model-len", type=int, default=e.max_model_len, help="0: the model's")
    g.add_argument("--block-size", type=int, default=e.block_size, help="tokens per KV block")
    g.add_argument(
        "--hash-seed",
        default=e.hash_seed,
        help="root seed of the block hash chain (vLLM's PYTHONHASHSEED); the same value on every "
        "worker and router (default: unset, vLLM's fixed seed)",
    )
    g.add_argument(
        "--kv-cache-bytes", type=parse_bytes, default=e.kv_cache_bytes, help="KV cache size"
    )
    g.add_argument("--max-num-seqs", type=int, default=e.max_num_seqs, help="0: vLLM's default")
    g.add_argument("--seed", type=int, default=e.seed)
    g.add_argument("--no-prefix-caching", action="store_true", help="turn prefix caching off")
    g.add_argument(
        "--kv-events-config",
        type=_json_object,
        help="vLLM KVEventsConfig fields as JSON (events are always on; default endpoints: ipc "
        "sockets in a temp dir)",
    )
    g.add_argument("--kv-transfer-config", type=_json_object, help="vLLM KVTransferConfig, JSON")
    g.add_argument(
        "--structured-outputs-config",
        type=_json_object,
        help="vLLM StructuredOutputsConfig fields as JSON, e.g. "
        '\'{"backend": "xgrammar", "disable_any_whitespace": true}\' (default: vLLM\'s)',
    )
    g.add_argument(
        "--compute-cpus",
        type=_cpu_list,
        default=e.compute_cpus,
        metavar="LIST",
        help="cores for the engine's compute threads, one thread per core, e.g. 0-6 (default: "
        "no binding); kvmesh up plans them per worker",
    )
    g.add_argument(
        "--service-cpus",
        type=_cpu_list,
        default=e.service_cpus,
        metavar="LIST",
        help="cores for this worker's gRPC front end and the engine's other threads, e.g. 7 "
        "(default: anywhere)",
    )
    g.add_argument(
        "--kvmanager",
        default="",
        metavar="HOST:PORT",
        help="the node's kvmanager: the engine saves computed KV blocks to it and loads prefixes "
        "it lacks from it (KvmeshConnector); overrides --kv-transfer-config",
    )
    s = p.add_argument_group("service")
    s.add_argument("--host", default=d.host, help="address to listen on (default %(default)s)")
    s.add_argument("--port", type=int, default=d.port, help="gRPC port; 0 = OS picks")
    s.add_argument("--advertise-host", default=d.advertise_host, help="host others dial")
    s.add_argument("--worker-id", default=d.worker_id, help="id in etcd (default host-port)")
    s.add_argument("--cluster", default=d.cluster, help="etcd cluster name (default %(default)s)")
    s.add_argument(
        "--etcd", default="", metavar="ENDPOINTS", help="host:port,...; empty: do not register"
    )
    s.add_argument("--etcd-ttl-s", type=float, default=d.etcd_ttl_s)
    s.add_argument("--role", default=d.role.value, choices=[r.value for r in Role])
    s.add_argument("--node", default=d.node, help="node name in the etcd record (default host)")
    s.add_argument("--drain-grace-s", type=float, default=d.drain_grace_s)
    s.add_argument("--load-interval-s", type=float, default=d.load_interval_s)
    s.add_argument("--metrics-host", default=d.metrics_host, help="address of /metrics")
    s.add_argument(
        "--metrics-port",
        type=int,
        default=d.metrics_port,
        help="Prometheus /metrics port; 0 = OS picks (printed in the ready line), -1 = off",
    )
    s.add_argument(
        "--trace-exporter", default=d.trace_exporter.value, choices=[x.value for x in Exporter]
    )
    s.add_argument("--otlp-endpoint", default=d.otlp_endpoint)
    s.add_argument("--log-level", default=d.log_level)
    a = p.parse_args(argv)
    if a.engine == "vllm" and not a.model:
        p.error("--model PATH is required with the vllm engine")
    return WorkerConfig(
        engine=EngineConfig(
            model=a.model,
            served_model_name=a.served_model_name,
            dtype=a.dtype,
            max_model_len=a.max_model_len,
            block_size=a.block_size,
            hash_seed=a.hash_seed,
            kv_cache_bytes=a.kv_cache_bytes,
            enable_prefix_caching=not a.no_prefix_caching,
            max_num_seqs=a.max_num_seqs,
            seed=a.seed,
            core_drain_s=math.ceil(a.drain_grace_s),
            compute_cpus=a.compute_cpus,
            service_cpus=a.service_cpus,
            kv_events_config=a.kv_events_config,
            structured_outputs_config=a.structured_outputs_config,
            kv_transfer_config=(
                kv_transfer_config(a.kvmanager, store="kvmanager")
                if a.kvmanager
                else a.kv_transfer_config
            ),
        ),
        engine_kind=a.engine,
        sim_capacity_blocks=a.sim_capacity_blocks,
        sim_speedup=a.sim_speedup,
        sim_max_running=a.sim_max_running,
        host=a.host,
        port=a.port,
        advertise_host=a.advertise_host,
        worker_id=a.worker_id,
        cluster=a.cluster,
        etcd_endpoints=tuple(x.strip() for x in a.etcd.split(",") if x.strip()),
        etcd_ttl_s=a.etcd_ttl_s,
        role=Role(a.role),
        node=a.node,
        drain_grace_s=a.drain_grace_s,
        load_interval_s=a.load_interval_s,
        metrics_host=a.metrics_host,
        metrics_port=a.metrics_port,
        trace_exporter=Exporter(a.trace_exporter),
        otlp_endpoint=a.otlp_endpoint,
        log_level=a.log_level,
    )


def prepare_environment(hash_seed: str | None = None) -> None:
    """vLLM's environment; must run before anything imports vllm. The block-hash seed is set
    or removed explicitly, so a PYTHONHASHSEED inherited from a shell or CI cannot silently make
    this worker's hashes differ from the routers'."""
    for key, value in VLLM_ENVIRONMENT.items():
        os.environ.setdefault(key, value)
    if hash_seed is None:
        os.environ.pop("PYTHONHASHSEED", None)
    else:
        os.environ["PYTHONHASHSEED"] = hash_seed


def simulated_engine(config: WorkerConfig):  # type: ignore[no-untyped-def]
    """The simulator (services/worker/sim), hashing token blocks exactly as vLLM would."""
    from functools import partial

    from kvmesh.kv.hashing import HashConfig, block_hashes

    from .sim.engine import SimEngineConfig, SimulatedEngine
    from .sim.model import SimWorkerConfig

    e = config.engine
    cfg = SimEngineConfig(
        worker=SimWorkerConfig(
            capacity_blocks=config.sim_capacity_blocks,
            block_size=e.block_size,
            max_running=config.sim_max_running,
        ),
        speedup=config.sim_speedup,
        model=e.served_model_name or "simulated",
        max_model_len=e.max_model_len,
    )
    hash_cfg = HashConfig(block_size=e.block_size, seed=e.hash_seed)
    return SimulatedEngine(cfg, hasher=partial(block_hashes, cfg=hash_cfg))


async def serve(config: WorkerConfig) -> None:
    from kvmesh.service import signal_event

    from .server import start_worker
    from .traced import TracedEngine

    stop = signal_event()  # a signal during the engine's start: stop once it is up
    if config.engine_kind == "simulated":
        engine = simulated_engine(config)
    else:
        from .engine import VllmEngine  # imports vLLM (seconds): only when it is the engine

        engine = await VllmEngine.start(config.engine)
    try:
        worker = await start_worker(config, TracedEngine(engine))
    except BaseException:
        await engine.close()
        raise
    print(worker.ready_line(), flush=True)
    await stop.wait()
    log.info("signal received: stopping worker %s", worker.worker_id)
    await worker.stop()


def main(argv: list[str] | None = None) -> int:
    config = parse_args(argv)
    prepare_environment(config.engine.hash_seed)
    setup_logging("worker", config.log_level)
    setup_tracing("kvmesh-worker", config.trace_exporter, config.otlp_endpoint)
    from kvmesh.service import run

    return run(serve(config), "worker")


if __name__ == "__main__":
    sys.exit(main())
