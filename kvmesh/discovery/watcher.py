"""Follow every key under a prefix: one snapshot, then puts and deletes in revision order.

``start()`` lists the prefix and delivers the snapshot, then a background task watches from the
snapshot's revision + 1. When the watch breaks (etcd down, restarting, unreachable), the callbacks
simply stop: the consumer keeps its last state. The task reconnects with backoff and watches again
from the last revision seen + 1, so nothing is missed; if etcd has compacted that revision away,
it lists the prefix again and delivers a fresh snapshot, which replaces the consumer's state.

Callbacks run on the event loop, one at a time, in revision order. They must be quick and must
not block; an exception in one is logged and the watch goes on.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from types import TracebackType

import aetcd

from kvmesh.discovery.client import RETRYABLE, Backoff, RotatingClient, describe_error, stop_task
from kvmesh.discovery.security import EtcdCredentials

log = logging.getLogger(__name__)

SnapshotCallback = Callable[[dict[str, str]], None]
PutCallback = Callable[[str, str], None]
DeleteCallback = Callable[[str], None]


class PrefixWatcher:
    """Delivers the keys under ``prefix`` to three callbacks and keeps doing so across outages."""

    def __init__(
        self,
        endpoints: Sequence[str],
        prefix: str,
        on_snapshot: SnapshotCallback,
        on_put: PutCallback,
        on_delete: DeleteCallback,
        op_timeout_s: float = 5.0,
        credentials: EtcdCredentials | None = None,
    ) -> None:
        if not prefix:
            raise ValueError("prefix must not be empty (it would watch the whole of etcd)")
        self._conn = RotatingClient(endpoints, op_timeout_s, credentials)
        self._prefix = prefix
        self._on_snapshot = on_snapshot
        self._on_put = on_put
        self._on_delete = on_delete
        self._last_revision = 0
        self._connected = False
        self._snapshots = 0
        self._task: asyncio.Task[None] | None = None

    @property
    def prefix(self) -> str:
        return self._prefix

    @property
    def connected(self) -> bool:
        """Whether etcd answers: True after start(), False from a broken watch until the watch
        is re-created."""
        return self._connected

    @property
    def last_revision(self) -> int:
        """The etcd revision the delivered state reflects (snapshot or last event)."""
        return self._last_revision

    @property
    def snapshots(self) -> int:
        """How many snapshots were delivered: 1 after start(), +1 per re-list after compaction."""
        return self._snapshots

    async def start(self) -> None:
        """List the prefix, deliver the snapshot and start watching.

        Raises EtcdUnavailable if etcd does not answer within ``op_timeout_s``.
        """
        if self._task is not None:
            raise RuntimeError("PrefixWatcher already started")
        try:
            await self._conn.call_within(self._resync, f"list {self._prefix}")
        except BaseException:
            await self._conn.close()
            raise
        self._connected = True
        self._task = asyncio.create_task(self._watch_loop(), name=f"etcd-watch {self._prefix}")

    async def close(self) -> None:
        await stop_task(self._task)
        self._task = None
        self._connected = False
        await self._conn.close()

    async def __aenter__(self) -> PrefixWatcher:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    # -- internals -------------------------------------------------------------------------------

    async def _resync(self, client: aetcd.Client) -> None:
        listing = await client.get_prefix(self._prefix.encode())
        snapshot = {_text(kv.key): _text(kv.value) for kv in listing}
        self._last_revision = listing.header.revision
        self._snapshots += 1
        log.debug(
            "snapshot of %s: %s keys at revision %s",
            self._prefix,
            len(snapshot),
            self._last_revision,
        )
        self._deliver(self._on_snapshot, snapshot)

    async def _watch_loop(self) -> None:
        backoff = Backoff(initial_s=0.1, maximum_s=1.0)
        need_snapshot = False
        while True:
            try:
                if need_snapshot:
                    await self._conn.call(self._resync)
                    need_snapshot = False
                watch = await self._conn.call(
                    lambda client: client.watch_prefix(
                        self._prefix.encode(), start_revision=self._last_revision + 1
                    )
                )
                if not self._connected:
                    log.info(
                        "watching %s again at %s from revision %s",
                        self._prefix,
                        self._conn.endpoint,
                        self._last_revision + 1,
                    )
                self._connected = True
                backoff.reset()
                async for event in watch:
                    self._apply(event)
                # aetcd ends the iteration without an error only when the stream is shut down.
                raise aetcd.ConnectionFailedError("watch stream closed")
            except aetcd.RevisionCompactedError as exc:
                log.warning(
                    "watch of %s: revision %s was compacted (etcd keeps revisions >= %s); "
                    "listing the prefix again",
                    self._prefix,
                    self._last_revision + 1,
                    exc.compacted_revision,
                )
                need_snapshot = True
            except Exception as exc:  # never let the watch die: log, reconnect, resume
                if isinstance(exc, aetcd.WatchTimeoutError):
                    # aetcd cannot report a compaction in the watch-created reply (it then times
                    # out instead): a fresh snapshot is always correct, so take one.
                    need_snapshot = True
                if not isinstance(exc, RETRYABLE):
                    log.exception("unexpected error in the etcd watch of %s", self._prefix)
                elif self._connected:
                    log.warning(
                        "etcd watch of %s at %s broke: %s; keeping the last state and "
                        "reconnecting from revision %s",
                        self._prefix,
                        self._conn.endpoint,
                        describe_error(exc),
                        self._last_revision + 1,
                    )
                else:
                    log.debug("etcd watch of %s: %s", self._prefix, describe_error(exc))
                self._connected = False
                await self._conn.rotate()
                await asyncio.sleep(backoff.next())

    def _apply(self, event: aetcd.Event) -> None:
        key = _text(event.kv.key)
        if event.kind == aetcd.EventKind.PUT:
            self._deliver(self._on_put, key, _text(event.kv.value))
        else:
            self._deliver(self._on_delete, key)
        # A delete's kv carries the deletion's revision as mod_revision.
        self._last_revision = max(self._last_revision, event.kv.mod_revision)

    def _deliver(self, callback: Callable[..., None], *args: object) -> None:
        try:
            callback(*args)
        except Exception:
            log.exception("watch callback %r of %s failed", callback, self._prefix)


def _text(raw: bytes) -> str:
    return raw.decode("utf-8", errors="replace")
