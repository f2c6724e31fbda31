"""The aetcd connection shared by the registrar and the watcher: endpoint parsing, one client at a
time rotating over the endpoints, a deadline on every call, and backoff for retry loops.

aetcd's ``Client`` speaks to one ``host:port``; several endpoints of one cluster are used in turn:
after a failure the current client is closed and the next endpoint gets a fresh client (a fresh
gRPC channel, so no reconnect backoff is inherited from the dead connection).
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import aetcd
import grpc
from aetcd import rpc as etcd_rpc
from aetcd import watcher as etcd_watcher
from aetcd.client import _handle_errors

from kvmesh.discovery.endpoints import Endpoint, parse_endpoint, parse_endpoints
from kvmesh.discovery.security import EtcdCredentials
from kvmesh.errors import Unavailable
from kvmesh.tls import Tls

__all__ = [
    "RETRYABLE",
    "Backoff",
    "Endpoint",
    "EtcdUnavailable",
    "RotatingClient",
    "describe_error",
    "parse_endpoint",
    "parse_endpoints",
    "stop_task",
]

log = logging.getLogger(__name__)

T = TypeVar("T")

# What a retry loop survives: etcd down or restarting (UNAVAILABLE, "no leader"), deadlines, and
# the connection dropping mid-stream. aetcd wraps gRPC errors into ClientError subclasses.
RETRYABLE: tuple[type[BaseException], ...] = (
    aetcd.ClientError,
    grpc.RpcError,
    TimeoutError,
    OSError,
)

# gRPC channel options: reconnect quickly after an etcd restart, and notice a silent peer (a
# half-open connection) by keepalive pings (etcd refuses pings more often than every 5 s). A local
# subchannel pool: otherwise a fresh channel shares the process-wide subchannel of the dead one and
# fails at once with its cached "connection refused" until gRPC's own reconnect backoff expires.
_CHANNEL_OPTIONS = {
    "grpc.use_local_subchannel_pool": 1,
    "grpc.initial_reconnect_backoff_ms": 100,
    "grpc.min_reconnect_backoff_ms": 100,
    "grpc.max_reconnect_backoff_ms": 2000,
    "grpc.keepalive_time_ms": 10_000,
    "grpc.keepalive_timeout_ms": 5_000,
    "grpc.http2.max_pings_without_data": 0,  # else pings stop after 2 on an idle watch stream
    "grpc.http2.ping_timeout_ms": 5_000,
    # A prefix listing arrives in one message: allow more than gRPC's default 4 MiB.
    "grpc.max_receive_message_length": 64 * 1024 * 1024,
}


class EtcdUnavailable(Unavailable):
    """etcd did not answer in time (down, restarting, unreachable, or no leader)."""


class Backoff:
    """Exponential backoff with +-20% jitter: initial, initial*2, ... up to maximum."""

    def __init__(self, initial_s: float = 0.1, maximum_s: float = 2.0) -> None:
        self.initial_s = initial_s
        self.maximum_s = max(maximum_s, initial_s)
        self._next = initial_s

    def next(self) -> float:
        delay = self._next
        self._next = min(self._next * 2, self.maximum_s)
        return delay * random.uniform(0.8, 1.2)

    def reset(self) -> None:
        self._next = self.initial_s


class RotatingClient:
    """One aetcd client at a time, on one of the endpoints; ``rotate()`` moves to the next.
    ``credentials``: TLS and an etcd user (``security.EtcdSecurity.load``); None: plaintext,
    no user. A client is made afresh after any failure, so an expired auth token is replaced
    by the next one's ``Authenticate``."""

    def __init__(
        self,
        endpoints: Sequence[str],
        op_timeout_s: float,
        credentials: EtcdCredentials | None = None,
    ) -> None:
        if op_timeout_s <= 0:
            raise ValueError(f"op_timeout_s must be > 0, got {op_timeout_s}")
        self.endpoints = parse_endpoints(endpoints)
        self.op_timeout_s = op_timeout_s
        self.credentials = credentials
        self._index = 0
        self._client: aetcd.Client | None = None

    @property
    def endpoint(self) -> Endpoint:
        return self.endpoints[self._index]

    def client(self) -> aetcd.Client:
        """The current client, created on first use (aetcd connects lazily, without I/O)."""
        if self._client is None:
            ep, cred = self.endpoint, self.credentials
            user = {"username": cred.user, "password": cred.password} if cred and cred.user else {}
            if cred is not None and cred.tls is not None:
                self._client = _TlsClient(
                    cred.tls,
                    host=ep.host,
                    port=ep.port,
                    timeout=self.op_timeout_s,
                    options=_CHANNEL_OPTIONS,
                    **user,
                )
            else:
                self._client = aetcd.Client(
                    host=ep.host,
                    port=ep.port,
                    timeout=self.op_timeout_s,
                    options=_CHANNEL_OPTIONS,
                    **user,
                )
        return self._client

    async def call(
        self, fn: Callable[[aetcd.Client], Awaitable[T]], timeout_s: float | None = None
    ) -> T:
        """One attempt on the current endpoint, bounded end to end by ``timeout_s`` (default
        ``op_timeout_s``)."""
        async with asyncio.timeout(self.op_timeout_s if timeout_s is None else timeout_s):
            return await fn(self.client())

    async def call_within(self, fn: Callable[[aetcd.Client], Awaitable[T]], what: str) -> T:
        """Retry ``fn`` over the endpoints with backoff until ``op_timeout_s`` has passed.

        Raises EtcdUnavailable naming the endpoints and the last error. Used by ``start()`` so a
        service started a moment before etcd still comes up, and one with a wrong address fails
        within a bounded time.
        """
        deadline = time.monotonic() + self.op_timeout_s
        backoff = Backoff(0.05, 0.5)
        last: BaseException | None = None
        while True:
            remaining = deadline - time.monotonic()
            try:
                async with asyncio.timeout(max(remaining, 0.01)):
                    return await fn(self.client())
            except RETRYABLE as exc:
                # An attempt cut short by the deadline says less than the error before it
                # (authentication failed, certificate refused): keep that one.
                if last is None or not isinstance(exc, TimeoutError):
                    last = exc
            if time.monotonic() + 0.05 >= deadline:
                break
            await self.rotate()
            await asyncio.sleep(min(backoff.next(), max(deadline - time.monotonic(), 0)))
        tried = ", ".join(str(ep) for ep in self.endpoints)
        raise EtcdUnavailable(
            f"etcd unreachable at {tried} for {self.op_timeout_s:g} s while trying to {what}: "
            f"{describe_error(last) if last else 'no attempt finished'}"
        ) from last

    async def rotate(self) -> None:
        """Drop the current client (it may be broken) and move to the next endpoint."""
        await self.close()
        self._index = (self._index + 1) % len(self.endpoints)

    async def close(self) -> None:
        client, self._client = self._client, None
        if client is None:
            return
        try:
            async with asyncio.timeout(self.op_timeout_s):
                await client.close()
        except Exception as exc:  # closing a broken client must not break the caller
            log.debug("closing etcd client for %s: %s", self.endpoint, describe_error(exc))


class _TlsClient(aetcd.Client):  # type: ignore[misc]
    """``aetcd.Client`` on a TLS channel: aetcd 1.0 opens only plaintext ones. ``connect`` is
    aetcd's own, with ``secure_channel`` (then, with a user, the same ``Authenticate`` call
    for the token every later call carries)."""

    def __init__(self, tls: Tls, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._tls = tls

    @_handle_errors  # gRPC errors -> aetcd's ClientError kinds, as aetcd's own connect
    async def connect(self) -> None:
        if self._connected.is_set():
            return
        if self._is_connecting:  # type: ignore[has-type]  # another task connects: wait
            await asyncio.wait_for(self._connected.wait(), self._connect_wait_timeout)
            return
        try:
            self._is_connecting = True
            target = f"{self._host}:{self._port}"
            options = [*self._options.items(), *self._tls.channel_options()]
            self.channel = grpc.aio.secure_channel(
                target, self._tls.channel_credentials(), options=options
            )
            if self._username is not None and self._password is not None:
                self.auth_stub = etcd_rpc.AuthStub(self.channel)
                resp = await self.auth_stub.Authenticate(
                    etcd_rpc.AuthenticateRequest(name=self._username, password=self._password),
                    timeout=self._timeout,
                )
                self.metadata = (("token", resp.token),)
            self.kvstub = etcd_rpc.KVStub(self.channel)
            self.clusterstub = etcd_rpc.ClusterStub(self.channel)
            self.leasestub = etcd_rpc.LeaseStub(self.channel)
            self.maintenancestub = etcd_rpc.MaintenanceStub(self.channel)
            self._watcher = etcd_watcher.Watcher(
                etcd_rpc.WatchStub(self.channel), timeout=self._timeout, metadata=self.metadata
            )
            self._connected.set()
        finally:
            self._is_connecting = False


def describe_error(exc: BaseException) -> str:
    """One line for logs and error messages: the exception's type and text."""
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


async def stop_task(task: asyncio.Task[None] | None) -> None:
    """Cancel a background task and wait for it; a cancellation of the caller still propagates."""
    if task is None:
        return
    if not task.done():
        task.cancel()
        await asyncio.wait([task])
    if not task.cancelled() and task.exception() is not None:
        log.error("background task %s failed", task.get_name(), exc_info=task.exception())
