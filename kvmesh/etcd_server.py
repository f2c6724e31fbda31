"""Start a real, single-member etcd as a child process on free loopback ports.

Used by ``kvmesh up``/``demo`` (one private etcd per mesh) and by the integration and e2e tests.
The API is synchronous: starting takes a fraction of a second. Async callers use ``astart``,
``astop`` and ``arestart``, which run the same code in a worker thread so the event loop keeps
serving while etcd boots or shuts down.

With ``tls`` (``EtcdServerTls``) the client port speaks TLS, and with its CA etcd asks every
client for a certificate from it (``--client-cert-auth``): what tests of the services' etcd TLS
options run against. ``enable_auth`` turns etcd's users on.

Layout of ``data_dir``::

    <data_dir>/etcd/      etcd's own data directory (member/)
    <data_dir>/etcd.log   etcd's stdout and stderr, appended across restarts
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import shutil
import signal
import socket
import ssl
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

log = logging.getLogger(__name__)

INSTALL_HINT = (
    "install it with `apt-get install etcd-server` (Debian/Ubuntu; kvmesh starts its own etcd, "
    "the system service is not needed) or run `make setup`"
)
_ADDR_IN_USE = "address already in use"
_PORT_ATTEMPTS = 5  # fresh port pairs tried when a port is taken between picking and binding


@dataclass(frozen=True, slots=True)
class EtcdServerTls:
    """TLS of a ``LocalEtcd``'s client port."""

    cert_file: Path  # etcd's certificate (also shown as the client certificate of the health
    key_file: Path  # probe: give it client use too)
    ca_file: Path  # clients' certificates must chain to it
    client_cert_auth: bool = True  # refuse clients without one


class EtcdStartError(RuntimeError):
    """etcd did not become healthy; the message ends with the tail of its log."""


def find_etcd_binary(binary: str | None = None) -> str:
    """The path of the etcd server binary: ``binary`` if given, else ``etcd`` on PATH."""
    name = binary or "etcd"
    found = shutil.which(name)
    if found is None:
        raise FileNotFoundError(f"etcd server binary {name!r} not found; {INSTALL_HINT}")
    return found


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago, for a service started later on a fixed port.

    Picked below the kernel's ephemeral range, where the processes started meanwhile with port
    0 (and every outgoing connection) never land, and never the same twice in this process:
    a port picked from the ephemeral range could be taken by one of them before its owner
    binds it. Falls back to the ephemeral range if nothing below it is free."""
    low = _ephemeral_low()
    for _ in range(64):
        port = _rng.randrange(_FIXED_PORT_MIN, low) if low > _FIXED_PORT_MIN else 0
        if port == 0 or port in _handed_out:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


_FIXED_PORT_MIN = 20000
_rng = random.Random()
_handed_out: set[int] = set()


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (Linux; 32768 elsewhere)."""
    try:
        text = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text()
        return int(text.split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


class LocalEtcd:
    """A single-member etcd on loopback, owned by this process.

    ``stop()`` keeps the data directory, so ``start()`` or ``restart()`` brings back the same
    cluster (same keys, revisions and leases) on the same ports; clients reconnect by themselves.
    ``close()`` (and leaving the ``with`` block) stops etcd and deletes the data directory if this
    object created it.
    """

    def __init__(
        self,
        data_dir: str | Path | None = None,
        *,
        binary: str | None = None,
        host: str = "127.0.0.1",
        name: str = "kvmesh-local",
        start_timeout_s: float = 20.0,
        stop_grace_s: float = 5.0,
        quota_backend_bytes: int = 64 * 1024 * 1024,
        snapshot_count: int = 5000,
        extra_args: Sequence[str] = (),
        tls: EtcdServerTls | None = None,
    ) -> None:
        self.binary = find_etcd_binary(binary)
        self.tls = tls
        self._owns_dir = data_dir is None
        self.data_dir = Path(
            tempfile.mkdtemp(prefix="kvmesh-etcd-") if data_dir is None else data_dir
        )
        self.host = host
        self.name = name
        self.start_timeout_s = start_timeout_s  # seconds until etcd must answer /health
        self.stop_grace_s = stop_grace_s  # seconds between SIGTERM and SIGKILL
        self.quota_backend_bytes = quota_backend_bytes
        self.snapshot_count = snapshot_count  # raft entries kept before a snapshot (memory)
        self.extra_args = tuple(extra_args)
        self.client_port: int | None = None
        self.peer_port: int | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._finalizer: weakref.finalize | None = None

    # -- addresses -------------------------------------------------------------------------------

    @property
    def endpoint(self) -> str:
        """``host:port`` of the client port (what ``Registrar``/``PrefixWatcher`` take)."""
        if self.client_port is None:
            raise RuntimeError("LocalEtcd has not been started")
        return f"{self.host}:{self.client_port}"

    @property
    def endpoints(self) -> list[str]:
        return [self.endpoint]

    @property
    def client_url(self) -> str:
        return f"{'https' if self.tls is not None else 'http'}://{self.endpoint}"

    @property
    def log_path(self) -> Path:
        return self.data_dir / "etcd.log"

    @property
    def etcd_data_dir(self) -> Path:
        return self.data_dir / "etcd"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    # -- lifecycle -------------------------------------------------------------------------------

    def start(self) -> LocalEtcd:
        """Start etcd and wait until it is healthy. Picks free ports on the first start only."""
        if self.running:
            raise RuntimeError(f"etcd is already running (pid {self.pid})")
        self.data_dir.mkdir(parents=True, exist_ok=True)
        fixed_ports = self.client_port is not None
        attempts = 3 if fixed_ports else _PORT_ATTEMPTS
        for attempt in range(1, attempts + 1):
            if not fixed_ports:
                self.client_port, self.peer_port = self._pick_ports()
            busy = self._busy_ports()
            if busy:
                # Checked first: /health would otherwise be answered by whoever holds the port.
                if attempt == attempts:
                    raise EtcdStartError(
                        f"port(s) {busy} on {self.host} are in use by another process; "
                        "cannot start etcd there"
                    )
                if fixed_ports:
                    time.sleep(0.5)  # give the old holder of our fixed ports time to let go
                continue
            try:
                self._launch()
                self._wait_healthy()
            except EtcdStartError as exc:
                self._terminate()
                if _ADDR_IN_USE not in str(exc) or attempt == attempts:
                    raise
                log.warning("etcd port collision (attempt %s/%s), retrying", attempt, attempts)
                continue
            log.info("etcd %s ready (pid %s, data %s)", self.endpoint, self.pid, self.data_dir)
            return self
        raise AssertionError("unreachable")

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after ``stop_grace_s``. Keeps the data directory and the ports."""
        self._terminate()

    def kill(self) -> None:
        """SIGKILL at once: a crash, for tests. Keeps the data directory and the ports."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()
        self._forget_proc()

    def restart(self) -> None:
        """Stop and start again on the same ports with the same data."""
        self.stop()
        self.start()

    def close(self) -> None:
        """Stop etcd and delete the data directory if this object created it."""
        self._terminate()
        if self._owns_dir:
            shutil.rmtree(self.data_dir, ignore_errors=True)

    async def astart(self) -> LocalEtcd:
        return await asyncio.to_thread(self.start)

    async def astop(self) -> None:
        await asyncio.to_thread(self.stop)

    async def arestart(self) -> None:
        await asyncio.to_thread(self.restart)

    def __enter__(self) -> LocalEtcd:
        try:
            return self.start()
        except BaseException:
            self.close()
            raise

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def log_tail(self, lines: int = 30) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "(no etcd log)"
        return "\n".join(text.splitlines()[-lines:])

    # -- internals -------------------------------------------------------------------------------

    def _pick_ports(self) -> tuple[int, int]:
        client = free_port(self.host)
        peer = free_port(self.host)
        while peer == client:
            peer = free_port(self.host)
        return client, peer

    def _busy_ports(self) -> list[int]:
        assert self.client_port is not None and self.peer_port is not None
        busy = []
        for port in (self.client_port, self.peer_port):
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
                # Go listeners set SO_REUSEADDR too: a port in TIME_WAIT is usable, a listener not.
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                try:
                    sock.bind((self.host, port))
                except OSError:
                    busy.append(port)
        return busy

    def _command(self) -> list[str]:
        client_url = self.client_url
        peer_url = f"http://{self.host}:{self.peer_port}"
        tls_args: list[str] = []
        if self.tls is not None:
            tls_args = [
                "--cert-file", str(self.tls.cert_file), "--key-file", str(self.tls.key_file),
                "--trusted-ca-file", str(self.tls.ca_file),
                *(["--client-cert-auth"] if self.tls.client_cert_auth else []),
            ]  # fmt: skip
        return [
            self.binary,
            "--name",
            self.name,
            "--data-dir",
            str(self.etcd_data_dir),
            "--listen-client-urls",
            client_url,
            "--advertise-client-urls",
            client_url,
            "--listen-peer-urls",
            peer_url,
            "--initial-advertise-peer-urls",
            peer_url,
            "--initial-cluster",
            f"{self.name}={peer_url}",
            "--initial-cluster-state",
            "new",  # ignored when the data directory already holds a member
            "--quota-backend-bytes",
            str(self.quota_backend_bytes),
            "--snapshot-count",
            str(self.snapshot_count),
            # One member has no peers to disagree with: a short election only makes (re)starts
            # quicker (about 0.4 s instead of 1-2 s). Leases shorter than 1 s become 1 s.
            "--heartbeat-interval",
            "50",
            "--election-timeout",
            "300",
            "--logger",
            "zap",
            "--log-level",
            "warn",
            "--log-outputs",
            "stderr",
            *tls_args,
            *self.extra_args,
        ]

    def _launch(self) -> None:
        with open(self.log_path, "ab") as log_file:
            log_file.write(f"--- kvmesh: starting etcd on {self.endpoint}\n".encode())
            log_file.flush()
            self._proc = subprocess.Popen(
                self._command(),
                stdin=subprocess.DEVNULL,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                cwd=self.data_dir,
            )
        # Kill the child if this object is garbage collected or the interpreter exits first.
        self._finalizer = weakref.finalize(self, _kill_quietly, self._proc)

    def _wait_healthy(self) -> None:
        assert self._proc is not None
        handlers: list[urllib.request.BaseHandler] = [urllib.request.ProxyHandler({})]  # no proxy
        if self.tls is not None:
            ctx = ssl.create_default_context(cafile=str(self.tls.ca_file))
            ctx.load_cert_chain(self.tls.cert_file, self.tls.key_file)
            handlers.append(urllib.request.HTTPSHandler(context=ctx))
        opener = urllib.request.build_opener(*handlers)
        deadline = time.monotonic() + self.start_timeout_s
        last = "no answer yet"
        while time.monotonic() < deadline:
            code = self._proc.poll()
            if code is not None:
                raise EtcdStartError(
                    f"etcd exited with status {code} while starting on {self.endpoint} "
                    f"(log {self.log_path}):\n{self.log_tail()}"
                )
            try:
                with opener.open(f"{self.client_url}/health", timeout=1.0) as resp:
                    body = json.loads(resp.read())
                if body.get("health") == "true" and self._proc.poll() is None:
                    return
                last = f"/health said {body}"
            except (OSError, ValueError) as exc:  # URLError is an OSError
                last = str(exc)
            time.sleep(0.05)
        raise EtcdStartError(
            f"etcd on {self.endpoint} not healthy after {self.start_timeout_s:.0f} s ({last}); "
            f"log {self.log_path}:\n{self.log_tail()}"
        )

    def _terminate(self) -> None:
        proc = self._proc
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=self.stop_grace_s)
            except subprocess.TimeoutExpired:
                log.warning(
                    "etcd pid %s ignored SIGTERM for %s s; killing", proc.pid, self.stop_grace_s
                )
                proc.kill()
                proc.wait()
        self._forget_proc()

    def _forget_proc(self) -> None:
        if self._finalizer is not None:
            self._finalizer.detach()
            self._finalizer = None
        self._proc = None


async def enable_auth(
    endpoint: str,
    root_password: str,
    users: Mapping[str, str],
    prefix: str = "/kvmesh/",
    channel_credentials: object | None = None,
) -> None:
    """Turns on etcd's users: ``root`` (what etcd requires first) and each of ``users`` (name
    -> password) with read and write under ``prefix``. ``channel_credentials``: a
    ``grpc.ChannelCredentials`` for a TLS etcd."""
    import grpc
    from aetcd import rpc

    async with (
        grpc.aio.secure_channel(endpoint, channel_credentials)  # type: ignore[arg-type]
        if channel_credentials is not None
        else grpc.aio.insecure_channel(endpoint)
    ) as channel:
        auth = rpc.AuthStub(channel)
        await auth.UserAdd(rpc.AuthUserAddRequest(name="root", password=root_password), timeout=5)
        await auth.UserGrantRole(rpc.AuthUserGrantRoleRequest(user="root", role="root"), timeout=5)
        end = prefix[:-1] + chr(ord(prefix[-1]) + 1)
        await auth.RoleAdd(rpc.AuthRoleAddRequest(name="kvmesh"), timeout=5)
        await auth.RoleGrantPermission(
            rpc.AuthRoleGrantPermissionRequest(
                name="kvmesh",
                perm=rpc.Permission(
                    permType=rpc.Permission.READWRITE, key=prefix.encode(), range_end=end.encode()
                ),
            ),
            timeout=5,
        )
        for name, password in users.items():
            await auth.UserAdd(rpc.AuthUserAddRequest(name=name, password=password), timeout=5)
            await auth.UserGrantRole(
                rpc.AuthUserGrantRoleRequest(user=name, role="kvmesh"), timeout=5
            )
        await auth.AuthEnable(rpc.AuthEnableRequest(), timeout=5)


def _kill_quietly(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait()
