"""The worker process: ``kvmesh worker`` (or ``python -m services.worker.main``).

Sets vLLM's environment before vLLM is imported, starts the engine, serves it over gRPC,
registers in etcd, prints ``KVMESH_WORKER_READY worker_id=... address=host:port port=...
metrics=URL`` on stdout, and on SIGTERM/SIGINT drains and exits 0.

vLLM starts its engine core with ``spawn``, which imports this module again in the child as
``__mp_main__``: keep module-level imports light and everything else inside functions.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import math
import os
import sys
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from kvmesh.telemetry import setup_logging, setup_tracing

from .config import WorkerConfig

if TYPE_CHECKING:
    from .core import Engine

log = logging.getLogger(__name__)
ENV = "KVMESH_WORKER_"  # environment variables: KVMESH_WORKER_<FLAG>

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


def parse_args(argv: list[str] | None, environ: Mapping[str, str] | None = None) -> WorkerConfig:
    """The worker's config: defaults < ``--config`` file < ``KVMESH_WORKER_*`` < flags."""
    from kvmesh.settings import add_config_flags, load_config

    from .connector import kv_transfer_config

    p = argparse.ArgumentParser(prog="kvmesh worker", description="Run a kvmesh vLLM worker.")
    opts = add_config_flags(p, WorkerConfig)
    env = os.environ if environ is None else environ
    config, given = load_config(p, WorkerConfig, p.parse_args(argv), opts, env, ENV)
    if config.engine_kind == "vllm" and not config.engine.model:
        p.error("--model PATH is required with the vllm engine")
    engine = config.engine
    if engine.data_parallel_size < 1:
        p.error(f"--data-parallel-size must be >= 1, got {engine.data_parallel_size}")
    if engine.enable_expert_parallel and config.engine_kind != "vllm":
        p.error("--enable-expert-parallel needs --engine vllm (the simulator has no experts)")
    if config.engine_kind == "vllm" and engine.speculative.enabled:
        from kvmesh.errors import InvalidArgument

        from .speculative import check_models

        try:
            check_models(engine.speculative, engine.model)
        except InvalidArgument as exc:
            p.error(str(exc))
    elif engine.speculative.enabled:
        p.error("--spec-method needs --engine vllm (the simulator does not speculate)")
    if "core-drain-s" not in given:  # the engine core drains as long as the worker does
        engine = dataclasses.replace(engine, core_drain_s=math.ceil(config.drain_grace_s))
    if config.kvmanager:
        # The engine's connector calls the kvmanager with the worker's certificate.
        tls = {"tls": config.tls.to_extra()} if config.tls.enabled else {}
        transfer = kv_transfer_config(config.kvmanager, store="kvmanager", **tls)
        engine = dataclasses.replace(engine, kv_transfer_config=transfer)
    return dataclasses.replace(config, engine=engine)


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

    from kvmesh.kv.events import BlockHash
    from kvmesh.kv.hashing import HashConfig, block_hashes, salt_keys

    from .sim.engine import SimEngineConfig, SimulatedEngine
    from .sim.model import SimWorkerConfig

    e = config.engine
    cfg = SimEngineConfig(
        worker=SimWorkerConfig(
            capacity_blocks=config.sim_capacity_blocks,
            block_size=e.block_size,
            max_running=config.sim_max_running,
            priority_scheduling=e.scheduling_policy == "priority",
            long_prefill_tokens=e.long_prefill_token_threshold,
        ),
        speedup=config.sim_speedup,
        model=e.served_model_name or "simulated",
        max_model_len=e.max_model_len,
    )
    hash_cfg = HashConfig(block_size=e.block_size, seed=e.hash_seed)

    def salted(token_ids: Sequence[int], cache_salt: str) -> list[BlockHash]:
        return block_hashes(token_ids, hash_cfg, keys=salt_keys(cache_salt))

    def one() -> SimulatedEngine:
        return SimulatedEngine(
            cfg, hasher=partial(block_hashes, cfg=hash_cfg), salted_hasher=salted
        )

    if e.data_parallel_size > 1:  # ranks: each a simulated engine (cache, clock) of its own
        from .sim.ranks import RankedSimEngine

        return RankedSimEngine([one() for _ in range(e.data_parallel_size)])
    return one()


async def start_engine(config: WorkerConfig) -> Engine:
    """The worker's engine, started: the simulator, or vLLM (imported only then: seconds).
    Bad certificate files fail the start first, before the engine loads."""
    config.tls.load()
    config.etcd_security.load()
    if config.engine_kind == "simulated":
        return simulated_engine(config)  # type: ignore[no-any-return]
    from .engine import VllmEngine

    return await VllmEngine.start(config.engine)


async def serve(config: WorkerConfig) -> None:
    from kvmesh.service import signal_event, start_or_stop

    from .server import start_worker
    from .traced import TracedEngine

    stop = signal_event()  # a signal during the engine's start: stop once it is up
    engine = await start_engine(config)
    try:  # a signal while it waits for etcd stops it there
        worker = await start_or_stop(start_worker(config, TracedEngine(engine)), stop)
    except BaseException:
        await engine.close()
        raise
    if worker is None:
        log.info("worker stopped before it was registered")
        await engine.close()
        return
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
