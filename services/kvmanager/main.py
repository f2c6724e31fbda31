"""``kvmesh kvmanager``: the node's KV cache manager daemon.

Opens the tiered store (the disk tier rebuilds its index from its directory), starts the bulk
data plane peers fetch blocks from, serves kvmesh.v1.KvManager + health + reflection, registers
in etcd under ``/kvmesh/<cluster>/kvmanagers/<id>`` (with its data plane address), watches the
other kvmanagers there (to find peers by id), prints ``KVMESH_KVMANAGER_READY kvmanager_id=...
address=host:port data_plane=host:port`` and runs until SIGTERM/SIGINT; then it drains in order
(health NOT_SERVING, refuse new calls, leave etcd, let calls and peer streams in flight finish
within the grace, stop the server and the data plane, close the store). See docs/kvmanager.md.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, replace

from kvmesh import __version__
from kvmesh.discovery.hosts import advertised_host, node_name
from kvmesh.discovery.keys import KvManagerRecord, check_name, kvmanager_key
from kvmesh.kv.events import Tier
from kvmesh.kv_wire import TIER_PB
from kvmesh.metrics import MetricsServer
from kvmesh.service import Bind, ServiceHost, run, signal_event, start_or_stop
from kvmesh.settings import add_config_flags, load_config
from kvmesh.telemetry import client_interceptors, setup_logging, setup_tracing
from kvmesh.tls import Tls
from kvmesh.v1 import kvmanager_pb2, kvmanager_pb2_grpc

from .config import KvManagerConfig, PeerConfig
from .core.config import DataPlaneSecurity
from .core.rates import moved
from .metrics import KvManagerMetrics
from .peer import (
    BlockSource,
    DataPlaneConfig,
    DataPlaneServer,
    PeerDirectory,
    PeerService,
    StoreBlockSource,
)
from .servicer import KvManagerServicer, LayoutHubs
from .shm import ShmRegistry
from .store import TieredStore

log = logging.getLogger(__name__)

READY_LINE = "KVMESH_KVMANAGER_READY"
ENV = "KVMESH_KVMANAGER_"  # environment variables: KVMESH_KVMANAGER_<FLAG>
SERVICE_NAME = kvmanager_pb2.DESCRIPTOR.services_by_name["KvManager"].full_name


@dataclass
class RunningKvManager:
    kvmanager_id: str
    address: str
    node: str
    data_plane_address: str  # empty: the data plane is off
    store: TieredStore
    hubs: LayoutHubs
    servicer: KvManagerServicer
    metrics: KvManagerMetrics
    metrics_server: MetricsServer | None
    peers: PeerService
    data_plane: DataPlaneServer | None
    shm: ShmRegistry
    _host: ServiceHost

    def ready_line(self) -> str:
        metrics = f" metrics={self.metrics_server.url}" if self.metrics_server else ""
        data_plane = f" data_plane={self.data_plane_address}" if self.data_plane_address else ""
        return (
            f"{READY_LINE} kvmanager_id={self.kvmanager_id} address={self.address}"
            f" node={self.node}{data_plane}{metrics}"
        )

    async def stop(self) -> None:
        """Health NOT_SERVING -> refuse new calls -> leave etcd -> end the event and shared
        memory streams -> calls, peer fetches and peer streams in flight get the grace -> the
        rest in reverse order of start (kvmesh/service.py)."""
        await self._host.stop()
        log.info("kvmanager %s stopped", self.kvmanager_id)


def _data_plane_config(peer: PeerConfig, host: str, tls: Tls | None) -> DataPlaneConfig:
    with_tls = peer.data_plane_security is not DataPlaneSecurity.PLAIN
    return DataPlaneConfig(
        host=peer.data_plane_host or host,
        port=peer.data_plane_port,
        max_streams=peer.max_streams,
        stall_timeout_s=peer.stall_timeout_s,
        ssl_context=tls.server_ssl_context() if tls is not None and with_tls else None,
        tls_auth_only=peer.data_plane_security is DataPlaneSecurity.AUTH,
    )


async def start_kvmanager(
    config: KvManagerConfig,
    *,
    wrap_source: Callable[[BlockSource], BlockSource] | None = None,
) -> RunningKvManager:
    """Starts a kvmanager on this loop; a step that fails undoes the ones before it.
    ``wrap_source`` wraps the block source the data plane serves from (tracing, or a test's
    injected faults)."""
    node = config.node or node_name()
    kvmanager_id = check_name("kvmanager id", config.kvmanager_id or node)
    check_name("cluster", config.cluster)
    tls = config.tls.load()  # bad certificate files fail the start before anything runs
    etcd = config.etcd_security.load()
    epoch = uuid.uuid4().hex
    hubs = LayoutHubs(kvmanager_id, epoch, config.event_buffer_batches, config.event_queue_batches)
    bind = Bind(
        config.host,
        config.port,
        config.advertise_host,
        config.max_message_bytes,
        config.max_message_bytes,
    )
    host = ServiceHost(
        (SERVICE_NAME,), bind, config.drain_grace_s, config.etcd_retry_max_s, tls=tls
    )
    data_plane: DataPlaneServer | None = None
    data_plane_address = ""
    metrics = KvManagerMetrics()
    async with host.starting():
        store = await TieredStore.open(
            config.store, on_events=hubs.publish, retention=config.retention
        )
        host.callback(store.close)
        if config.peer.data_plane_port >= 0:
            source: BlockSource = StoreBlockSource(store)
            if wrap_source is not None:
                source = wrap_source(source)
            data_plane = DataPlaneServer(source, _data_plane_config(config.peer, config.host, tls))

        def info() -> kvmanager_pb2.KvManagerInfo:
            return _info(store, kvmanager_id, node, epoch, data_plane_address)

        host.bind_port()  # the address peers are told to call back at
        directory = PeerDirectory(
            kvmanager_id,
            config.etcd_endpoints,
            config.cluster,
            client_interceptors(),
            tls=tls,
            etcd=etcd,
        )
        host.callback(directory.close)
        peers = PeerService(
            kvmanager_id, host.address, store, data_plane, directory, config.peer, tls
        )
        host.callback(peers.close)
        shm = ShmRegistry(config.shm)
        host.callback(shm.close)  # again after the grace: attaches that arrived meanwhile
        servicer = KvManagerServicer(
            store, hubs, info, config.max_message_bytes, peers, config.peer.fetch_timeout_s, shm
        )
        kvmanager_pb2_grpc.add_KvManagerServicer_to_server(servicer, host.server)
        host.on_draining.append(lambda: setattr(servicer, "draining", True))
        # The event and AttachShm streams end before the grace, so it is not spent on them
        # (AttachShm clients send bytes inline from then on).
        host.before_server_stop += [hubs.close, shm.close]
        if data_plane is not None:
            dp = data_plane
            await dp.start()
            # During the grace, new data plane connections are refused, streams in flight end.
            host.in_grace.append(lambda grace_s: dp.close(grace_s=grace_s))
            host.callback(dp.close)
            data_plane_address = _advertised(config, dp.config.host, dp.port)
            peers.data_plane_address = data_plane_address
        await host.start_server()
        host.serve_metrics(metrics.registry, config.metrics_host, config.metrics_port)
        if config.etcd_endpoints:
            record = KvManagerRecord(
                kvmanager_id=kvmanager_id,
                address=host.address,
                node=node,
                data_plane_address=data_plane_address,
                version=__version__,
            )
            await host.register(
                config.etcd_endpoints,
                kvmanager_key(config.cluster, kvmanager_id),
                record.to_json(),
                config.etcd_ttl_s,
                etcd,
            )
        await host.until_etcd(directory.start)
        publisher = _RatesPublisher(host, record) if config.etcd_endpoints else None

        def refresh() -> None:
            store.expire_sessions(time.monotonic())
            metrics.refresh(store, peers)
            if (etcd := host.etcd_state()) is not None:  # none without etcd
                metrics.etcd.refresh(*etcd)
            if publisher is not None:
                publisher.refresh(servicer.rates.snapshot(), servicer.rates.peer_snapshot())

        host.refresh_every(config.metrics_refresh_s, refresh)
    log.info(
        "kvmanager %s for node %s serving on %s (data plane %s, shared memory %s): cpu %d bytes,"
        " disk %s",
        kvmanager_id,
        node,
        host.address,
        data_plane_address or "off",
        config.shm.dir or "off",
        config.store.cpu_bytes,
        f"{config.store.disk_bytes} bytes in {config.store.disk_dir}"
        if config.store.has_disk
        else "off",
    )
    return RunningKvManager(
        kvmanager_id=kvmanager_id,
        address=host.address,
        node=node,
        data_plane_address=data_plane_address,
        store=store,
        hubs=hubs,
        servicer=servicer,
        metrics=metrics,
        metrics_server=host.metrics_server,
        peers=peers,
        data_plane=data_plane,
        shm=shm,
        _host=host,
    )


class _RatesPublisher:
    """Puts the measured transfer rates (per tier, and per peer link) on the kvmanager's etcd
    record when they moved (``rates.moved``), one update at a time, so routers price fetches
    with them."""

    def __init__(self, host: ServiceHost, record: KvManagerRecord) -> None:
        self._host = host
        self._record = record
        self._task: asyncio.Task[None] | None = None
        host.callback(self._cancel)

    def refresh(
        self, rates: dict[str, dict[str, float]], peer_rates: dict[str, dict[str, float]]
    ) -> None:
        """``rates``: layout -> kind -> s/token; ``peer_rates``: peer -> layout -> s/token."""
        registrar = self._host.registrar
        if registrar is None or (self._task is not None and not self._task.done()):
            return
        rec = self._record
        if not moved(rec.transfer_s_per_token, rates) and not moved(
            rec.peer_s_per_token, peer_rates
        ):
            return
        self._record = replace(rec, transfer_s_per_token=rates, peer_s_per_token=peer_rates)
        self._task = asyncio.get_running_loop().create_task(
            self._put(registrar.update, self._record.to_json()), name="publish-rates"
        )

    @staticmethod
    async def _put(update: Callable[[str], Awaitable[None]], value: str) -> None:
        try:
            await update(value)
        except Exception as exc:  # etcd down: the registrar writes it once etcd is back
            log.info("transfer rates not published yet: %s", exc)

    async def _cancel(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)


def _advertised(config: KvManagerConfig, bind_host: str, port: int) -> str:
    return f"{advertised_host(bind_host, config.advertise_host)}:{port}"


def _info(
    store: TieredStore, kvmanager_id: str, node: str, epoch: str, data_plane_address: str
) -> kvmanager_pb2.KvManagerInfo:
    """GetInfo's answer: who this is and how full its tiers are."""
    tiers = []
    for tier in (Tier.CPU, Tier.DISK):
        u = store.usage(tier)
        tiers.append(
            kvmanager_pb2.TierUsage(
                tier=TIER_PB[tier],
                capacity_bytes=u.budget_bytes,
                used_bytes=u.used_bytes,
                blocks=u.blocks,
            )
        )
    return kvmanager_pb2.KvManagerInfo(
        kvmanager_id=kvmanager_id,
        node=node,
        tiers=tiers,
        epoch=epoch,
        version=__version__,
        data_plane_address=data_plane_address,
    )


def parse_args(argv: list[str] | None, environ: Mapping[str, str] | None = None) -> KvManagerConfig:
    """The kvmanager's config: defaults < ``--config`` file < ``KVMESH_KVMANAGER_*`` < flags."""
    p = argparse.ArgumentParser(
        prog="kvmesh kvmanager",
        description="Run a node's KV cache manager (CPU and disk KV tiers under the engines).",
    )
    opts = add_config_flags(p, KvManagerConfig)
    env = os.environ if environ is None else environ
    config, _ = load_config(p, KvManagerConfig, p.parse_args(argv), opts, env, ENV)
    return config


async def serve(config: KvManagerConfig) -> None:
    stop = signal_event()  # a signal while it waits for etcd stops it there
    running = await start_or_stop(start_kvmanager(config), stop)
    if running is None:
        log.info("kvmanager stopped before it was registered")
        return
    print(running.ready_line(), flush=True)
    await stop.wait()
    log.info("signal received: stopping kvmanager %s", running.kvmanager_id)
    await running.stop()


def main(argv: list[str] | None = None) -> int:
    config = parse_args(argv)
    setup_logging("kvmanager", config.log_level)
    setup_tracing("kvmesh-kvmanager", config.trace_exporter, config.otlp_endpoint)
    return run(serve(config), "kvmanager")


if __name__ == "__main__":
    sys.exit(main())
