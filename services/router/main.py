"""The router process: ``kvmesh router`` (or ``python -m services.router.main``)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import socket
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from kvmesh import __version__, errors
from kvmesh.discovery.etcd import PrefixWatcher
from kvmesh.discovery.keys import RouterRecord, kvmanagers_prefix, router_key, workers_prefix
from kvmesh.metrics import MetricsServer
from kvmesh.service import Bind, ServiceHost, run, signal_event
from kvmesh.telemetry import Exporter, setup_logging, setup_tracing
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
    kv_sync: KvEventSync
    tier_sync: TierSync  # the kvmanagers' tier event streams (node stores in the index)
    kvmanager_watcher: PrefixWatcher
    index: KvIndex
    metrics: RouterMetrics
    metrics_server: MetricsServer | None
    http: OpenAIServer | None  # the OpenAI-compatible front door; None: off
    _host: ServiceHost
    _config: RouterConfig

    async def stop(self) -> None:
        """Health NOT_SERVING -> refuse new work -> leave etcd -> let streams finish (bounded)
        -> the rest, in reverse order of start (kvmesh/service.py)."""
        await self._host.stop()


async def start_router(config: RouterConfig) -> RunningRouter:
    """Starts a router on this loop; a step that fails undoes the ones before it."""
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
    host = ServiceHost(
        (SERVICE_NAME,),
        Bind(
            config.host,
            config.port,
            config.advertise_host,
            config.max_request_bytes,
            config.max_request_bytes,
        ),
        config.drain_grace_s,
    )
    router_pb2_grpc.add_RouterServicer_to_server(servicer, host.server)
    host.on_draining.append(lambda: setattr(servicer, "draining", True))
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
    kvmanager_watcher = PrefixWatcher(
        list(config.etcd_endpoints),
        kvmanagers_prefix(config.cluster),
        on_snapshot=tier_sync.on_snapshot,
        on_put=tier_sync.on_put,
        on_delete=tier_sync.on_delete,
    )
    http = None
    async with host.starting():
        host.callback(executor.shutdown, False, cancel_futures=True)
        host.callback(pool.close)
        host.callback(kv_sync.close)
        host.callback(tier_sync.close)
        port = await host.start_server()
        await watcher.start()
        host.callback(watcher.close)
        await kvmanager_watcher.start()
        host.callback(kvmanager_watcher.close)
        # Tokenizers of the models already served load before we report SERVING, so the first
        # request's time to first token is not spent importing transformers.
        if starting:
            await asyncio.wait([asyncio.wrap_future(f) for f in starting], timeout=60.0)
        ready.set()
        starting.clear()
        router_id = config.router_id or f"{socket.gethostname()}-{port}"
        record = RouterRecord(router_id=router_id, address=host.address, version=__version__)
        await host.register(
            config.etcd_endpoints,
            router_key(config.cluster, router_id),
            record.to_json(),
            config.etcd_ttl_s,
        )
        host.serve_metrics(metrics.registry, config.metrics_host, config.metrics_port)

        def refresh() -> None:
            metrics.refresh_kv(kv_sync.stats(), index)
            metrics.refresh_tiers(tier_sync.stats(), index)
            if (etcd := host.etcd_state()) is not None:
                metrics.etcd.refresh(*etcd)

        host.refresh_every(config.metrics_refresh_s, refresh)
        if config.http_port >= 0:
            http = _front_door(config, servicer, workers, metrics)
            await http.start()
            host.callback(http.close)
    log.info("router %s serving on %s with %d workers known", router_id, host.address, len(workers))
    return RunningRouter(
        address=host.address,
        servicer=servicer,
        workers=workers,
        watcher=watcher,
        kv_sync=kv_sync,
        tier_sync=tier_sync,
        kvmanager_watcher=kvmanager_watcher,
        index=index,
        metrics=metrics,
        metrics_server=host.metrics_server,
        http=http,
        _host=host,
        _config=config,
    )


def _front_door(
    config: RouterConfig, servicer: RouterServicer, workers: WorkerSet, metrics: RouterMetrics
) -> OpenAIServer:
    """The OpenAI-compatible HTTP API, calling this router's servicer in-process (no loopback
    gRPC hop)."""
    return OpenAIServer(
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
    await signal_event().wait()
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
    return run(serve(config), "router")


if __name__ == "__main__":
    sys.exit(main())
