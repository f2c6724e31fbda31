"""Starts a whole mesh on one machine as child processes: etcd, workers, a router.

Used by ``kvmesh up``, ``kvmesh demo``, the e2e tests and the benchmarks. Each child is a
separate process, exactly as in production; their logs go to files in ``log_dir``, and each
announces readiness with one line on stdout (``KVMESH_WORKER_READY ...``,
``KVMESH_ROUTER_READY ...``). Stopping sends SIGTERM (router first, then workers, which drain),
waits, and kills whatever is left.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvmesh.cpus import available_cpus, format_cpu_list, plan_cpus
from kvmesh.etcd_server import LocalEtcd
from kvmesh.lifetime import PARENT_PID_ENV
from kvmesh.tls import Tls, TlsConfig

log = logging.getLogger(__name__)

WORKER_READY = "KVMESH_WORKER_READY"
ROUTER_READY = "KVMESH_ROUTER_READY"
KVMANAGER_READY = "KVMESH_KVMANAGER_READY"


@dataclass(frozen=True, slots=True)
class MeshSpec:
    model_path: Path
    served_model_name: str = ""  # default: the model directory's name
    workers: int = 2  # workers of role both
    # Prefill/decode disaggregation (docs/disaggregation.md): workers started with --role
    # prefill / --role decode, named prefill-<i> / decode-<i>; they need the kvmanager.
    prefill_workers: int = 0
    decode_workers: int = 0
    router_host: str = "127.0.0.1"
    router_port: int = 0  # 0: the OS picks
    router_http_port: int = 0  # the router's OpenAI-compatible HTTP port; 0: the OS picks
    router_policy: str = ""  # the router's --policy (profile name or YAML); empty: its default
    etcd_endpoints: tuple[str, ...] = ()  # empty: start a local etcd child
    cluster: str = "default"
    max_model_len: int = 4096
    kv_cache_bytes: int = 256 * 1024 * 1024  # per worker
    block_size: int = 32
    worker_args: tuple[str, ...] = ()  # extra flags for every worker
    # Speculative decoding flags (kvmesh worker --spec-*), for the first ``spec_workers``
    # workers in start order (-1: all of them); the others decode plainly.
    spec_worker_args: tuple[str, ...] = ()
    spec_workers: int = -1
    router_args: tuple[str, ...] = ()  # extra flags for the router
    log_dir: Path | None = None  # default: a new temp dir
    start_timeout_s: float = 240.0
    env: dict[str, str] = field(default_factory=dict)  # extra environment for children
    # The node's kvmanager (CPU and disk KV tiers under the workers): started first, and every
    # worker saves to and loads from it. 0 bytes of CPU tier: no kvmanager.
    kvmanager_cpu_bytes: int = 1 << 30
    kvmanager_disk_bytes: int = 0  # disk tier budget; 0: no disk tier
    kvmanager_args: tuple[str, ...] = ()  # extra flags for the kvmanager
    # Tracing (docs/tracing.md), passed to every child as --trace-exporter / --otlp-endpoint;
    # each names itself (service.name kvmesh-router, kvmesh-worker, kvmesh-kvmanager).
    trace_exporter: str = "none"  # none, console or otlp (kvmesh.telemetry.Exporter)
    otlp_endpoint: str = ""  # the collector, with otlp; empty: the children's OTEL_* environment
    # Give every engine cores of its own and keep one for the router, the kvmanager and the
    # workers' front ends when there are enough (kvmesh/cpus.py); False: no binding at all.
    bind_cpus: bool = True
    router_processes: int = 1  # router processes sharing its ports (kvmesh router --processes)
    # The first worker and the router in one process (services/node: the router's data path
    # to it is a call, not a gRPC stream); the other workers, if any, run on their own.
    colocate: bool = False
    # CORS of the router's HTTP API, as its --allowed-origins ... flags take them (JSON list or
    # comma-separated); empty: the router's default (no origin allowed; all methods, headers).
    allowed_origins: str = ""
    allowed_methods: str = ""
    allowed_headers: str = ""
    allow_credentials: bool = False
    # Mutual TLS on every hop (docs/deploy.md#tls): every child gets DIR's node.pem, node.key
    # and ca.pem as --tls-cert-file/--tls-key-file/--tls-ca-file, made there (kvmesh/tlsgen.py)
    # when missing. None: plaintext.
    tls_dir: Path | None = None
    # One node of a multi-node mesh on one machine (kvmesh/netns.py): the node's name (its
    # kvmanager's id, its workers' --node and the prefix of their ids), the address its
    # kvmanager and workers listen on, and the network namespace they run in (``ip netns
    # exec``). Empty: the machine's own node (hostname), loopback, the current namespace.
    node: str = ""
    bind_host: str = "127.0.0.1"
    netns: str = ""
    router: bool = True  # False: no router (the node meshes of kvmesh/netns.py share one)


@dataclass
class Child:
    name: str
    proc: subprocess.Popen[str]
    log_path: Path
    ready: dict[str, str] = field(default_factory=dict)
    _ready_event: threading.Event = field(default_factory=threading.Event)


class Mesh:
    """A running single-machine mesh. Use as a context manager or call start()/stop()."""

    def __init__(self, spec: MeshSpec) -> None:
        self.spec = spec
        self.log_dir = spec.log_dir or Path(tempfile.mkdtemp(prefix="kvmesh-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.etcd: LocalEtcd | None = None
        self.workers: list[Child] = []
        self.router: Child | None = None
        self.kvmanager: Child | None = None
        self.cpu_plan = (
            plan_cpus(available_cpus(), len(self.worker_roles())) if spec.bind_cpus else None
        )

    # ---- lifecycle ------------------------------------------------------------------------
    def __enter__(self) -> Mesh:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def etcd_endpoints(self) -> tuple[str, ...]:
        if self.spec.etcd_endpoints:
            return self.spec.etcd_endpoints
        assert self.etcd is not None
        return tuple(self.etcd.endpoints)

    @property
    def router_address(self) -> str:
        assert self.router is not None
        return self.router.ready["address"]

    @property
    def http_base_url(self) -> str:
        """The router's OpenAI-compatible base URL (``http://host:port/v1``)."""
        assert self.router is not None
        return self.router.ready["http"]

    def start(self) -> None:
        try:
            self.ensure_certificates()
            if not self.spec.etcd_endpoints:
                self.etcd = LocalEtcd(data_dir=self.log_dir / "etcd")
                self.etcd.start()
            if self.spec.kvmanager_cpu_bytes > 0:
                self.kvmanager = self.start_kvmanager()
                self._wait_ready(self.kvmanager, 60.0)
            roles = self.worker_roles()
            for i, (name, role) in enumerate(roles):
                if i > 0 or not self.colocated:
                    self.workers.append(self.start_worker(name, self.worker_args(i, role)))
            for w in self.workers:
                self._wait_ready(w, self.spec.start_timeout_s)
            if self.colocated:
                self.router, first = self.start_node()
                self.workers.insert(0, first)
                self._wait_ready(first, self.spec.start_timeout_s)
            elif self.spec.router:
                self.router = self.start_router()
            if self.router is not None:
                self._wait_ready(self.router, 60.0)
        except BaseException:
            self.stop()
            raise

    @property
    def colocated(self) -> bool:
        """The first worker runs in the router's process (``MeshSpec.colocate``)."""
        return self.spec.colocate and bool(self.worker_roles())

    def worker_roles(self) -> list[tuple[str, str]]:
        """(name, role) of every worker the spec asks for, in start order."""
        spec = self.spec
        pre = f"{spec.node}-" if spec.node else ""
        return [
            *((f"{pre}worker-{i}", "both") for i in range(spec.workers)),
            *((f"{pre}prefill-{i}", "prefill") for i in range(spec.prefill_workers)),
            *((f"{pre}decode-{i}", "decode") for i in range(spec.decode_workers)),
        ]

    def node_args(self, kvmanager: bool = False) -> list[str]:
        """A node mesh's children listen on its address, in its name (``MeshSpec.node``);
        nothing for the machine's own node."""
        spec = self.spec
        args = []
        if spec.bind_host != "127.0.0.1":
            args += ["--host", spec.bind_host, "--metrics-host", spec.bind_host]
        if spec.node:
            args += ["--node", spec.node, *(["--kvmanager-id", spec.node] if kvmanager else [])]
        return args

    @staticmethod
    def _role_args(role: str) -> list[str]:
        return [] if role == "both" else ["--role", role]

    def worker_args(self, index: int, role: str) -> list[str]:
        """The start-order ``index``-th worker's own flags: its role and, if it is one of the
        speculating ones, the speculative decoding flags."""
        spec = self.spec
        speculates = spec.spec_workers < 0 or index < spec.spec_workers
        return [*self._role_args(role), *(spec.spec_worker_args if speculates else ())]

    def trace_args(self) -> list[str]:
        """The tracing flags every child gets; none when tracing is off."""
        spec = self.spec
        if spec.trace_exporter == "none":
            return []
        endpoint = spec.otlp_endpoint if spec.trace_exporter == "otlp" else ""
        return [
            "--trace-exporter", spec.trace_exporter,
            *(["--otlp-endpoint", endpoint] if endpoint else []),
        ]  # fmt: skip

    def tls_files(self) -> tuple[Path, Path, Path] | None:
        """(certificate, key, CA) every child uses; None without ``tls_dir``."""
        d = self.spec.tls_dir
        return None if d is None else (d / "node.pem", d / "node.key", d / "ca.pem")

    def tls_args(self) -> list[str]:
        """The TLS flags every child gets; none without ``tls_dir``."""
        files = self.tls_files()
        if files is None:
            return []
        cert, key, ca = files
        return ["--tls-cert-file", str(cert), "--tls-key-file", str(key), "--tls-ca-file", str(ca)]

    def client_tls(self) -> Tls | None:
        """What a client of this mesh (``RouterClient``) connects with."""
        files = self.tls_files()
        if files is None:
            return None
        cert, key, ca = files
        return TlsConfig(cert_file=cert, key_file=key, ca_file=ca).load()

    def ensure_certificates(self) -> None:
        """Makes a CA and one node certificate in ``tls_dir`` unless it holds them."""
        files = self.tls_files()
        if files is None or all(f.exists() for f in files):
            return
        from kvmesh.tlsgen import DEFAULT_HOSTS, make_pki

        assert self.spec.tls_dir is not None
        hosts = dict.fromkeys((*DEFAULT_HOSTS, self.spec.router_host, socket.gethostname()))
        make_pki(self.spec.tls_dir, list(hosts), ca_name="kvmesh up CA")
        log.info("made a CA and a node certificate in %s", self.spec.tls_dir)

    def cpu_args(self, name: str) -> list[str]:
        """A worker's --compute-cpus / --service-cpus from the mesh's CPU plan."""
        plan = self.cpu_plan
        names = [n for n, _ in self.worker_roles()]
        if plan is None or name not in names:
            return []
        args = ["--compute-cpus", format_cpu_list(plan.engines[names.index(name)])]
        if plan.services:
            args += ["--service-cpus", format_cpu_list(plan.services)]
        return args

    def start_worker(self, name: str, extra_args: Sequence[str] = ()) -> Child:
        args = self._worker_argv(name, extra_args)
        return self._spawn(name, "services.worker.main", args, WORKER_READY)

    def _worker_argv(self, name: str, extra_args: Sequence[str]) -> list[str]:
        spec = self.spec
        return [
            "--model", str(spec.model_path),
            "--worker-id", name,
            "--cluster", spec.cluster,
            "--etcd", ",".join(self.etcd_endpoints),
            "--max-model-len", str(spec.max_model_len),
            "--kv-cache-bytes", str(spec.kv_cache_bytes),
            "--block-size", str(spec.block_size),
            *(["--served-model-name", spec.served_model_name] if spec.served_model_name else []),
            *(["--kvmanager", self.kvmanager.ready["address"]] if self.kvmanager else []),
            *self.node_args(),
            *self.trace_args(),
            *self.tls_args(),
            *self.cpu_args(name),
            *spec.worker_args,
            *extra_args,
        ]  # fmt: skip

    def start_router(self, name: str = "router", extra_args: Sequence[str] = ()) -> Child:
        args = self._router_argv(extra_args)
        return self._pinned(self._spawn(name, "services.router.main", args, ROUTER_READY))

    def start_node(self, router_name: str = "router") -> tuple[Child, Child]:
        """The router and the first worker in one process (``services/node``): its router and
        worker children, one process. Not pinned here: the worker pins the process to the
        service cores once its engine has started, as a worker of its own does."""
        name, role = self.worker_roles()[0]
        argv = [
            *self._router_argv(()),
            "--",
            *self._worker_argv(name, self.worker_args(0, role)),
        ]
        log_path = self.log_dir / f"{router_name}+{name}.log"
        proc, logf = self._popen("services.node.main", argv, log_path)
        router, worker = Child(router_name, proc, log_path), Child(name, proc, log_path)
        threading.Thread(
            target=_pump,
            args=({ROUTER_READY: router, WORKER_READY: worker}, logf),
            name=f"pump-{router_name}+{name}",
            daemon=True,
        ).start()
        log.info(
            "started %s and %s in one process (pid %d), log %s",
            router_name,
            name,
            proc.pid,
            log_path,
        )
        return router, worker

    def _router_argv(self, extra_args: Sequence[str]) -> list[str]:
        spec = self.spec
        return [
            "--host", spec.router_host,
            "--port", str(spec.router_port),
            "--http-host", spec.router_host,
            "--http-port", str(spec.router_http_port),
            "--cluster", spec.cluster,
            "--etcd", ",".join(self.etcd_endpoints),
            *(["--policy", spec.router_policy] if spec.router_policy else []),
            *(["--processes", str(spec.router_processes)] if spec.router_processes > 1 else []),
            *(["--allowed-origins", spec.allowed_origins] if spec.allowed_origins else []),
            *(["--allowed-methods", spec.allowed_methods] if spec.allowed_methods else []),
            *(["--allowed-headers", spec.allowed_headers] if spec.allowed_headers else []),
            *(["--allow-credentials"] if spec.allow_credentials else []),
            *self.trace_args(),
            *self.tls_args(),
            *spec.router_args,
            *extra_args,
        ]  # fmt: skip

    def start_kvmanager(self, name: str = "kvmanager") -> Child:
        spec = self.spec
        disk = (
            [
                "--disk-dir",
                str(self.log_dir / "kv-disk"),
                "--disk-bytes",
                str(spec.kvmanager_disk_bytes),
            ]
            if spec.kvmanager_disk_bytes > 0
            else []
        )
        args = [
            "--cluster", spec.cluster,
            "--etcd", ",".join(self.etcd_endpoints),
            "--cpu-bytes", str(spec.kvmanager_cpu_bytes),
            *disk,
            *self.node_args(kvmanager=True),
            *self.trace_args(),
            *self.tls_args(),
            *spec.kvmanager_args,
        ]  # fmt: skip
        return self._pinned(self._spawn(name, "services.kvmanager.main", args, KVMANAGER_READY))

    def _pinned(self, child: Child) -> Child:
        """Keeps a service off the engines' cores (its threads inherit the first one's)."""
        plan = self.cpu_plan
        if plan is not None and plan.services:
            with contextlib.suppress(ProcessLookupError):
                os.sched_setaffinity(child.proc.pid, plan.services)
        return child

    def restart_router(self) -> None:
        """Stops the router (SIGTERM, drain) and starts a new one in its place (colocated:
        with the first worker)."""
        assert self.router is not None
        stop_child(self.router, grace_s=15.0)
        if self.colocated:
            self._restart_node()
            return
        self.router = self.start_router(self.router.name)
        self._wait_ready(self.router, 60.0)

    def _restart_node(self) -> None:
        assert self.router is not None
        stop_child(self.router, grace_s=30.0)
        self.router, self.workers[0] = self.start_node(self.router.name)
        self._wait_ready(self.workers[0], self.spec.start_timeout_s)
        self._wait_ready(self.router, 60.0)

    def restart_worker(self, i: int) -> None:
        """Stops worker ``i`` (SIGTERM, drain) and starts a fresh engine under the same id
        (colocated, the first: with the router)."""
        if i == 0 and self.colocated:
            self._restart_node()
            return
        old = self.workers[i]
        stop_child(old, grace_s=30.0)
        names = [n for n, _ in self.worker_roles()]
        role = dict(self.worker_roles()).get(old.name, "both")
        index = names.index(old.name) if old.name in names else i
        self.workers[i] = self.start_worker(old.name, self.worker_args(index, role))
        self._wait_ready(self.workers[i], self.spec.start_timeout_s)

    def wait_ready(self, child: Child, timeout_s: float | None = None) -> None:
        self._wait_ready(child, timeout_s or self.spec.start_timeout_s)

    def stop(self) -> None:
        if self.router is not None:
            stop_child(self.router, grace_s=15.0)
        for w in self.workers:
            if w.proc.poll() is None:
                w.proc.send_signal(signal.SIGTERM)
        for w in self.workers:
            stop_child(w, grace_s=30.0)
        if self.kvmanager is not None:
            stop_child(self.kvmanager, grace_s=10.0)
        if self.etcd is not None:
            self.etcd.stop()
            self.etcd = None

    # ---- internals ------------------------------------------------------------------------
    def _spawn(self, name: str, module: str, args: list[str], ready_tag: str) -> Child:
        log_path = self.log_dir / f"{name}.log"
        proc, logf = self._popen(module, args, log_path)
        child = Child(name, proc, log_path)
        threading.Thread(
            target=_pump, args=({ready_tag: child}, logf), name=f"pump-{name}", daemon=True
        ).start()
        log.info("started %s (pid %d), log %s", name, proc.pid, log_path)
        return child

    def _popen(
        self, module: str, args: list[str], log_path: Path
    ) -> tuple[subprocess.Popen[str], Any]:
        """A child running ``python -m module args``: stdout piped (its ready lines), stderr
        to ``log_path``; returns it and the open log file (the pump closes it)."""
        # Services stop when this process exits, even killed with SIGKILL (kvmesh/lifetime.py).
        env = {**os.environ, **child_env(), PARENT_PID_ENV: str(os.getpid()), **self.spec.env}
        logf = open(log_path, "a", buffering=1)  # noqa: SIM115 - the child's stderr, open while it runs
        netns = ["ip", "netns", "exec", self.spec.netns] if self.spec.netns else []
        proc = subprocess.Popen(
            [*netns, sys.executable, "-m", module, *args],
            stdout=subprocess.PIPE,
            stderr=logf,
            text=True,
            env=env,
            start_new_session=True,  # Ctrl-C in a terminal reaches us, not them; we stop them
        )
        return proc, logf

    def _wait_ready(self, child: Child, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not child._ready_event.wait(0.2):
            if child.proc.poll() is not None:
                raise RuntimeError(
                    f"{child.name} exited with code {child.proc.returncode} before it was ready; "
                    f"last lines of {child.log_path}:\n{tail(child.log_path)}"
                )
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"{child.name} not ready after {timeout_s:.0f} s; last lines of "
                    f"{child.log_path}:\n{tail(child.log_path)}"
                )


def _pump(children: dict[str, Child], logf) -> None:  # type: ignore[no-untyped-def]
    """Copies a process's stdout to its log; each ready line (tag -> child) readies its child."""
    proc = next(iter(children.values())).proc
    assert proc.stdout is not None
    try:
        for line in proc.stdout:
            tag = line.split(" ", 1)[0].strip()
            child = children.get(tag)
            if child is not None:
                child.ready = dict(part.split("=", 1) for part in line.split()[1:] if "=" in part)
                child._ready_event.set()
            logf.write(line)
    finally:
        logf.close()
        proc.stdout.close()


def stop_child(child: Child, grace_s: float) -> None:
    if child.proc.poll() is None:
        child.proc.send_signal(signal.SIGTERM)
        try:
            child.proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            log.warning("%s did not stop within %.0f s; killing it", child.name, grace_s)
            # Its whole process group: a worker's vLLM engine core is a child of its own.
            with contextlib.suppress(ProcessLookupError):
                os.killpg(child.proc.pid, signal.SIGKILL)
            child.proc.wait(10)


def child_env() -> dict[str, str]:
    """Environment every child gets: offline, no usage stats."""
    return {
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "PYTHONUNBUFFERED": "1",
    }


def tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"
