"""Several nodes on one machine: each node a Linux network namespace with an address of its own
on a bridge in the root namespace, running its kvmanager and workers (``kvmesh up --nodes N``,
tests/e2e/test_multinode.py, ``benchmarks/kv_peer_fetch_bench.py --netns``).

    root namespace: bridge kvmn<pid>b 10.77.S.1/24 -- etcd, the router (listening there)
      |-- veth kvmn<pid>h0 <-> eth0 in namespace kvmn<pid>-n0, 10.77.S.10: kvmanager, workers
      |-- veth kvmn<pid>h1 <-> eth0 in namespace kvmn<pid>-n1, 10.77.S.11: kvmanager, workers

Between nodes the bytes cross two veth pairs and the bridge: real TCP through the kernel's
stack, with the link's queueing discipline (a ``tc`` qdisc on a node's link, ``NetnsLab.shape``,
shapes what that node sends and receives; ``NetnsLab.shape_pair`` only what two nodes send each
other). Nothing leaves the machine: the bridge has no uplink
and no route outside 10.77.S.0/24 is added.

Names carry the owning process id (``kvmn<pid>``), so runs side by side do not collide and a
run killed with SIGKILL is cleaned up by the next one (``remove_stale``: every ``kvmn*``
namespace and link whose pid is gone, the processes still in them, and the run's etcd and
router in the root namespace, listed in ``PID_DIR``). A normal exit, SIGTERM and SIGINT clean up at once
(atexit and signal handlers). Needs root (CAP_NET_ADMIN) and ``ip``; ``tc`` for shaping.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import logging
import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

from kvmesh.launcher import Child, Mesh, MeshSpec

log = logging.getLogger(__name__)

PREFIX = "kvmn"  # every namespace and link this module makes starts with it
# Pids of a run's processes in the root namespace (etcd, the router), one file per run, for a
# later run to stop when this one was killed with SIGKILL.
PID_DIR = Path("/run/kvmesh-netns")
_OWNED = re.compile(rf"^{PREFIX}(\d+)")


def unavailable_reason() -> str:
    """Why namespaces cannot be made here ('' when they can): the tests' skip reason."""
    if os.geteuid() != 0:
        return "network namespaces need root (CAP_NET_ADMIN)"
    if shutil.which("ip") is None:
        return "no `ip` command (iproute2)"
    probe = f"{PREFIX}{os.getpid()}-probe"
    try:
        _ip("netns", "add", probe)
    except (subprocess.CalledProcessError, OSError) as exc:
        return f"`ip netns add` fails here: {exc}"
    _ip("netns", "delete", probe, check=False)
    return ""


def _run(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, check=check, capture_output=True, text=True, timeout=30)


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return _run("ip", *args, check=check)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale() -> list[str]:
    """Deletes the namespaces and links of runs whose process is gone; returns their names."""
    gone = []
    for name in _ip("netns", "list", check=False).stdout.split():
        m = _OWNED.match(name)
        if m and not _pid_alive(int(m.group(1))):
            _kill_namespace(name)
            _ip("netns", "delete", name, check=False)
            gone.append(name)
    for line in _ip("-o", "link", "show", check=False).stdout.splitlines():
        parts = line.split(":")
        if len(parts) < 2:
            continue
        link = parts[1].strip().split("@")[0]
        m = _OWNED.match(link)
        if m and not _pid_alive(int(m.group(1))):
            _ip("link", "delete", link, check=False)
            gone.append(link)
    for pidfile in PID_DIR.glob(f"{PREFIX}*.pids") if PID_DIR.is_dir() else ():
        m = _OWNED.match(pidfile.name)
        if m and not _pid_alive(int(m.group(1))):
            _kill_listed(pidfile)
            gone.append(pidfile.name)
    if gone:
        log.info("removed stale namespaces, links and processes: %s", ", ".join(gone))
    return gone


def _kill_listed(pidfile: Path) -> None:
    """SIGKILL to each ``pid marker`` line's process whose command line still holds the marker
    (the run's bridge address: a pid reused since is left alone); then the file goes."""
    for line in pidfile.read_text().splitlines():
        pid, _, marker = line.partition(" ")
        with contextlib.suppress(OSError, ValueError):
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            if marker and marker in cmdline:
                with contextlib.suppress(OSError):
                    os.killpg(int(pid), signal.SIGKILL)  # its children too (the router's session)
                os.kill(int(pid), signal.SIGKILL)
    pidfile.unlink(missing_ok=True)


def _kill_namespace(name: str) -> None:
    """SIGKILL to every process in namespace ``name``."""
    pids = _ip("netns", "pids", name, check=False).stdout.split()
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)


@dataclass(frozen=True, slots=True)
class Node:
    name: str  # the namespace's name, also the node's name in the mesh
    address: str  # its eth0 address on the bridge
    host_link: str  # the veth end in the root namespace (on the bridge)


class NetnsLab:
    """A bridge and N namespaces, each with a veth pair onto the bridge. ``up()`` makes them,
    ``down()`` (also at exit and on SIGTERM/SIGINT) removes them."""

    def __init__(self, nodes: int, subnet: int | None = None, handle_signals: bool = True) -> None:
        if not 1 <= nodes <= 200:
            raise ValueError(f"nodes is {nodes}; use 1 to 200")
        pid = os.getpid()
        self.tag = f"{PREFIX}{pid}"
        self.subnet = subnet if subnet is not None else pid % 250  # 10.77.<subnet>.0/24
        self.bridge = f"{self.tag}b"
        self.bridge_address = f"10.77.{self.subnet}.1"
        self.nodes = [
            Node(f"{self.tag}-n{i}", f"10.77.{self.subnet}.{10 + i}", f"{self.tag}h{i}")
            for i in range(nodes)
        ]
        self._up = False
        self._handle_signals = handle_signals  # False: the caller's handlers call down()
        self._prev_handlers: dict[int, object] = {}

    def up(self) -> NetnsLab:
        remove_stale()
        self._up = True
        atexit.register(self.down)
        for sig in (signal.SIGTERM, signal.SIGINT) if self._handle_signals else ():
            with contextlib.suppress(ValueError):  # not the main thread: atexit still runs
                self._prev_handlers[sig] = signal.signal(sig, self._on_signal)
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            _ip("addr", "add", f"{self.bridge_address}/24", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
            for i, node in enumerate(self.nodes):
                inner = f"{self.tag}p{i}"
                _ip("netns", "add", node.name)
                _ip("link", "add", node.host_link, "type", "veth", "peer", "name", inner)
                _ip("link", "set", node.host_link, "master", self.bridge)
                _ip("link", "set", node.host_link, "up")
                _ip("link", "set", inner, "netns", node.name)
                ns = ("netns", "exec", node.name, "ip")
                _ip(*ns, "link", "set", inner, "name", "eth0")
                _ip(*ns, "addr", "add", f"{node.address}/24", "dev", "eth0")
                _ip(*ns, "link", "set", "eth0", "up")
                _ip(*ns, "link", "set", "lo", "up")
        except BaseException:
            self.down()
            raise
        log.info(
            "netns lab up: bridge %s %s, nodes %s",
            self.bridge,
            self.bridge_address,
            ", ".join(f"{n.name} {n.address}" for n in self.nodes),
        )
        return self

    def __enter__(self) -> NetnsLab:
        return self.up()

    def __exit__(self, *exc: object) -> None:
        self.down()

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self.down()
        prev = self._prev_handlers.get(signum)
        if callable(prev):
            prev(signum, frame)
        else:
            raise SystemExit(128 + signum)

    def remove_node(self, node: Node) -> None:
        """The node's whole namespace torn down: SIGKILL to everything in it, its link and the
        namespace deleted (its peers see connections reset, then no route)."""
        _kill_namespace(node.name)
        _ip("link", "delete", node.host_link, check=False)
        _ip("netns", "delete", node.name, check=False)

    def shape(self, node: Node, *qdisc: str) -> None:
        """``tc qdisc replace dev ... root QDISC`` on both ends of the node's link (what it
        sends and what it receives): e.g. ``shape(node, "netem", "delay", "50ms")`` where the
        kernel has ``sch_netem``, ``shape(node, "tbf", "rate", "20mbit", "burst", "32kb",
        "latency", "1s")`` for a slow link where it has ``sch_tbf`` only."""
        for dev, ns in ((node.host_link, ()), ("eth0", ("ip", "netns", "exec", node.name))):
            _run(*ns, "tc", "qdisc", "replace", "dev", dev, "root", *qdisc)

    def shape_pair(self, a: Node, b: Node, rate: str, burst: str = "16kb") -> None:
        """Slows only the link between nodes ``a`` and ``b`` (both ways) to ``rate`` (``tc``
        units: ``512kbit``), leaving each one's traffic with every other node and the root
        namespace as it was: on each one's eth0 an ``htb`` whose default class is unlimited, and
        a class of ``rate`` that a ``u32`` filter gives the packets to the other's address.
        (This kernel has no ``prio`` or ``netem``; ``htb``, ``tbf`` and ``u32`` are built in.)
        ``unshape`` of both nodes removes it."""
        for src, dst in ((a, b), (b, a)):
            ns = ("ip", "netns", "exec", src.name, "tc")
            dev = ("dev", "eth0")
            have = _run(*ns, "qdisc", "show", *dev).stdout
            if "htb 1:" not in have:
                _run(*ns, "qdisc", "replace", *dev, "root", "handle", "1:", "htb", "default", "1")
                _run(*ns, "class", "add", *dev, "parent", "1:", "classid", "1:1", "htb",
                     "rate", "10gbit")  # fmt: skip
            cls = f"1:{100 + self.nodes.index(dst):x}"
            _run(*ns, "class", "replace", *dev, "parent", "1:", "classid", cls, "htb",
                 "rate", rate, "burst", burst)  # fmt: skip
            _run(*ns, "filter", "add", *dev, "parent", "1:", "protocol", "ip", "prio", "1",
                 "u32", "match", "ip", "dst", f"{dst.address}/32", "flowid", cls)  # fmt: skip

    def unshape(self, node: Node) -> None:
        for dev, ns in ((node.host_link, ()), ("eth0", ("ip", "netns", "exec", node.name))):
            _run(*ns, "tc", "qdisc", "del", "dev", dev, "root", check=False)

    def down(self) -> None:
        if not self._up:
            return
        self._up = False
        for node in self.nodes:
            self.remove_node(node)
        _ip("link", "delete", self.bridge, check=False)
        for sig, prev in self._prev_handlers.items():
            with contextlib.suppress(ValueError, TypeError):
                signal.signal(sig, prev)  # type: ignore[arg-type]
        self._prev_handlers.clear()
        with contextlib.suppress(Exception):
            atexit.unregister(self.down)
        log.info("netns lab down: %s", self.tag)


class NodesMesh:
    """A mesh of N nodes on one machine: a ``NetnsLab``, etcd and the router in the root
    namespace on the bridge address (``root``, a ``Mesh`` with no workers and no kvmanager),
    and per node a ``Mesh`` with no router in the node's namespace, its kvmanager and workers
    named after the node and listening on its address (``nodes``). ``spec`` gives every node
    mesh's workers (``workers``, ``prefill_workers``, ``decode_workers``, per node) and the
    router's settings. ``node_roles``: per node (workers, prefill, decode), overriding it."""

    def __init__(
        self,
        spec: MeshSpec,
        nodes: int,
        node_roles: Sequence[tuple[int, int, int]] = (),
        handle_signals: bool = True,
    ) -> None:
        self.spec = spec
        self.lab = NetnsLab(nodes, handle_signals=handle_signals)
        self.log_dir = spec.log_dir or Path(f"/tmp/{self.lab.tag}-logs")
        self.node_roles = (
            list(node_roles) or [(spec.workers, spec.prefill_workers, spec.decode_workers)] * nodes
        )
        if spec.tls_dir is not None:
            raise ValueError(
                "nodes on one machine run in plaintext (certificates name no 10.77 address)"
            )
        if len(self.node_roles) != nodes:
            raise ValueError(f"node_roles has {len(self.node_roles)} entries for {nodes} nodes")
        self.root: Mesh | None = None
        self.nodes: list[Mesh] = []

    def __enter__(self) -> NodesMesh:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        self.lab.up()
        try:
            host = self.lab.bridge_address
            self.root = Mesh(
                dataclasses.replace(
                    self.spec,
                    workers=0,
                    prefill_workers=0,
                    decode_workers=0,
                    kvmanager_cpu_bytes=0,
                    router_host=host,
                    colocate=False,
                    bind_cpus=False,
                    log_dir=self.log_dir / "root",
                )
            )
            self._start_etcd(self.root, host)
            self._write_pids()  # again once the router runs
            endpoints = self.root.etcd_endpoints
            for node, (both, prefill, decode) in zip(self.lab.nodes, self.node_roles, strict=True):
                self.nodes.append(
                    Mesh(
                        dataclasses.replace(
                            self.spec,
                            workers=both,
                            prefill_workers=prefill,
                            decode_workers=decode,
                            etcd_endpoints=endpoints,
                            node=node.name,
                            bind_host=node.address,
                            netns=node.name,
                            router=False,
                            colocate=False,
                            bind_cpus=False,
                            log_dir=self.log_dir / node.name,
                        )
                    )
                )
            # The nodes start side by side (each waits for its engines); the first error wins.
            with ThreadPoolExecutor(len(self.nodes), thread_name_prefix="kvmn-start") as pool:
                for done in [pool.submit(m.start) for m in self.nodes]:
                    done.result()
            self.root.start()  # the router, etcd already up
            self._write_pids()
        except BaseException:
            self.stop()
            raise

    @property
    def pidfile(self) -> Path:
        return PID_DIR / f"{self.lab.tag}.pids"

    def _write_pids(self) -> None:
        root = self.root
        assert root is not None
        pids = [c.proc.pid for c in (root.router,) if c is not None]
        if root.etcd is not None and root.etcd.pid is not None:
            pids.append(root.etcd.pid)
        PID_DIR.mkdir(parents=True, exist_ok=True)
        self.pidfile.write_text("".join(f"{p} {self.lab.bridge_address}\n" for p in pids))

    @staticmethod
    def _start_etcd(root: Mesh, host: str) -> None:
        from kvmesh.etcd_server import LocalEtcd

        root.etcd = LocalEtcd(data_dir=root.log_dir / "etcd", host=host)
        root.etcd.start()
        # The root mesh's spec names that etcd, so start() starts no other one.
        root.spec = dataclasses.replace(root.spec, etcd_endpoints=tuple(root.etcd.endpoints))

    def stop(self) -> None:
        try:
            if self.root is not None and self.root.router is not None:
                from kvmesh.launcher import stop_child

                stop_child(self.root.router, grace_s=15.0)
                self.root.router = None
            for mesh in self.nodes:
                with contextlib.suppress(Exception):
                    mesh.stop()
            if self.root is not None:
                self.root.stop()
        finally:
            self.pidfile.unlink(missing_ok=True)
            self.lab.down()

    def kill_node(self, i: int) -> None:
        """Node ``i``'s namespace torn down (``NetnsLab.remove_node``): its processes get
        SIGKILL, nothing drains."""
        self.lab.remove_node(self.lab.nodes[i])
        for child in self.node_children(i):
            with contextlib.suppress(subprocess.TimeoutExpired):
                child.proc.wait(10)
        self.nodes[i].workers = []
        self.nodes[i].kvmanager = None

    def node_children(self, i: int) -> list[Child]:
        mesh = self.nodes[i]
        return [*mesh.workers, *([mesh.kvmanager] if mesh.kvmanager else [])]

    # What ``kvmesh up`` and the tests read, as on a one-node Mesh.
    @property
    def router(self) -> Child | None:
        return self.root.router if self.root else None

    @property
    def router_address(self) -> str:
        assert self.root is not None
        return self.root.router_address

    @property
    def http_base_url(self) -> str:
        assert self.root is not None
        return self.root.http_base_url

    @property
    def etcd_endpoints(self) -> tuple[str, ...]:
        assert self.root is not None
        return self.root.etcd_endpoints

    def tls_files(self) -> None:
        return None

    @property
    def kvmanager(self) -> Child | None:
        return None  # one per node: ``nodes[i].kvmanager``

    @property
    def workers(self) -> list[Child]:
        return [w for mesh in self.nodes for w in mesh.workers]

    def describe(self) -> str:
        lines = [f"  bridge  {self.lab.bridge} {self.lab.bridge_address}/24"]
        for node, mesh in zip(self.lab.nodes, self.nodes, strict=False):
            kvm = mesh.kvmanager.ready.get("address", "?") if mesh.kvmanager else "none"
            ws = ", ".join(f"{w.name} {w.ready.get('address', '?')}" for w in mesh.workers)
            lines.append(f"  node    {node.name} {node.address}: kvmanager {kvm}; {ws}")
        return "\n".join(lines) + "\n"


def wait_gone(path: Path, timeout_s: float = 10.0) -> bool:
    """Until ``path`` no longer exists (a namespace's /run/netns entry)."""
    deadline = time.monotonic() + timeout_s
    while path.exists():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True
