"""One service process's gRPC host, shared by the router, the worker and the kvmanager.

A ``ServiceHost`` owns what every service runs around its servicer: the ``grpc.aio`` server
(plaintext, or TLS / mutual TLS with a ``kvmesh.tls.Tls``; the tracing interceptor when tracing is on, and the error interceptor that maps domain errors
through ``kvmesh.grpc_errors``' one table), health, reflection, the etcd record, the Prometheus
``/metrics`` server and one task refreshing the gauges. Everything a service starts besides
(watchers, stores, a data plane, an HTTP front door) is entered on the host's
``AsyncExitStack``, so a failure half-way through start-up undoes exactly what started, in
reverse, and ``stop()`` is one shutdown in the order of STYLE.md:

    health NOT_SERVING -> refuse new work (``on_draining``) -> etcd record draining ->
    finish or abort in-flight work (``drain``) -> revoke the lease -> ``before_server_stop`` ->
    stop the server (grace ``drain_grace_s``, with ``in_grace`` closers) -> the stack, in
    reverse order of start.

Usage (see services/*/main.py)::

    host = ServiceHost("kvmesh.v1.Worker", bind=..., drain_grace_s=...)
    add_WorkerServicer_to_server(servicer, host.server)
    async with host.starting():        # health NOT_SERVING; on an exception: all undone
        await host.start_server()
        host.callback(store.close)      # ... closed by stop(), after the server
        await host.until_etcd(watcher.start)                     # retried until etcd answers
        await host.register(endpoints, key, record_json, ttl_s)  # likewise
        host.serve_metrics(registry, metrics_host, metrics_port)
        host.refresh_every(metrics_refresh_s, refresh)
    ...                                 # health SERVING
    await host.stop()

A service started while etcd is unreachable serves health NOT_SERVING from its gRPC port and
logs one WARNING per attempt, with a bounded back-off, until etcd answers; a stop signal
meanwhile (``start_or_stop``) cancels the start, which undoes what it started. ``run()``
stops, before the loop closes, any server a failed or interrupted start left behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import gc
import logging
import signal
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc
import uvloop
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from kvmesh.discovery.client import Backoff
from kvmesh.discovery.etcd import EtcdUnavailable, Registrar
from kvmesh.discovery.hosts import advertised_host
from kvmesh.discovery.security import EtcdCredentials
from kvmesh.errors import KvmeshError
from kvmesh.grpc_errors import ErrorStatus
from kvmesh.lifetime import stop_with_parent
from kvmesh.metrics import MetricsServer, serve_metrics
from kvmesh.profiling import profiled
from kvmesh.telemetry import server_interceptors
from kvmesh.tls import Tls

log = logging.getLogger(__name__)

T = TypeVar("T")

ETCD_RETRY_FIRST_S = 0.5  # the first wait after etcd did not answer a start-up step, seconds

# Every host whose server may still need stopping: ``run()`` stops them before the loop closes.
_hosts: weakref.WeakSet[ServiceHost] = weakref.WeakSet()


@dataclass(frozen=True, slots=True)
class Bind:
    """Where the gRPC server listens and what it accepts."""

    host: str  # address to listen on
    port: int  # 0: the OS picks
    advertise_host: str = ""  # host others dial (etcd record); empty: host, or hostname
    max_receive_bytes: int = 4 * 1024 * 1024  # largest request message, bytes
    max_send_bytes: int = 4 * 1024 * 1024  # largest response message, bytes


class ServiceHost:
    """A gRPC service's server, health, reflection, etcd record, metrics and refresh task;
    started step by step inside ``starting()``, stopped by one ``stop()``."""

    def __init__(
        self,
        service_names: Sequence[str],
        bind: Bind,
        drain_grace_s: float,
        etcd_retry_max_s: float = 5.0,
        interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
        tls: Tls | None = None,
    ) -> None:
        """``interceptors`` run inside ``ErrorStatus`` (what they raise is mapped by its table),
        e.g. the router's API keys (``services/router/auth.py``). ``tls``: serve TLS with it
        (mutual TLS when it has a CA and requires client certificates; ``kvmesh/tls.py``);
        None: plaintext."""
        if not etcd_retry_max_s > 0:
            raise ValueError(f"etcd_retry_max_s must be > 0 seconds, got {etcd_retry_max_s}")
        self.service_names = tuple(service_names)
        self.bind = bind
        self.tls = tls
        self.drain_grace_s = drain_grace_s
        self.etcd_retry_max_s = etcd_retry_max_s  # longest wait between start-up attempts
        self.server = grpc.aio.server(
            interceptors=[*server_interceptors(), ErrorStatus(), *interceptors],
            options=[
                ("grpc.max_receive_message_length", bind.max_receive_bytes),
                ("grpc.max_send_message_length", bind.max_send_bytes),
            ],
        )
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.port = 0
        self.registrar: Registrar | None = None
        self.metrics_server: MetricsServer | None = None
        # Hooks of stop(), in its order (see the module docstring).
        self.on_draining: list[Callable[[], None]] = []
        self.draining_record: Callable[[], str] | None = None  # the etcd value while draining
        self.drain: Callable[[], Awaitable[None]] | None = None
        self.before_server_stop: list[Callable[[], Awaitable[None] | None]] = []
        self.in_grace: list[Callable[[float], Awaitable[None]]] = []
        self._stack = contextlib.AsyncExitStack()
        self._stopped = False
        self._revoked = False
        self._server_stopped = False
        _hosts.add(self)

    @property
    def address(self) -> str:
        """``host:port`` others dial (after ``start_server``)."""
        return f"{advertised_host(self.bind.host, self.bind.advertise_host)}:{self.port}"

    # ---- start-up --------------------------------------------------------------------------
    @contextlib.asynccontextmanager
    async def starting(self) -> AsyncIterator[ServiceHost]:
        """The start-up steps run inside, health NOT_SERVING meanwhile (grpc's health servicer
        starts with the server's overall status SERVING); on any exception (cancellation
        included) what started is undone, in reverse, before it propagates. On success health
        turns SERVING."""
        try:
            for name in ("", *self.service_names):
                await self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
            yield self
            if _owns_process:
                freeze_heap()
            for name in ("", *self.service_names):
                await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        except BaseException:
            await self._undo()
            raise

    def bind_port(self) -> int:
        """Binds the gRPC port (once; ``start_server`` does it if not done), so ``address`` is
        known before the server starts; returns the bound port."""
        if not self.port:
            address = f"{self.bind.host}:{self.bind.port}"
            try:
                if self.tls is None:
                    self.port = self.server.add_insecure_port(address)
                else:
                    self.port = self.server.add_secure_port(address, self.tls.server_credentials())
            except RuntimeError:  # grpc says only "Failed to bind": the OS's words for it
                raise OSError(
                    errno.EADDRINUSE,
                    f"cannot bind the gRPC port {address}: address already in use (or not "
                    "available on this host); choose another --port (0: any free port)",
                ) from None
        return self.port

    async def start_server(self) -> int:
        """Enables reflection, binds the port and starts serving; returns the bound port."""
        reflection.enable_server_reflection(
            (*self.service_names, health.SERVICE_NAME, reflection.SERVICE_NAME), self.server
        )
        self.bind_port()
        await self.server.start()
        return self.port

    def callback(self, close: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        """Runs ``close(*args, **kwargs)`` (awaited when it returns an awaitable) on stop, after
        the server, in reverse order of registration; or at once if start-up fails."""

        async def run() -> None:
            result = close(*args, **kwargs)
            if isinstance(result, Awaitable):
                await result

        self._stack.push_async_callback(run)

    async def enter(self, cm: contextlib.AbstractAsyncContextManager[Any]) -> Any:
        """Enters an async context manager, exited on stop like ``callback``."""
        return await self._stack.enter_async_context(cm)

    async def until_etcd(self, step: Callable[[], Awaitable[T]]) -> T:
        """Runs a start-up step that needs etcd (a watcher's first listing, the registration)
        until it succeeds: each ``EtcdUnavailable`` (the step tried for its op timeout) is one
        WARNING line and a wait growing to ``etcd_retry_max_s``. Health stays NOT_SERVING
        meanwhile; a stop signal cancels the wait (``start_or_stop``)."""
        backoff = Backoff(min(ETCD_RETRY_FIRST_S, self.etcd_retry_max_s), self.etcd_retry_max_s)
        while True:
            try:
                return await step()
            except EtcdUnavailable as exc:
                delay_s = backoff.next()
                log.warning(
                    "%s: retrying in %.1f s; health stays NOT_SERVING until registered",
                    exc,
                    delay_s,
                )
                await asyncio.sleep(delay_s)

    async def register(
        self,
        endpoints: Sequence[str],
        key: str,
        value: str,
        ttl_s: float,
        credentials: EtcdCredentials | None = None,
    ) -> None:
        """Puts ``key = value`` in etcd under a lease kept alive until ``stop()``; retried
        until etcd answers (``until_etcd``). ``credentials``: etcd TLS and user."""
        registrar = Registrar(list(endpoints), key, value, ttl_s=ttl_s, credentials=credentials)
        await self.until_etcd(registrar.start)
        self.registrar = registrar

    def serve_metrics(self, registry: Any, host: str, port: int) -> MetricsServer | None:
        """Serves ``registry`` at ``/metrics`` (port 0: the OS picks; -1: off)."""
        if port < 0:
            return None
        self.metrics_server = serve_metrics(registry, host, port)
        self.callback(asyncio.to_thread, self.metrics_server.close)
        return self.metrics_server

    def refresh_every(self, every_s: float, refresh: Callable[[], None]) -> None:
        """The one refresh task: ``refresh()`` on the loop every ``every_s``, now first. A
        failing refresh is logged and does not stop the next ones (nor the service)."""
        task = asyncio.get_running_loop().create_task(_every(every_s, refresh), name="refresh")
        self.callback(_cancel, task)

    def etcd_state(self) -> tuple[bool, bool] | None:
        """(connected, holds a lease) of the etcd record; None without one."""
        reg = self.registrar
        return None if reg is None else (reg.connected, reg.lease_id is not None)

    # ---- shutdown --------------------------------------------------------------------------
    async def stop(self) -> None:
        """Drains and stops, in STYLE.md's order (the module docstring); idempotent."""
        if self._stopped:
            return
        self._stopped = True
        try:
            await self.health.enter_graceful_shutdown()
            for draining in self.on_draining:
                draining()
            registrar = self.registrar
            if registrar is not None and self.draining_record is not None:
                try:
                    await registrar.update(self.draining_record())
                except Exception as exc:  # etcd down: the lease still expires; keep draining
                    log.warning("could not mark %s draining in etcd: %s", registrar.key, exc)
            if self.drain is not None:
                await self.drain()
            await self._revoke()
            for hook in self.before_server_stop:
                result = hook()
                if result is not None:
                    await result
            grace = self.drain_grace_s
            self._server_stopped = True
            await asyncio.gather(
                self.server.stop(grace=grace), *(close(grace) for close in self.in_grace)
            )
        finally:  # a hook that failed (or a cancelled stop) still stops the server and the rest
            await self._stop_server()
            await self._stack.aclose()

    async def _stop_server(self) -> None:
        """Stops the server now if nothing did yet: a grpc.aio server left to the garbage
        collector shuts down from a finalizer, after the loop may be closed ("Event loop is
        closed")."""
        if not self._server_stopped:
            self._server_stopped = True
            await self.server.stop(grace=None)

    async def _revoke(self) -> None:
        registrar = self.registrar
        if registrar is None or self._revoked:
            return
        self._revoked = True  # kept: its gauges read "not registered" from now on
        try:
            await registrar.close(revoke=True)
        except Exception as exc:  # etcd down: the lease expires on its own
            log.warning("could not revoke the etcd lease of %s: %s", registrar.key, exc)

    async def _undo(self) -> None:
        """A failed start-up: nothing drains (nothing was SERVING); everything started stops."""
        self._stopped = True
        await self._revoke()
        await self._stop_server()  # even when it never started (see _stop_server)
        await self._stack.aclose()


async def _every(every_s: float, refresh: Callable[[], None]) -> None:
    while True:
        try:
            refresh()
        except Exception:  # a metrics bug must not stop the refreshes (nor the service)
            log.exception("refreshing the metrics failed")
        await asyncio.sleep(every_s)


async def _cancel(task: asyncio.Task[None]) -> None:
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


# ---- process entry points ------------------------------------------------------------------
def signal_event() -> asyncio.Event:
    """An event set by the first SIGTERM or SIGINT from now on (instead of the default exit).
    In a service's own process started by a launcher (``KVMESH_PARENT_PID``), also set when the
    launcher exits: a ``kvmesh up`` killed with SIGKILL leaves no orphan services."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    if _owns_process:
        stop_with_parent()
    return stop


async def start_or_stop(start: Awaitable[T], stop: asyncio.Event) -> T | None:
    """Awaits ``start`` unless ``stop`` is set first (a signal while the service waits for etcd
    or its engine): then the start is cancelled (its ``starting()`` undoes what it started)
    and None is returned."""
    starting = asyncio.ensure_future(start)
    stopping = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait([starting, stopping], return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopping.cancel()
        if not starting.done():  # stopped first, or this call was cancelled
            starting.cancel()
            await asyncio.gather(starting, return_exceptions=True)
    if starting.cancelled():
        return None
    return starting.result()


async def _stop_leftover_servers() -> None:
    for host in list(_hosts):
        try:
            await host._stop_server()
        except Exception as exc:  # stopping what a failed start left must not hide its error
            log.debug("stopping a leftover gRPC server: %s", exc)


async def _main(serve: Coroutine[Any, Any, None]) -> None:
    try:
        await serve
    finally:
        await _stop_leftover_servers()


_owns_process = False  # set by run(): the process is this service's own (its main)


def freeze_heap() -> None:
    """Everything alive once a service has started (the modules of vLLM, torch and transformers,
    a tokenizer, the engine's config) is moved out of the garbage collector's reach, as vLLM's
    engine core does after start-up: a full collection then walks only what serving allocates.
    Measured in a router under 600 concurrent streams (``kvmesh bench streams --profile-dir``):
    each full collection took ~245 ms of the event loop before, every stream stalled meanwhile.
    The one collection here runs before health turns SERVING. Only in a process of the
    service's own (``run()``): frozen objects that later become cyclic garbage are never
    collected, so a process that starts and stops many services (a test run) must not."""
    gc.collect()
    gc.freeze()


def run(serve: Coroutine[Any, Any, None], service: str) -> int:
    """Runs ``serve`` on uvloop's event loop (libuv, as vLLM's API server does: the router's and
    the worker's CPU per streamed token 8-17% lower than on asyncio's own loop, BENCHMARKS.md
    table 0j): 0; a failure the operator fixes (a domain error such as a bad
    setting, or the OS's: a port in use) is one error line and exit status 2 (start-up undid
    what it started, so there is no trace and nothing left running); an interrupt before the
    signal handlers are in place is one line and 130. Any gRPC server still up is stopped
    before the loop closes."""
    global _owns_process
    _owns_process = True
    try:
        with profiled(service), asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            runner.run(_main(serve))
    except (KvmeshError, OSError) as exc:
        log.error("%s failed: %s", service, exc)
        return 2
    except KeyboardInterrupt:
        log.warning("%s interrupted while starting", service)
        return 130
    return 0
