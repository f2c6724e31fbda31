"""The router process: ``kvmesh router`` (or ``python -m services.router.main``)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import socket
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from kvmesh import __version__, errors
from kvmesh.discovery.etcd import PrefixWatcher, Registrar
from kvmesh.discovery.hosts import advertised_host
from kvmesh.discovery.keys import RouterRecord, kvmanagers_prefix, router_key, workers_prefix
from kvmesh.metrics import MetricsServer, serve_metrics
from kvmesh.telemetry import Exporter, server_interceptors, setup_logging, setup_tracing
from kvmesh.v1 import router_pb2, router_pb2_grpc

from .config import RouterConfig
from .core.disagg import DisaggConfig, DisaggHandler
from .core.index import KvIndex
from .core.index_types import IndexConfig
from .core.peers import PeerHintConfig, PeerHints
from .core.placement import Placement, PlacementConfig
from .core.routing import POLICIES, make_policy
from .core.workers import Change, WorkerSet
from .hashing import PromptHasher
from .http import OpenAIServer
from .http.backend import InProcessRouterBackend
from .http.cors import CorsPolicy, parse_list
from .kvsync import KvEventSync
from .metrics import RouterMetrics
from .pool import WorkerPool
from .prompt import PromptBuilder
from .servicer import RouterServicer
from .tiersync import TierSync
from .tokenizer import Tokenizers

log = logging.getLogger(__name__)
READY_LINE = "KVMESH_ROUTER_READY"
SERVICE_NAME = router_pb2.DESCRIPTOR.services_by_name["Router"].full_name


@dataclass
class RunningRouter:
    """A started router: what tests and ``kvmesh up`` need to reach and stop it."""

    address: str
    servicer: RouterServicer
    workers: WorkerSet
    watcher: PrefixWatcher
    _server: grpc.aio.Server
    _health: health.aio.HealthServicer
    _pool: WorkerPool
    kv_sync: KvEventSync
    tier_sync: TierSync  # the kvmanagers' tier event streams (node stores in the index)
    kvmanager_watcher: PrefixWatcher
    index: KvIndex
    _registrar: Registrar
    _executor: ThreadPoolExecutor
    _config: RouterConfig
    metrics: RouterMetrics
    metrics_server: MetricsServer | None
    _metrics_task: asyncio.Task[None]
    http: OpenAIServer | None  # the OpenAI-compatible front door; None: off

    async def stop(self) -> None:
        """Health NOT_SERVING -> refuse new work -> let streams finish (bounded) -> leave etcd."""
        await self._health.enter_graceful_shutdown()
        self.servicer.draining = True
        await self._registrar.close(revoke=True)
        await self._server.stop(grace=self._config.drain_grace_s)
        if self.http is not None:
            await self.http.close()
        await self.watcher.close()
        await self.kvmanager_watcher.close()
        await self.kv_sync.close()
        await self.tier_sync.close()
        await self._pool.close()
        self._metrics_task.cancel()
        await asyncio.gather(self._metrics_task, return_exceptions=True)
        if self.metrics_server is not None:
            await asyncio.to_thread(self.metrics_server.close)
        self._executor.shutdown(wait=False, cancel_futures=True)


async def start_router(config: RouterConfig) -> RunningRouter:
    workers = WorkerSet(config.cluster)
    pool = WorkerPool(workers, load_interval_s=config.load_interval_s)
    executor = ThreadPoolExecutor(config.tokenizer_threads, thread_name_prefix="tokenize")
    tokenizers = Tokenizers(executor, config.tokenizer_overrides)
    hasher = PromptHasher(config.hash_algo, config.hash_seed)
    index = KvIndex(IndexConfig(max_blocks=config.index_max_blocks))
    kv_sync = KvEventSync(
        on_batch=lambda batch: index.apply(batch).needs_resync,
        on_lost=index.mark_degraded,
        on_live=index.mark_live,
    )
    tier_sync = TierSync(config.cluster, index, lambda: (v.record for v in workers.all()))
    policy = make_policy(config.policy, index=index)
    metrics = RouterMetrics()
    peers = PeerHints(index, PeerHintConfig(config.peer_hints, config.peer_hint_min_blocks))
    disagg = DisaggHandler(
        config.disagg, policy, can_hand_off=lambda wid: index.linked(wid) is not None
    )
    servicer = RouterServicer(
        config,
        workers,
        pool,
        policy,
        PromptBuilder(tokenizers, hasher, executor, config.inline_prompt_tokens),
        metrics,
        peers,
        disagg,
        index.linked,
    )
    server = grpc.aio.server(
        interceptors=server_interceptors(),
        options=[
            ("grpc.max_receive_message_length", config.max_request_bytes),
            ("grpc.max_send_message_length", config.max_request_bytes),
        ],
    )
    router_pb2_grpc.add_RouterServicer_to_server(servicer, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server
    )
    port = server.add_insecure_port(f"{config.host}:{config.port}")
    address = f"{advertised_host(config.host, config.advertise_host)}:{port}"
    await server.start()

    ready = asyncio.Event()
    starting: list[Future[None]] = []  # tokenizer loads to wait for before SERVING

    def on_change(change: Change) -> None:
        pool.apply(change)
        kv_sync.apply(change)
        for wid in change.removed:
            index.drop_worker(wid)
        tier_sync.refresh()  # a worker's node or layout may have changed
        for rec in change.added:
            loading = tokenizers.preload(rec.model, rec.model_path)
            if not ready.is_set():
                starting.append(loading)

    watcher = PrefixWatcher(
        list(config.etcd_endpoints),
        workers_prefix(config.cluster),
        on_snapshot=lambda items: on_change(workers.apply_snapshot(items)),
        on_put=lambda k, v: on_change(workers.apply_put(k, v)),
        on_delete=lambda k: on_change(workers.apply_delete(k)),
    )
    await watcher.start()
    kvmanager_watcher = PrefixWatcher(
        list(config.etcd_endpoints),
        kvmanagers_prefix(config.cluster),
        on_snapshot=tier_sync.on_snapshot,
        on_put=tier_sync.on_put,
        on_delete=tier_sync.on_delete,
    )
    await kvmanager_watcher.start()
    # Tokenizers of the models already served load before we report SERVING, so the first
    # request's time to first token is not spent importing transformers.
    if starting:
        await asyncio.wait([asyncio.wrap_future(f) for f in starting], timeout=60.0)
    ready.set()
    starting.clear()
    router_id = config.router_id or f"{socket.gethostname()}-{port}"
    registrar = Registrar(
        list(config.etcd_endpoints),
        router_key(config.cluster, router_id),
        RouterRecord(router_id=router_id, address=address, version=__version__).to_json(),
        ttl_s=config.etcd_ttl_s,
    )
    await registrar.start()
    metrics_server = None
    if config.metrics_port >= 0:
        metrics_server = serve_metrics(metrics.registry, config.metrics_host, config.metrics_port)
    metrics_task = asyncio.get_running_loop().create_task(
        _refresh_metrics(metrics, kv_sync, tier_sync, index, registrar, config.metrics_refresh_s),
        name="metrics",
    )
    http = None
    if config.http_port >= 0:
        # The front door calls this router's servicer in-process (no loopback gRPC hop).
        http = OpenAIServer(
            "",
            config.http_host,
            config.http_port,
            api_keys=config.api_keys or None,
            max_body_bytes=config.http_max_body_bytes,
            request_timeout_s=config.default_timeout_s,
            metrics=metrics,
            backend=InProcessRouterBackend(servicer),
            reuse_port=config.reuse_port,
            cors=config.cors,
            metrics_registry=metrics.registry,  # the metrics port's registry, on the HTTP port
            ready=lambda: not servicer.draining,
            vllm_versions=lambda: (
                v.record.vllm_version for v in workers.all() if v.serving and v.record.vllm_version
            ),
        )
        await http.start()
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    log.info("router %s serving on %s with %d workers known", router_id, address, len(workers))
    return RunningRouter(
        address=address,
        servicer=servicer,
        workers=workers,
        watcher=watcher,
        _server=server,
        _health=health_servicer,
        _pool=pool,
        kv_sync=kv_sync,
        tier_sync=tier_sync,
        kvmanager_watcher=kvmanager_watcher,
        index=index,
        _registrar=registrar,
        _executor=executor,
        _config=config,
        metrics=metrics,
        metrics_server=metrics_server,
        _metrics_task=metrics_task,
        http=http,
    )


async def _refresh_metrics(
    metrics: RouterMetrics,
    kv_sync: KvEventSync,
    tier_sync: TierSync,
    index: KvIndex,
    registrar: Registrar,
    every_s: float,
) -> None:
    while True:
        metrics.refresh_kv(kv_sync.stats(), index)
        metrics.refresh_tiers(tier_sync.stats(), index)
        metrics.etcd.refresh(registrar.connected, registrar.lease_id is not None)
        await asyncio.sleep(every_s)


def parse_args(argv: list[str] | None) -> RouterConfig:
    d = RouterConfig()
    p = argparse.ArgumentParser(prog="kvmesh router", description="Run a kvmesh router.")
    p.add_argument("--host", default=d.host, help="address to listen on (default %(default)s)")
    p.add_argument("--port", type=int, default=d.port, help="gRPC port; 0 = OS picks")
    p.add_argument(
        "--advertise-host", default=d.advertise_host, help="host others reach this router at"
    )
    p.add_argument("--router-id", default=d.router_id, help="id in etcd (default host-port)")
    p.add_argument("--cluster", default=d.cluster, help="etcd cluster name (default %(default)s)")
    p.add_argument(
        "--etcd", default=",".join(d.etcd_endpoints), help="etcd endpoints, host:port,..."
    )
    p.add_argument(
        "--policy",
        default=d.policy,
        help=f"scheduler profile: one of {', '.join(sorted(POLICIES))}, or a profile YAML file "
        "(default %(default)s)",
    )
    p.add_argument(
        "--index-max-blocks",
        type=int,
        default=d.index_max_blocks,
        help="KV index bound in distinct blocks, ~80 B each (default %(default)s)",
    )
    p.add_argument(
        "--no-peer-hints",
        dest="peer_hints",
        action="store_false",
        help="never name another node's kvmanager for a worker to fetch a prefix from",
    )
    p.add_argument(
        "--peer-hint-min-blocks",
        type=int,
        default=d.peer_hint_min_blocks,
        help="name a peer kvmanager only when it holds at least this many more prompt blocks "
        "than the chosen worker (default %(default)s)",
    )
    p.add_argument(
        "--no-disagg",
        dest="disagg",
        action="store_false",
        help="never split a request into a prefill and a decode worker (prefill workers idle)",
    )
    p.add_argument(
        "--disagg-threshold-tokens",
        type=int,
        default=d.disagg.threshold_tokens,
        help="disaggregate when the decode worker would prefill at least this many prompt "
        "tokens itself (default %(default)s)",
    )
    p.add_argument(
        "--disagg-prefill-timeout-s",
        type=float,
        default=d.disagg.prefill_timeout_s,
        help="deadline of the prefill call; then the decode worker recomputes (default "
        "%(default)s)",
    )
    p.add_argument(
        "--disagg-placement",
        default=d.disagg.placement.mode.value,
        choices=[m.value for m in Placement],
        help="independent: the profile picks prefill and decode workers apart (default);"
        " joint: the pair of least estimated cost, keeping hand-offs on one node when cheap",
    )
    p.add_argument(
        "--disagg-network-gbps",
        type=float,
        default=d.disagg.placement.network_gbps,
        help="joint placement: hand-off bandwidth between nodes, 1e9 B/s (default %(default)s)",
    )
    p.add_argument(
        "--disagg-kv-bytes-per-token",
        type=int,
        default=d.disagg.placement.kv_bytes_per_token,
        help="joint placement: KV bytes of one token of the model (default %(default)s:"
        " Llama-3-8B bf16)",
    )
    p.add_argument(
        "--no-disagg-overlap",
        dest="disagg_overlap",
        action="store_false",
        help="send the decode request only after the prefill finished (default: with it, the "
        "decode worker fetching the blocks as the prefill saves them)",
    )
    p.add_argument(
        "--hash-algo", default=d.hash_algo, help="block hash algorithm, as the workers' vLLM"
    )
    p.add_argument(
        "--hash-seed",
        default=d.hash_seed,
        help="root-hash seed, the workers' PYTHONHASHSEED (default: unset, vLLM's fixed seed)",
    )
    p.add_argument(
        "--tokenizer",
        action="append",
        default=[],
        metavar="MODEL=PATH",
        help="tokenizer directory for a model (default: the path its workers advertise)",
    )
    p.add_argument("--default-timeout-s", type=float, default=d.default_timeout_s)
    p.add_argument(
        "--first-token-timeout-s",
        type=float,
        default=d.first_token_timeout_s,
        help="give a worker up (retry elsewhere) when it sends no token for this long "
        "(default %(default)s)",
    )
    p.add_argument(
        "--max-resumes",
        type=int,
        default=d.max_resumes,
        help="times one request is resumed on another worker after its worker failed "
        "mid-stream; 0 = never, fail (docs/failover.md; default %(default)s)",
    )
    p.add_argument(
        "--processes",
        type=int,
        default=d.processes,
        help="router processes on this host sharing the gRPC and HTTP ports (SO_REUSEPORT), "
        "each a whole router with its own KV index (default %(default)s)",
    )
    p.add_argument("--reuse-port", action="store_true", help=argparse.SUPPRESS)
    p.add_argument(
        "--no-worker-mux",
        dest="worker_mux",
        action="store_false",
        help="one Worker.Generate call per request instead of one Worker.GenerateMany stream "
        "per worker with outputs batched per engine step (for comparison)",
    )
    p.add_argument("--max-request-bytes", type=int, default=d.max_request_bytes)
    p.add_argument("--drain-grace-s", type=float, default=d.drain_grace_s)
    p.add_argument(
        "--http-host", default=d.http_host, help="address of the OpenAI-compatible HTTP API"
    )
    p.add_argument(
        "--http-port",
        type=int,
        default=d.http_port,
        help="OpenAI-compatible HTTP port (/v1/chat/completions ...); 0 = OS picks, -1 = off",
    )
    p.add_argument(
        "--api-key",
        action="append",
        default=[],
        help="accepted API key for the HTTP API (repeatable; default: any key or none)",
    )
    p.add_argument("--http-max-body-bytes", type=int, default=d.http_max_body_bytes)
    p.add_argument(
        "--allowed-origins",
        default="",
        help="CORS origins allowed to call the HTTP API: a JSON list as vLLM takes it "
        "('[\"https://app.example\"]') or comma-separated; '*' allows any (default: none, "
        "no CORS headers)",
    )
    p.add_argument(
        "--allowed-methods",
        default='["*"]',
        help="CORS methods allowed, JSON list or comma-separated (default: all)",
    )
    p.add_argument(
        "--allowed-headers",
        default='["*"]',
        help="CORS request headers allowed, JSON list or comma-separated (default: all)",
    )
    p.add_argument(
        "--allow-credentials",
        action="store_true",
        help="CORS: allow credentials (cookies, Authorization) from the allowed origins",
    )
    p.add_argument("--metrics-host", default=d.metrics_host, help="address of /metrics")
    p.add_argument(
        "--metrics-port",
        type=int,
        default=d.metrics_port,
        help="Prometheus /metrics port; 0 = OS picks (printed at start), -1 = off",
    )
    p.add_argument(
        "--trace-exporter", default=d.trace_exporter.value, choices=[e.value for e in Exporter]
    )
    p.add_argument("--otlp-endpoint", default=d.otlp_endpoint)
    p.add_argument("--log-level", default=d.log_level)
    a = p.parse_args(argv)
    if a.peer_hint_min_blocks < 1:
        p.error(f"--peer-hint-min-blocks is {a.peer_hint_min_blocks}; use 1 or more")
    if not a.first_token_timeout_s > 0:
        p.error(f"--first-token-timeout-s is {a.first_token_timeout_s}; use > 0 seconds")
    if a.max_resumes < 0:
        p.error(f"--max-resumes is {a.max_resumes}; use 0 or more")
    if a.processes < 1:
        p.error(f"--processes is {a.processes}; use 1 or more")
    try:
        placement = PlacementConfig(
            mode=Placement(a.disagg_placement),
            network_gbps=a.disagg_network_gbps,
            kv_bytes_per_token=a.disagg_kv_bytes_per_token,
        )
        disagg = DisaggConfig(
            a.disagg,
            a.disagg_threshold_tokens,
            a.disagg_prefill_timeout_s,
            a.disagg_overlap,
            placement,
        )
    except errors.InvalidArgument as exc:
        p.error(str(exc))
    try:
        cors = CorsPolicy(
            allowed_origins=parse_list("--allowed-origins", a.allowed_origins),
            allowed_methods=parse_list("--allowed-methods", a.allowed_methods),
            allowed_headers=parse_list("--allowed-headers", a.allowed_headers),
            allow_credentials=a.allow_credentials,
        )
    except errors.InvalidArgument as exc:
        p.error(str(exc))
    overrides = {}
    for item in a.tokenizer:
        model, sep, path = item.partition("=")
        if not sep or not model or not path:
            p.error(f"--tokenizer wants MODEL=PATH, got {item!r}")
        overrides[model] = path
    return RouterConfig(
        host=a.host,
        port=a.port,
        advertise_host=a.advertise_host,
        router_id=a.router_id,
        cluster=a.cluster,
        etcd_endpoints=tuple(e.strip() for e in a.etcd.split(",") if e.strip()),
        policy=a.policy,
        index_max_blocks=a.index_max_blocks,
        peer_hints=a.peer_hints,
        peer_hint_min_blocks=a.peer_hint_min_blocks,
        disagg=disagg,
        hash_algo=a.hash_algo,
        hash_seed=a.hash_seed,
        tokenizer_overrides=overrides,
        default_timeout_s=a.default_timeout_s,
        first_token_timeout_s=a.first_token_timeout_s,
        max_resumes=a.max_resumes,
        worker_mux=a.worker_mux,
        processes=a.processes,
        reuse_port=a.reuse_port,
        max_request_bytes=a.max_request_bytes,
        drain_grace_s=a.drain_grace_s,
        http_host=a.http_host,
        http_port=a.http_port,
        api_keys=tuple(a.api_key),
        http_max_body_bytes=a.http_max_body_bytes,
        cors=cors,
        metrics_host=a.metrics_host,
        metrics_port=a.metrics_port,
        trace_exporter=Exporter(a.trace_exporter),
        otlp_endpoint=a.otlp_endpoint,
        log_level=a.log_level,
    )


async def serve(config: RouterConfig) -> None:
    router = await start_router(config)
    metrics = f" metrics={router.metrics_server.url}" if router.metrics_server else ""
    http = f" http={router.http.base_url}" if router.http is not None else ""
    print(f"{READY_LINE} address={router.address}{metrics}{http}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("router stopping: draining %d in-flight requests", router.servicer.in_flight)
    await router.stop()


def main(argv: list[str] | None = None) -> int:
    config = parse_args(argv)
    setup_logging("router", config.log_level)
    if config.processes > 1:
        from .procs import run_processes

        return run_processes(
            sys.argv[1:] if argv is None else argv,
            config.processes,
            config.host,
            config.port,
            config.http_host,
            config.http_port,
            config.router_id,
            metrics=config.metrics_port >= 0,
        )
    setup_tracing("kvmesh-router", config.trace_exporter, config.otlp_endpoint)
    asyncio.run(serve(config))
    return 0


if __name__ == "__main__":
    sys.exit(main())
