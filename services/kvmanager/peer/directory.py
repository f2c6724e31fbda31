"""Finds peers: kvmanager id -> gRPC address from etcd, and one gRPC channel per peer."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import grpc

from kvmesh.discovery.etcd import PrefixWatcher
from kvmesh.discovery.keys import (
    KvManagerRecord,
    kvmanager_from_entry,
    kvmanager_id_from_key,
    kvmanager_records,
    kvmanagers_prefix,
)
from kvmesh.discovery.security import EtcdCredentials
from kvmesh.errors import InvalidArgument
from kvmesh.tls import Tls, open_channel

from ..core.errors import PeerNotFound
from .core import PeerRef


class PeerDirectory:
    """Finds peers: kvmanager id -> gRPC address from etcd (a ``PrefixWatcher`` on the
    kvmanagers prefix), and one cached gRPC channel per peer address."""

    def __init__(
        self,
        self_id: str,
        endpoints: Sequence[str],
        cluster: str,
        interceptors: Sequence[grpc.aio.ClientInterceptor] = (),
        tls: Tls | None = None,
        etcd: EtcdCredentials | None = None,
    ) -> None:
        self._self_id = self_id
        self._etcd = etcd
        self._tls = tls  # peers' channels: mutual TLS with this kvmanager's certificate
        self._interceptors = list(interceptors)
        self._endpoints = list(endpoints)
        self._cluster = cluster
        self._prefix = kvmanagers_prefix(cluster)
        self._records: dict[str, KvManagerRecord] = {}
        self._watcher: PrefixWatcher | None = None
        self._channels: dict[str, grpc.aio.Channel] = {}

    async def start(self) -> None:
        if not self._endpoints:
            return
        self._watcher = PrefixWatcher(
            self._endpoints,
            self._prefix,
            self._on_snapshot,
            self._on_put,
            self._on_delete,
            credentials=self._etcd,
        )
        await self._watcher.start()

    async def close(self) -> None:
        if self._watcher is not None:
            await self._watcher.close()
        channels, self._channels = list(self._channels.values()), {}
        await asyncio.gather(*(ch.close() for ch in channels), return_exceptions=True)

    def resolve(self, peer: PeerRef) -> str:
        """The peer's gRPC address; PeerNotFound for an id etcd does not know."""
        if peer.address:
            return peer.address
        if not peer.kvmanager_id:
            raise InvalidArgument("name the peer: set peer_kvmanager_id or peer_address")
        if self._watcher is None:
            raise PeerNotFound(
                f"kvmanager {peer.kvmanager_id!r}: this kvmanager runs without etcd; name the"
                " peer by address"
            )
        rec = self._records.get(peer.kvmanager_id)
        if rec is None:
            raise PeerNotFound(
                f"kvmanager {peer.kvmanager_id!r} is not registered in etcd under {self._prefix}"
            )
        return rec.address

    def channel(self, address: str) -> grpc.aio.Channel:
        ch = self._channels.get(address)
        if ch is None:
            ch = open_channel(address, self._tls, interceptors=self._interceptors)
            self._channels[address] = ch
        return ch

    def _on_snapshot(self, snapshot: dict[str, str]) -> None:
        self._records = {r.kvmanager_id: r for r in kvmanager_records(self._cluster, snapshot)}

    def _on_put(self, key: str, value: str) -> None:
        rec = kvmanager_from_entry(self._cluster, key, value)  # None: malformed (logged)
        if rec is not None:
            self._records[rec.kvmanager_id] = rec

    def _on_delete(self, key: str) -> None:
        kid = kvmanager_id_from_key(self._cluster, key)
        if kid is not None:
            self._records.pop(kid, None)
