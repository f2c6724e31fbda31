"""``kvmesh router --processes N``: N router processes behind one gRPC port and one HTTP port.

One router process is one asyncio loop: one core. A router host with more cores runs several,
all listening on the same ports with ``SO_REUSEPORT`` (gRPC's servers set it by default on
Linux; the HTTP front door asks for it): the kernel spreads new connections across them. Each is
a whole router: its own etcd watches, its own exact KV index from every worker's KV events, its
own streams to the workers; they share nothing, so one dying costs only its own connections.

The supervisor reserves the ports (bound with ``SO_REUSEPORT``, never listening, so no
connection lands on it), starts the children with those ports and ``--processes 1``, prints one
ready line once all are ready, passes SIGTERM / SIGINT on, and exits when they have.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Sequence

from kvmesh.lifetime import terminate_with_parent

log = logging.getLogger(__name__)

READY_LINE = "KVMESH_ROUTER_READY"


def reserve_port(host: str, port: int) -> socket.socket:
    """A socket bound to ``host:port`` (0: a free port) with SO_REUSEPORT, not listening: it
    holds the port for the children, which bind it too."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    s = socket.socket(family, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    s.bind((host, port))
    return s


def child_argv(
    argv: Sequence[str], index: int, port: int, http_port: int, router_id: str, metrics: bool
) -> list[str]:
    """The child's flags: the parent's, then the shared ports, its own id and its own metrics
    port (argparse takes the last value of a repeated flag)."""
    out = [*argv, "--processes", "1", "--port", str(port), "--reuse-port"]
    out += ["--router-id", f"{router_id}-{index}"]
    if http_port >= 0:
        out += ["--http-port", str(http_port)]
    if metrics:
        out += ["--metrics-port", "0"]
    return out


def run_processes(
    argv: Sequence[str],
    processes: int,
    host: str,
    port: int,
    http_host: str,
    http_port: int,
    router_id: str,
    metrics: bool = True,
) -> int:
    """Runs ``processes`` routers with ``argv`` (the parent's flags) on shared ports; returns
    the worst exit code."""
    held = [reserve_port(host, port)]
    port = held[0].getsockname()[1]
    if http_port >= 0:
        held.append(reserve_port(http_host, http_port))
        http_port = held[-1].getsockname()[1]
    router_id = router_id or f"{socket.gethostname()}-{port}"
    children = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "services.router.main",
                *child_argv(argv, i, port, http_port, router_id, metrics),
            ],
            stdout=subprocess.PIPE,
            text=True,
            # A supervisor killed with SIGKILL leaves no orphan routers holding the ports.
            preexec_fn=terminate_with_parent(),  # the main thread: it lives as long as we do
        )
        for i in range(processes)
    ]
    stopping = threading.Event()

    def forward(signum: int, _frame: object) -> None:
        stopping.set()
        for c in children:
            with contextlib.suppress(ProcessLookupError):
                c.send_signal(signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    try:
        ready = [_ready_fields(c) for c in children]
        if any(r is None for r in ready) or stopping.is_set():
            log.error("a router process did not start; stopping the others")
            forward(signal.SIGTERM, None)
            return max((c.wait() for c in children), default=1) or 1
        first = ready[0] or {}
        metrics_urls = ",".join(r["metrics"] for r in ready if r and "metrics" in r)
        http = f" http={first['http']}" if "http" in first else ""
        line = f"{READY_LINE} address={first['address']} processes={processes}"
        print(f"{line}{http}{f' metrics={metrics_urls}' if metrics_urls else ''}", flush=True)
        for c in children:  # keep their stdout drained (they print nothing more, but may)
            threading.Thread(target=_drain, args=(c,), daemon=True).start()
        codes = [c.wait() for c in children]
    finally:
        for s in held:
            s.close()
    return max(codes, default=0)


def _ready_fields(child: subprocess.Popen[str]) -> dict[str, str] | None:
    """The child's ready line as key=value fields; None if it exited first."""
    assert child.stdout is not None
    for line in child.stdout:
        if line.startswith(READY_LINE):
            return dict(p.split("=", 1) for p in line.split()[1:] if "=" in p)
        sys.stdout.write(line)
    return None


def _drain(child: subprocess.Popen[str]) -> None:
    assert child.stdout is not None
    for line in child.stdout:
        sys.stdout.write(line)
