"""Peer prefetch: the router named a peer kvmanager that holds more of a request's prefix than
this node's kvmanager (``plan.PeerSource``, from the request's ``kv_transfer_params``), so before
the request is scheduled the connector asks the LOCAL kvmanager to fetch the missing blocks from
that peer (``KvManager.FetchFromPeer``: the kvmanager resolves the peer in etcd and pulls the
blocks over the data plane into its CPU tier), then looks up again and loads what arrived.

**Prefill/decode hand-off.** A disaggregated request's hint names the kvmanager of the prefill
worker's node, which the prefill worker's connector saves to asynchronously (its saver thread):
the decode worker may ask before the blocks land. So a hint is read as "these blocks exist or
are about to": when it names this node's own kvmanager, the fetch waits until the local
kvmanager holds them (``Lookup`` every ``handoff_poll_s``); when it names a peer that grants
fewer than asked, the fetch asks again. Both for at most ``handoff_wait_s`` (within
``timeout_s``); then the request goes ahead with what arrived and recomputes the rest.

Runs in vLLM's engine-core process, on the scheduler side. The gRPC call runs on a small thread
pool of its own (with its own channel), never on the scheduler's thread: while a fetch is in
flight, ``pending`` waits at most ``poll_s`` for it and the connector answers "ask again later"
(``get_num_new_matched_tokens`` -> None), so the engine keeps stepping its other requests. A
request waits at most ``timeout_s`` for its fetch (or the hint's ``max_s``, when shorter: the
router's estimate of recomputing what the fetch brings, past which waiting is a loss); then it is
scheduled with whatever arrived (the kvmanager stores each verified block as it arrives). Anything that goes wrong (unknown
peer, peer down, deadline, no kvmanager) is a miss: the engine recomputes, nothing fails.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import asdict, dataclass, fields
from typing import Any

import grpc

from kvmesh.tls import Tls, open_blocking_channel
from kvmesh.v1 import kvmanager_pb2, kvmanager_pb2_grpc

from .client import StoreConfig
from .kvmanager_client import RECONNECT_OPTIONS, TraceMetadata, call_metadata, traced_calls
from .layout import parse_layout_key
from .plan import PeerSource

log = logging.getLogger(__name__)

FETCHED_KEY = "kvmesh-peer-fetched"  # FetchFromPeer's trailing metadata: blocks stored
# A Lookup while waiting for a same-node hand-off: a kvmanager that cannot answer one this fast
# is in trouble, and the request recomputes rather than wait out a long (overlapped) hand-off.
LOOKUP_TIMEOUT_S = 1.0
_WARN_EVERY_S = 30.0

CountFn = Callable[[str, int], None]


@dataclass(frozen=True, slots=True)
class PeerFetchConfig:
    """``kv_connector_extra_config["peer_fetch"]`` of ``KvmeshConnector``. Unknown keys are
    errors."""

    enabled: bool = True
    """Fetch a peer's blocks when a request carries the router's hint."""
    kvmanager: str = ""
    """host:port of the node's kvmanager that fetches; empty: the connector's store when it is
    the kvmanager (``store="kvmanager"``). No kvmanager: no prefetch."""
    timeout_s: float = 2.0
    """The longest a request waits for its peer fetch before it is scheduled with what arrived
    (also the FetchFromPeer deadline), seconds."""
    poll_s: float = 0.005
    """How long one scheduler pass waits for a fetch in flight before it moves on, seconds
    (bounds how often an otherwise idle engine re-asks)."""
    max_concurrent: int = 4
    """Fetches in flight at once; more wait for a thread, within their own timeout."""
    handoff_wait_s: float = 1.0
    """How long a fetch waits for hinted blocks that are not there yet (a prefill worker's saves
    still in flight), seconds; 0: never wait (bounded by ``timeout_s``)."""
    handoff_poll_s: float = 0.01
    """How often it looks again meanwhile, seconds."""

    def __post_init__(self) -> None:
        if not self.timeout_s > 0 or not self.poll_s >= 0:
            raise ValueError(
                f"peer_fetch timeout_s ({self.timeout_s}) must be > 0 and poll_s "
                f"({self.poll_s}) >= 0, in seconds"
            )
        if not self.handoff_wait_s >= 0 or not self.handoff_poll_s > 0:
            raise ValueError(
                f"peer_fetch handoff_wait_s ({self.handoff_wait_s}) must be >= 0 and "
                f"handoff_poll_s ({self.handoff_poll_s}) > 0, in seconds"
            )
        if self.max_concurrent < 1:
            raise ValueError(f"peer_fetch max_concurrent is {self.max_concurrent}; use 1 or more")

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any] | None) -> PeerFetchConfig:
        extra = dict(extra or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(extra) - known)
        if unknown:
            raise ValueError(
                f"unknown peer_fetch keys for KvmeshConnector: {unknown}; known: {sorted(known)}"
            )
        return cls(**extra)

    def address(self, store: StoreConfig) -> str:
        """The fetching kvmanager's host:port ("" : none)."""
        if self.kvmanager:
            return self.kvmanager
        return store.store_path if store.store == "kvmanager" else ""


@dataclass(frozen=True, slots=True)
class FetchOutcome:
    fetched: int  # blocks the local kvmanager stored from the peer (also on failure)
    error: str = ""  # "" : OK; else the gRPC status name (NOT_FOUND, UNAVAILABLE, ...)


FetchFn = Callable[[str, Sequence[int], PeerSource, float], FetchOutcome]
"""(connector layout key, block hashes, peer, timeout_s) -> outcome; must not raise."""


@dataclass(slots=True)
class _Fetch:
    future: Future[FetchOutcome] | None  # None: settled (a request fetches once)
    deadline: float
    fetched: int = 0  # blocks it stored, once settled (0 when it ran out of time)


class PeerPrefetcher:
    """Per request, at most one peer fetch, tracked from the scheduler's thread. ``fetch`` does
    the call on the pool's threads (default: ``KvManagerFetcher`` at ``address``); ``count``
    gets the connector's counters, always on the scheduler's thread."""

    def __init__(
        self,
        config: PeerFetchConfig,
        fetch: FetchFn,
        count: CountFn | None = None,
        clock: Callable[[], float] = time.monotonic,
        close: Callable[[], None] | None = None,
    ) -> None:
        self._cfg = config
        self._fetch = fetch
        self._count = count or (lambda _name, _n: None)
        self._clock = clock
        self._close = close
        self._pool = ThreadPoolExecutor(config.max_concurrent, thread_name_prefix="kvmesh-peer")
        self._fetches: dict[str, _Fetch] = {}

    def start(
        self,
        req_id: str,
        peer: PeerSource,
        layout_keys: Sequence[str],
        keys: Sequence[int],
        trace: TraceMetadata | None = None,
    ) -> bool:
        """Starts fetching ``keys`` from ``peer`` into the local kvmanager (every layout key: one
        per TP rank). False when the request fetched before or there is nothing to fetch.
        ``trace``: the request's trace context, sent with the fetch's calls."""
        if not keys or req_id in self._fetches:
            return False
        # A hint with its own wait (a prefill still running elsewhere) gets that long for the
        # blocks to land, plus the usual time for the last fetch; one whose fetch is not worth
        # waiting for past the router's estimate of recomputing it (max_s) gives up there.
        fetch_s = min(self._cfg.timeout_s, peer.max_s) if peer.max_s > 0 else self._cfg.timeout_s
        timeout = fetch_s + peer.wait_s
        deadline = self._clock() + timeout
        keys = list(keys)
        self._fetches[req_id] = _Fetch(
            self._pool.submit(self._run, list(layout_keys), keys, peer, deadline, trace), deadline
        )
        self._count("peer_fetches", 1)
        log.debug(
            "request %s: fetching %d blocks from kvmanager %s", req_id, len(keys), peer.kvmanager_id
        )
        return True

    def _run(
        self,
        layout_keys: list[str],
        keys: list[int],
        peer: PeerSource,
        deadline: float,
        trace: TraceMetadata | None,
    ) -> FetchOutcome:
        with traced_calls(trace):  # a pool thread: the scheduler's context does not reach it
            return self._run_traced(layout_keys, keys, peer, deadline)

    def _run_traced(
        self, layout_keys: list[str], keys: list[int], peer: PeerSource, deadline: float
    ) -> FetchOutcome:
        fetched: int | None = None
        error = ""
        for key in layout_keys:  # TP ranks: the request loads the least any rank holds
            left = deadline - self._clock()
            if left <= 0:
                return FetchOutcome(0, "DEADLINE_EXCEEDED")
            got = self._fetch(key, keys, peer, left)
            fetched = got.fetched if fetched is None else min(fetched, got.fetched)
            error = error or got.error
        return FetchOutcome(fetched or 0, error)

    def pending(self, req_id: str) -> bool:
        """True while the request's fetch is in flight and within its time, after waiting at
        most ``poll_s`` for it; settles it (counters, log) otherwise."""
        f = self._fetches.get(req_id)
        if f is None or f.future is None:
            return False
        left = f.deadline - self._clock()
        try:
            outcome = f.future.result(timeout=max(0.0, min(self._cfg.poll_s, left)))
        except FutureTimeout:
            if left > self._cfg.poll_s:
                return True
            f.future = None  # its time is up: schedule with what arrived; the call ends alone
            self._count("peer_fetch_timeouts", 1)
            log.info("request %s: peer fetch still running after its time; not waiting", req_id)
            return False
        except Exception:  # the fetch function must not raise; a last resort
            log.warning("peer fetch for request %s failed", req_id, exc_info=True)
            outcome = FetchOutcome(0, "INTERNAL")
        f.future = None
        f.fetched = outcome.fetched
        self._count("peer_fetch_blocks", outcome.fetched)
        if outcome.error:
            self._count("peer_fetch_failures", 1)
        log.debug("request %s: peer fetch %s", req_id, outcome)
        return False

    def fetched(self, req_id: str) -> int:
        """Blocks the request's settled fetch stored in the local kvmanager (0 while in flight,
        and for a fetch that outlived its time)."""
        f = self._fetches.get(req_id)
        return f.fetched if f is not None else 0

    def forget(self, req_id: str) -> None:
        """The request finished: drop its state (a fetch in flight ends on its own deadline)."""
        self._fetches.pop(req_id, None)

    def __len__(self) -> int:
        return len(self._fetches)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._fetches.clear()
        if self._close is not None:
            self._close()


class KvManagerFetcher:
    """``FetchFn`` over the node's kvmanager at ``address``: one synchronous gRPC channel of its
    own (thread-safe), a deadline on every call, and never an exception."""

    def __init__(
        self,
        address: str,
        handoff_wait_s: float = 0.0,
        handoff_poll_s: float = 0.01,
        clock: Callable[[], float] = time.monotonic,
        tls: Tls | None = None,
    ) -> None:
        self.address = address
        self._channel = open_blocking_channel(address, tls, options=RECONNECT_OPTIONS)
        self._stub = kvmanager_pb2_grpc.KvManagerStub(self._channel)
        self._layouts: dict[str, kvmanager_pb2.KvLayout] = {}
        self._lock = threading.Lock()
        self._last_warning = 0.0
        self._wait_s = handoff_wait_s
        self._poll_s = handoff_poll_s
        self._clock = clock
        self._own_id = ""  # this node's kvmanager id (GetInfo), once known

    def __call__(
        self, layout_key: str, keys: Sequence[int], peer: PeerSource, timeout_s: float
    ) -> FetchOutcome:
        """Fetches ``keys`` into the local kvmanager; waits up to ``handoff_wait_s`` for blocks
        not there yet (on the peer, or locally when the hint names this node's kvmanager)."""
        start = self._clock()
        end = start + timeout_s
        wait_end = min(end, start + (peer.wait_s or self._wait_s))
        fetched = 0
        try:
            layout = self._layout(layout_key)
            local = peer.kvmanager_id == self._local_id(timeout_s)
            metadata = call_metadata()
            while True:
                left = end - self._clock()
                if left <= 0:
                    return FetchOutcome(fetched, "DEADLINE_EXCEEDED")
                if local:  # the prefill worker shares this kvmanager: its saves land here
                    resp = self._stub.Lookup(  # fast when well: a hung kvmanager ends the wait
                        kvmanager_pb2.LookupRequest(layout=layout, block_hashes=keys),
                        timeout=min(left, LOOKUP_TIMEOUT_S),
                        metadata=metadata,
                    )
                    done = len(resp.tiers) >= len(keys)
                else:
                    got = self._stub.FetchFromPeer(
                        kvmanager_pb2.FetchFromPeerRequest(
                            layout=layout, block_hashes=keys, peer_kvmanager_id=peer.kvmanager_id
                        ),
                        timeout=left,
                        metadata=metadata,
                    )
                    fetched += got.fetched
                    done = got.fetched + got.already_held >= len(keys)
                if done or self._clock() + self._poll_s > wait_end:
                    return FetchOutcome(fetched)
                time.sleep(self._poll_s)
        except grpc.RpcError as exc:
            code = exc.code() if isinstance(exc, grpc.Call) else None
            name = code.name if code is not None else "UNKNOWN"
            self._warn(peer, name, exc)
            return FetchOutcome(fetched + _fetched(exc), name)
        except Exception:
            log.warning("peer fetch from kvmanager %s failed", peer.kvmanager_id, exc_info=True)
            return FetchOutcome(fetched, "INTERNAL")

    def _local_id(self, timeout_s: float) -> str:
        """This node's kvmanager id (asked once; "" while it cannot be asked)."""
        if not self._own_id:
            try:
                info = self._stub.GetInfo(
                    kvmanager_pb2.KvManagerInfoRequest(), timeout=min(timeout_s, 1.0)
                )
                self._own_id = info.kvmanager_id
            except grpc.RpcError:
                return ""
        return self._own_id

    def close(self) -> None:
        self._channel.close()

    def _layout(self, layout_key: str) -> kvmanager_pb2.KvLayout:
        pb = self._layouts.get(layout_key)
        if pb is None:
            pb = kvmanager_pb2.KvLayout(**asdict(parse_layout_key(layout_key)))
            with self._lock:
                self._layouts[layout_key] = pb
        return pb

    def _warn(self, peer: PeerSource, code: str, exc: grpc.RpcError) -> None:
        now = time.monotonic()
        if now - self._last_warning >= _WARN_EVERY_S:  # not a line per request
            self._last_warning = now
            details = exc.details() if isinstance(exc, grpc.Call) else str(exc)
            log.warning(
                "kvmanager %s could not fetch from peer %s (%s: %s); recomputing instead",
                self.address,
                peer.kvmanager_id,
                code,
                details,
            )


def _fetched(exc: grpc.RpcError) -> int:
    """Blocks stored before a failed FetchFromPeer ended (its trailing metadata)."""
    try:
        for key, value in (exc.trailing_metadata() or ()) if isinstance(exc, grpc.Call) else ():
            if key == FETCHED_KEY:
                return int(value)
    except (ValueError, TypeError):
        pass
    return 0


def make_prefetcher(
    config: PeerFetchConfig, store: StoreConfig, count: CountFn | None = None
) -> PeerPrefetcher | None:
    """The prefetcher ``config`` asks for, or None (off, or no kvmanager to fetch into)."""
    address = config.address(store)
    if not config.enabled or not address:
        return None
    fetcher = KvManagerFetcher(
        address, config.handoff_wait_s, config.handoff_poll_s, tls=store.client_tls()
    )
    return PeerPrefetcher(config, fetcher, count, close=fetcher.close)
