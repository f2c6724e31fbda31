"""A router and a worker in one process: ``kvmesh node ROUTER_FLAGS -- WORKER_FLAGS`` (or
``python -m services.node.main ...``).

On one machine the router's hop to its worker is one more Python process on the path of every
token: the worker's front end sends a step's outputs as a ``GenerateMany`` message, the router
parses them, and both processes wake for it on cores the engine competes for
(docs/serving-cost.md). Here the worker (its engine, its gRPC server, its etcd record, exactly as
``kvmesh worker`` runs it) and the router share one event loop, and the router's data path to
this worker is a call of the worker's ``GenerateMany`` handler: the same messages, passed as
objects. Everything else is unchanged: the worker is registered and reachable like any other
(other routers, its load and KV event streams, ``kvmesh status``), the router routes to other
workers over gRPC, and each side keeps its own flags, ports and metrics.

The cost is isolation: the process going down takes both, so ``kvmesh up`` does this only for a
mesh of one worker (docs/architecture.md). It prints the worker's ready line, then the
router's, and on SIGTERM/SIGINT stops the router (its streams drain on the worker), then the
worker.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from kvmesh.discovery.keys import WorkerId

if TYPE_CHECKING:
    from kvmesh.v1 import worker_pb2
    from services.router.config import RouterConfig
    from services.router.mux import ServeStream
    from services.worker.config import WorkerConfig

log = logging.getLogger(__name__)
SEPARATOR = "--"
USAGE = "usage: kvmesh node ROUTER_FLAGS -- WORKER_FLAGS (see kvmesh router --help, kvmesh worker --help)"


def split_argv(argv: list[str]) -> tuple[list[str], list[str]]:
    """(router flags, worker flags), split at the first ``--``; ``-h`` / ``--help`` alone: this
    module's help, exit 0."""
    if argv in (["-h"], ["--help"]):
        print(f"{USAGE}\n\n{__doc__}")
        raise SystemExit(0)
    if SEPARATOR not in argv:
        raise SystemExit(
            f"kvmesh node: no '{SEPARATOR}' between the router's and the worker's flags\n{USAGE}"
        )
    i = argv.index(SEPARATOR)
    return argv[:i], argv[i + 1 :]


async def serve(rcfg: RouterConfig, wcfg: WorkerConfig) -> None:
    from kvmesh.service import signal_event, start_or_stop
    from services.router.main import start_router
    from services.worker.main import start_engine
    from services.worker.mux import StreamBatch, WorkerStreamServer
    from services.worker.server import start_worker
    from services.worker.traced import TracedEngine

    stop = signal_event()  # a signal during the engine's start: stop once it is up
    engine = await start_engine(wcfg)
    try:
        worker = await start_or_stop(start_worker(wcfg, TracedEngine(engine)), stop)
    except BaseException:
        await engine.close()
        raise
    if worker is None:
        await engine.close()
        return
    print(worker.ready_line(), flush=True)

    def serve_stream(
        requests: AsyncIterator[worker_pb2.WorkerStreamIn],
    ) -> AsyncIterator[worker_pb2.WorkerStreamOut]:
        return WorkerStreamServer(worker.servicer, StreamBatch).serve(requests)

    local: dict[WorkerId, ServeStream] = {WorkerId(worker.worker_id): serve_stream}
    try:
        router = await start_or_stop(start_router(rcfg, local_workers=local), stop)
    except BaseException:
        await worker.stop()
        raise
    if router is None:
        await worker.stop()
        return
    print(router.ready_line(), flush=True)
    asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, router.reload_keys)
    await stop.wait()
    log.info(
        "node stopping: the router (%d in flight), then worker %s",
        router.servicer.in_flight,
        worker.worker_id,
    )
    await router.stop()
    await worker.stop()


def main(argv: list[str] | None = None) -> int:
    router_argv, worker_argv = split_argv(sys.argv[1:] if argv is None else argv)
    from kvmesh.service import run
    from kvmesh.telemetry import setup_logging, setup_tracing
    from services.router.main import parse_args as router_config
    from services.worker.main import parse_args as worker_config
    from services.worker.main import prepare_environment

    rcfg, wcfg = router_config(router_argv), worker_config(worker_argv)  # bad flags: exit 2
    if rcfg.processes > 1:
        raise SystemExit("kvmesh node: --processes must be 1 (the worker is in the one process)")
    prepare_environment(wcfg.engine.hash_seed)  # before anything imports vLLM
    setup_logging("node", rcfg.log_level)
    setup_tracing("kvmesh-node", rcfg.trace_exporter, rcfg.otlp_endpoint)
    return run(serve(rcfg, wcfg), "node")


if __name__ == "__main__":
    sys.exit(main())
