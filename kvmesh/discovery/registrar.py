"""Publish one key in etcd for as long as this process lives: a lease with a TTL, the key bound to
it, and a background keepalive.

If the process dies, the keepalive stops and etcd deletes the key after the TTL; every watcher
sees the delete. If etcd is unreachable for a while, the keepalive retries with backoff and never
gives up; if the lease was lost meanwhile (it expired, or etcd came back without it), a new lease
is granted and the current value put again.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Sequence
from types import TracebackType

import aetcd

from kvmesh.discovery.client import (
    RETRYABLE,
    Backoff,
    EtcdUnavailable,
    RotatingClient,
    describe_error,
    stop_task,
)
from kvmesh.discovery.security import EtcdCredentials

log = logging.getLogger(__name__)


class Registrar:
    """Keeps ``key = value`` in etcd, bound to a lease of ``ttl_s`` seconds, until ``close()``."""

    def __init__(
        self,
        endpoints: Sequence[str],
        key: str,
        value: str,
        ttl_s: float = 10.0,
        op_timeout_s: float = 5.0,
        credentials: EtcdCredentials | None = None,
    ) -> None:
        if ttl_s < 1:
            raise ValueError(f"ttl_s must be >= 1 (etcd leases are whole seconds), got {ttl_s}")
        if not key:
            raise ValueError("key must not be empty")
        self._conn = RotatingClient(endpoints, op_timeout_s, credentials)
        self._key = key
        self._value = value
        self._lease_ttl = math.ceil(ttl_s)  # what etcd is asked for: whole seconds
        self._interval_s = ttl_s / 3  # keepalive period
        self._lease_id: int | None = None
        self._dirty = False  # the value in etcd may differ from self._value
        self._connected = False
        self._lock = asyncio.Lock()  # one etcd exchange at a time (keepalive, update, close)
        self._task: asyncio.Task[None] | None = None

    @property
    def key(self) -> str:
        return self._key

    @property
    def value(self) -> str:
        """The value this registrar keeps in etcd (written again after any outage)."""
        return self._value

    @property
    def lease_id(self) -> int | None:
        return self._lease_id

    @property
    def connected(self) -> bool:
        """Whether the last exchange with etcd (keepalive, update) succeeded."""
        return self._connected

    async def start(self) -> None:
        """Grant the lease, put the key and start the keepalive.

        Raises EtcdUnavailable if etcd does not answer within ``op_timeout_s``.
        """
        if self._task is not None:
            raise RuntimeError("Registrar already started")
        try:
            await self._conn.call_within(self._register, f"register {self._key}")
        except BaseException:
            await self._conn.close()
            raise
        self._connected = True
        self._task = asyncio.create_task(self._keepalive_loop(), name=f"etcd-keepalive {self._key}")
        log.info(
            "registered %s at %s (lease %x, TTL %s s)",
            self._key,
            self._conn.endpoint,
            self._lease_id,
            self._lease_ttl,
        )

    async def update(self, value: str) -> None:
        """Put a new value (e.g. state serving -> draining) under the same lease.

        Raises EtcdUnavailable if etcd does not answer; the new value is kept and written by the
        keepalive once etcd is back.
        """
        if self._task is None:
            raise RuntimeError("Registrar.update() before start()")
        self._value = value
        self._dirty = True
        async with self._lock:
            try:
                await self._conn.call(self._put_current)
            except RETRYABLE as exc:
                self._connected = False
                raise EtcdUnavailable(
                    f"could not update {self._key} at {self._conn.endpoint}: "
                    f"{describe_error(exc)}; it will be written when etcd is back"
                ) from exc

    async def close(self, revoke: bool = True) -> None:
        """Stop the keepalive; with ``revoke`` the key disappears at once, else after the TTL."""
        await stop_task(self._task)
        self._task = None
        lease_id, self._lease_id = self._lease_id, None
        if revoke and lease_id is not None:
            try:
                async with self._lock:
                    await self._conn.call(lambda client: client.revoke_lease(lease_id))
                log.info("revoked lease %x of %s", lease_id, self._key)
            except RETRYABLE as exc:
                log.warning(
                    "could not revoke lease %x of %s at %s (%s); the key expires within %s s",
                    lease_id,
                    self._key,
                    self._conn.endpoint,
                    describe_error(exc),
                    self._lease_ttl,
                )
        self._connected = False
        await self._conn.close()

    async def __aenter__(self) -> Registrar:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    # -- etcd exchanges (called with the lock held, or before the keepalive exists) -------------

    async def _register(self, client: aetcd.Client) -> None:
        lease = await client.lease(self._lease_ttl)
        self._lease_id = lease.id
        self._dirty = True
        await self._put_current(client)

    async def _put_current(self, client: aetcd.Client) -> None:
        if self._lease_id is None:
            await self._register(client)
            return
        value = self._value
        try:
            await client.put(self._key.encode(), value.encode(), lease=self._lease_id)
        except aetcd.ClientError as exc:
            if "lease not found" not in str(exc):
                raise
            log.warning("lease %x of %s is gone; granting a new one", self._lease_id, self._key)
            self._lease_id = None
            await self._register(client)
            return
        if value == self._value:  # else update() changed it meanwhile: stay dirty
            self._dirty = False

    async def _refresh(self, client: aetcd.Client) -> None:
        if self._lease_id is None:
            await self._register(client)
            return
        reply = await client.refresh_lease(self._lease_id)
        if reply is None or reply.TTL <= 0:
            log.warning(
                "lease %x of %s is gone (expired while etcd was unreachable, or etcd lost it); "
                "granting a new one and putting the key again",
                self._lease_id,
                self._key,
            )
            self._lease_id = None
            await self._register(client)
        elif self._dirty:
            await self._put_current(client)

    async def _keepalive_loop(self) -> None:
        backoff = Backoff(initial_s=min(0.1, self._interval_s), maximum_s=self._interval_s)
        # One refresh must not outlast the TTL it is protecting.
        attempt_timeout_s = min(self._conn.op_timeout_s, max(self._interval_s, 0.5))
        while True:
            await asyncio.sleep(self._interval_s if self._connected else backoff.next())
            try:
                async with self._lock:
                    await self._conn.call(self._refresh, timeout_s=attempt_timeout_s)
            except Exception as exc:  # never let the keepalive die: log and retry
                if not isinstance(exc, RETRYABLE):
                    log.exception("unexpected error in the etcd keepalive of %s", self._key)
                elif self._connected:
                    log.warning(
                        "etcd keepalive of %s failed at %s: %s; retrying with backoff",
                        self._key,
                        self._conn.endpoint,
                        describe_error(exc),
                    )
                else:
                    log.debug("etcd keepalive of %s: %s", self._key, describe_error(exc))
                self._connected = False
                async with self._lock:
                    await self._conn.rotate()
                continue
            if not self._connected:
                log.info(
                    "etcd keepalive of %s recovered at %s (lease %x)",
                    self._key,
                    self._conn.endpoint,
                    self._lease_id,
                )
            self._connected = True
            backoff.reset()
