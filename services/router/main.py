"""The router process: ``kvmesh router`` (or ``python -m services.router.main``)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import socket
import sys
import time
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from kvmesh import __version__
from kvmesh.discovery.etcd import PrefixWatcher
from kvmesh.discovery.keys import (
    RouterRecord,
    WorkerId,
    kvmanagers_prefix,
    router_key,
    worker_from_entry,
    worker_id_from_key,
    worker_records,
    workers_prefix,
)
from kvmesh.metrics import MetricsServer
from kvmesh.service import Bind, ServiceHost, run, signal_event, start_or_stop
from kvmesh.settings import add_config_flags, load_config
from kvmesh.telemetry import setup_logging, setup_tracing
from kvmesh.tls import Tls
from kvmesh.v1 import router_pb2, router_pb2_grpc

from .auth import ApiKeys, KeySource
from .config import RouterConfig
from .core.auth import static_table
from .core.disagg import DisaggHandler
from .core.index import KvIndex
from .core.index_types import IndexConfig
from .core.node_stores import TierStream
from .core.peer_cost import PeerCost, PeerCostConfig
from .core.peers import PeerHintConfig, PeerHints
from .core.recent_prefills import RecentPrefills
from .core.routing import make_policy
from .core.workers import Change, WorkerSet
from .hashing import PromptHasher
from .http import OpenAIServer
from .http.backend import InProcessRouterBackend
from .keyfile import KeyFile
from .kvsync import KvEventSync
from .metrics import RouterMetrics
from .mux import ServeStream
from .pool import WorkerPool
from .prompt import PromptBuilder
from .retention import SessionRetention
from .servicer import RouterServicer
from .state import ResponseStore, open_store
from .tiersync import TierSync
from .tokenizer import Tokenizers

log = logging.getLogger(__name__)
READY_LINE = "KVMESH_ROUTER_READY"
ENV = "KVMESH_ROUTER_"  # environment variables: KVMESH_ROUTER_<FLAG>
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
    keys: KeyFile | None  # the API key file in force (--api-keys-file); None: none
    _host: ServiceHost
    _config: RouterConfig

    async def stop(self) -> None:
        """Health NOT_SERVING -> refuse new work -> leave etcd -> let streams finish (bounded)
        -> the rest, in reverse order of start (kvmesh/service.py)."""
        await self._host.stop()

    def ready_line(self) -> str:
        """``KVMESH_ROUTER_READY address=... [metrics=URL] [http=URL]`` (kvmesh/launcher.py)."""
        metrics = f" metrics={self.metrics_server.url}" if self.metrics_server else ""
        http = f" http={self.http.base_url}" if self.http is not None else ""
        return f"{READY_LINE} address={self.address}{metrics}{http}"

    def reload_keys(self) -> None:
        """Re-reads the API key file now (SIGHUP); no file: nothing to do."""
        if self.keys is not None:
            self.keys.reload()


async def start_router(
    config: RouterConfig, local_workers: Mapping[WorkerId, ServeStream] | None = None
) -> RunningRouter:
    """Starts a router on this loop; a step that fails undoes the ones before it.
    ``local_workers``: workers in this process (``services/node``), their data path a call."""
    began = time.monotonic()
    tls = config.tls.load()  # bad certificate files fail the start before anything runs
    etcd = config.etcd_security.load()
    workers = WorkerSet(linger_s=config.unregistered_linger_s)
    pool = WorkerPool(workers, load_interval_s=config.load_interval_s, tls=tls, local=local_workers)
    executor = ThreadPoolExecutor(config.tokenizer_threads, thread_name_prefix="tokenize")
    tokenizers = Tokenizers(executor, config.tokenizer_overrides)
    hasher = PromptHasher(config.hash_algo, config.hash_seed)
    index = KvIndex(IndexConfig(max_blocks=config.index_max_blocks))
    kv_sync = KvEventSync(
        on_batch=lambda batch: index.apply(batch).needs_resync,
        on_lost=index.mark_degraded,
        on_live=index.mark_live,
        tls=tls,
    )
    tier_sync = TierSync(config.cluster, index, lambda: (v.record for v in workers.all()), tls=tls)
    policy = make_policy(config.policy, index=index, transfer_rates=tier_sync.kvmanagers)
    metrics = RouterMetrics()
    peer_cost = PeerCost(
        tier_sync.kvmanagers,
        lambda wid: v.load if (v := workers.get(WorkerId(wid))) is not None else None,
        PeerCostConfig(
            enabled=config.peer_hint_cost,
            probe_interval_s=config.peer_hint_probe_s,
            budget_floor_s=config.peer_fetch_budget_floor_s,
        ),
    )
    peers = PeerHints(
        index,
        PeerHintConfig(
            config.peer_hints, config.peer_hint_min_blocks, config.peer_hint_sibling_wait_s
        ),
        peer_cost,
        lambda wid: v.record.block_size if (v := workers.get(wid)) is not None else 0,
        RecentPrefills(),
    )
    disagg = DisaggHandler(
        config.disagg, policy, can_hand_off=lambda wid: index.linked(wid) is not None
    )
    prompts = PromptBuilder(tokenizers, hasher, executor, config.inline_prompt_tokens)
    servicer = RouterServicer(
        config,
        workers,
        pool,
        policy,
        prompts,
        metrics,
        peers,
        disagg,
        index.linked,
    )
    if config.retention.enabled:

        def stream_of(wid: WorkerId) -> TierStream | None:
            sid = index.linked(wid)
            return tier_sync.plan.streams.get(sid) if sid is not None else None

        servicer.retention = SessionRetention(
            config.retention, prompts, stream_of, metrics.registry, tls
        )
    # The key file first: a bad one fails the start before anything listens.
    key_file, keys = await _api_keys(config)
    if keys is not None:
        servicer.use_keys(keys)  # flow control's per-tenant rate limits
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
        config.etcd_retry_max_s,
        interceptors=[ApiKeys(keys)] if keys is not None else (),
        tls=tls,
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

    def on_put(key: str, value: str) -> None:  # a malformed record: logged, skipped
        if (record := worker_from_entry(config.cluster, key, value)) is not None:
            on_change(workers.apply_put(record))

    def on_delete(key: str) -> None:
        if (worker_id := worker_id_from_key(config.cluster, key)) is not None:
            on_change(workers.apply_delete(worker_id))

    watcher = PrefixWatcher(
        list(config.etcd_endpoints),
        workers_prefix(config.cluster),
        on_snapshot=lambda items: on_change(
            workers.apply_snapshot(worker_records(config.cluster, items))
        ),
        on_put=on_put,
        on_delete=on_delete,
        credentials=etcd,
    )
    kvmanager_watcher = PrefixWatcher(
        list(config.etcd_endpoints),
        kvmanagers_prefix(config.cluster),
        on_snapshot=tier_sync.on_snapshot,
        on_put=tier_sync.on_put,
        on_delete=tier_sync.on_delete,
        credentials=etcd,
    )
    http = None
    async with host.starting():  # health NOT_SERVING, new requests refused, until the end
        servicer.not_ready = f"waiting for etcd at {', '.join(config.etcd_endpoints)}"
        if key_file is not None:
            host.callback(key_file.close)
        host.callback(executor.shutdown, False, cancel_futures=True)
        host.callback(pool.close)
        if servicer.admission is not None:  # its pump, and the shared rate limits' client
            host.callback(servicer.admission.close)
        host.callback(kv_sync.close)
        host.callback(tier_sync.close)
        if servicer.retention is not None:
            host.callback(servicer.retention.close)
        port = await host.start_server()
        host.serve_metrics(metrics.registry, config.metrics_host, config.metrics_port)

        def refresh() -> None:
            metrics.refresh_kv(kv_sync.stats(), index)
            metrics.refresh_tiers(tier_sync.stats(), index)
            if (etcd := host.etcd_state()) is not None:
                metrics.etcd.refresh(*etcd)

        host.refresh_every(config.metrics_refresh_s, refresh)
        host.refresh_every(1.0, lambda: on_change(workers.expire_unregistered()))
        if config.http_port >= 0:  # up early: its /health says why the router is not ready
            store = open_store(config.responses, config.cluster)  # opened on first use
            host.callback(store.close)
            http = _front_door(config, servicer, workers, metrics, keys, tls, store)
            await http.start()
            host.callback(http.close)
        await host.until_etcd(watcher.start)
        host.callback(watcher.close)
        await host.until_etcd(kvmanager_watcher.start)
        host.callback(kvmanager_watcher.close)
        known = [v.record.worker_id for v in workers.all()]  # later ones do not hold this up
        servicer.not_ready = f"syncing the KV index with {len(known)} worker(s)"
        # Tokenizers of the models already served load meanwhile, so the first request's time
        # to first token is not spent importing transformers.
        synced = asyncio.ensure_future(kv_sync.wait_live(known, config.ready_timeout_s))
        synced_s = 0.0  # seconds after start when the KV index was synced (or gave up)

        def synced_at(_: object) -> None:
            nonlocal synced_s
            synced_s = time.monotonic() - began

        synced.add_done_callback(synced_at)
        loading: list[asyncio.Future[Any]] = [asyncio.wrap_future(f) for f in starting]
        try:
            await asyncio.wait([synced, *loading], timeout=60.0)
            behind = await synced
        finally:  # a stop while waiting
            synced.cancel()
        ready.set()
        starting.clear()
        if behind:
            log.warning(
                "KV index not synced with %d of %d worker(s) after --ready-timeout-s %g (%s): "
                "serving anyway; their cached blocks count once their KV event streams are live",
                len(behind),
                len(known),
                config.ready_timeout_s,
                ", ".join(behind),
            )
        router_id = config.router_id or f"{socket.gethostname()}-{port}"
        record = RouterRecord(
            router_id=router_id,
            address=host.address,
            version=__version__,
            metrics_url=host.metrics_server.url if host.metrics_server is not None else "",
        )
        servicer.not_ready = "registering in etcd"
        await host.register(
            config.etcd_endpoints,
            router_key(config.cluster, router_id),
            record.to_json(),
            config.etcd_ttl_s,
            etcd,
        )
        servicer.not_ready = ""
    log.info(
        "router %s serving on %s with %d workers known (ready %.2f s after start; the KV index "
        "of %d worker(s)%s synced %.2f s after start; the rest: tokenizers, registration)",
        router_id,
        host.address,
        len(workers),
        time.monotonic() - began,
        len(known) - len(behind),
        f" ({len(behind)} not)" if behind else "",
        synced_s,
    )
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
        keys=key_file,
        _host=host,
        _config=config,
    )


async def _api_keys(config: RouterConfig) -> tuple[KeyFile | None, KeySource | None]:
    """The key file (polled for changes) and the table source the front doors check; (None,
    None): no keys, the mesh is open (docs/tenants.md)."""
    if config.api_keys_file is not None:
        key_file = await KeyFile.open(config.api_keys_file, config.api_keys_reload_s)
        return key_file, key_file.current
    if config.api_keys:
        table = static_table(config.api_keys)
        return None, lambda: table
    return None, None


def _front_door(
    config: RouterConfig,
    servicer: RouterServicer,
    workers: WorkerSet,
    metrics: RouterMetrics,
    keys: KeySource | None,
    tls: Tls | None,
    store: ResponseStore,
) -> OpenAIServer:
    """The OpenAI-compatible HTTP API, calling this router's servicer in-process (no loopback
    gRPC hop)."""
    return OpenAIServer(
        "",
        config.http_host,
        config.http_port,
        keys=keys,
        max_body_bytes=config.http_max_body_bytes,
        request_timeout_s=config.default_timeout_s,
        metrics=metrics,
        backend=InProcessRouterBackend(servicer),
        reuse_port=config.reuse_port,
        cors=config.cors,
        metrics_registry=metrics.registry,  # the metrics port's registry, on the HTTP port
        unready=lambda: _unready(servicer),
        vllm_versions=lambda: (
            v.record.vllm_version for v in workers.all() if v.serving and v.record.vllm_version
        ),
        ssl_context=tls.server_ssl_context() if tls is not None else None,
        responses_store=store,
    )


def _unready(servicer: RouterServicer) -> str:
    """Why the router cannot take requests now ("": it can), for the HTTP /health."""
    if servicer.draining:
        return "the router is shutting down"
    return f"the router is starting: {servicer.not_ready}" if servicer.not_ready else ""


def parse_args(argv: list[str] | None, environ: Mapping[str, str] | None = None) -> RouterConfig:
    """The router's config: defaults < ``--config`` file < ``KVMESH_ROUTER_*`` < flags."""
    p = argparse.ArgumentParser(prog="kvmesh router", description="Run a kvmesh router.")
    opts = add_config_flags(p, RouterConfig)
    config, _ = load_config(
        p, RouterConfig, p.parse_args(argv), opts, os.environ if environ is None else environ, ENV
    )
    return config


async def serve(config: RouterConfig) -> None:
    stop = signal_event()  # a signal while waiting for etcd or the index: stop there
    router = await start_or_stop(start_router(config), stop)
    if router is None:
        log.info("router stopped before it was ready")
        return
    print(router.ready_line(), flush=True)
    asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, router.reload_keys)
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
    return run(serve(config), "router")


if __name__ == "__main__":
    sys.exit(main())
