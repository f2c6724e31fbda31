"""The faults of ``kvmesh bench chaos``, one scenario at a time, on a running ``Fleet`` (a
``Mesh`` and a second router beside its own, both on fixed ports so a restarted router comes
back where its clients look for it).

Each scenario is a coroutine that waits ``warmup_s`` (the sessions get going), does its damage,
puts the mesh back the way it found it where it can (a killed worker or etcd is started again),
and returns after ``settle_s`` more of load. Blocking process control runs in a thread, so the
load on the same event loop keeps its pace.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

from kvmesh.etcd_server import free_port
from kvmesh.launcher import Child, Mesh, stop_child


@dataclass(frozen=True, slots=True)
class Timing:
    warmup_s: float = 4.0  # load before the fault
    settle_s: float = 6.0  # load after the mesh is whole again
    pause_s: float = 10.0  # how long a SIGSTOPped process stays stopped (etcd: 20 s)


@dataclass
class Fleet:
    mesh: Mesh
    routers: list[Child]  # mesh.router first
    ports: list[tuple[int, int]]  # each router's (gRPC, HTTP) port

    @classmethod
    def start(cls, mesh: Mesh, routers: int) -> Fleet:
        """``mesh`` must have been started with fixed router ports (``router_port`` and
        ``router_http_port`` in its spec), so that a restarted router is where it was."""
        assert mesh.router is not None
        fleet = cls(mesh, [mesh.router], [(mesh.spec.router_port, mesh.spec.router_http_port)])
        for i in range(1, routers):
            fleet.ports.append((free_port(), free_port()))
            fleet.routers.append(fleet._start_router(i))
        return fleet

    def _start_router(self, i: int) -> Child:
        grpc_port, http_port = self.ports[i]
        child = self.mesh.start_router(
            "router" if i == 0 else f"router-{i}",
            ["--port", str(grpc_port), "--http-port", str(http_port)],
        )
        self.mesh.wait_ready(child, 60.0)
        if i == 0:
            self.mesh.router = child
        return child

    def restart_router(self, i: int, kill: bool = False) -> None:
        old = self.routers[i]
        if kill:
            _signal_group(old, signal.SIGKILL)
            old.proc.wait(30)
        else:
            stop_child(old, grace_s=15.0)
        self.routers[i] = self._start_router(i)

    @property
    def grpc_addresses(self) -> str:
        return ",".join(f"127.0.0.1:{g}" for g, _ in self.ports)

    @property
    def http_base_urls(self) -> list[str]:
        return [f"http://127.0.0.1:{h}/v1" for _, h in self.ports]


def _signal_group(child: Child, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(child.proc.pid, sig)  # its whole group: a worker's engine core too


async def _kill_and_wait(child: Child) -> None:
    _signal_group(child, signal.SIGKILL)
    await asyncio.to_thread(child.proc.wait, 30)


async def none(fleet: Fleet, t: Timing) -> None:
    await asyncio.sleep(t.warmup_s + t.settle_s)


async def kill_worker(fleet: Fleet, t: Timing) -> None:
    """SIGKILL one worker (and its engine core) mid-stream, then start a new one in its place."""
    await _kill_and_replace_worker(fleet, 0, t)


async def _kill_and_replace_worker(fleet: Fleet, i: int, t: Timing) -> None:
    mesh = fleet.mesh
    await asyncio.sleep(t.warmup_s)
    await _kill_and_wait(mesh.workers[i])
    await asyncio.sleep(2.0)
    await asyncio.to_thread(mesh.restart_worker, i)
    await asyncio.sleep(t.settle_s)


async def rolling_restart_workers(fleet: Fleet, t: Timing) -> None:
    """SIGTERM each worker in turn (it drains), a fresh one under the same id before the next."""
    mesh = fleet.mesh
    await asyncio.sleep(t.warmup_s)
    for i in range(len(mesh.workers)):
        await asyncio.to_thread(mesh.restart_worker, i)
        await asyncio.sleep(1.0)
    await asyncio.sleep(t.settle_s)


async def stop_kvmanager(fleet: Fleet, t: Timing) -> None:
    """SIGSTOP the node's kvmanager (a hung daemon: connections open, nothing answered)."""
    mesh = fleet.mesh
    assert mesh.kvmanager is not None, "this scenario needs the kvmanager"
    await asyncio.sleep(t.warmup_s)
    _signal_group(mesh.kvmanager, signal.SIGSTOP)
    try:
        await asyncio.sleep(t.pause_s)
    finally:
        _signal_group(mesh.kvmanager, signal.SIGCONT)
    await asyncio.sleep(t.settle_s)


async def kill_kvmanager(fleet: Fleet, t: Timing) -> None:
    """SIGKILL the node's kvmanager (the workers recompute what it held); a new one on its port
    a pause later, which the workers' connectors reconnect to (its store starts empty). Without
    a fixed ``--port`` in the mesh's kvmanager args it stays down."""
    mesh = fleet.mesh
    assert mesh.kvmanager is not None, "this scenario needs the kvmanager"
    await asyncio.sleep(t.warmup_s)
    await _kill_and_wait(mesh.kvmanager)
    await asyncio.sleep(t.pause_s)
    if "--port" in mesh.spec.kvmanager_args:
        mesh.kvmanager = await asyncio.to_thread(mesh.start_kvmanager)
        await asyncio.to_thread(mesh.wait_ready, mesh.kvmanager, 60.0)
    await asyncio.sleep(t.settle_s)


async def stop_etcd(fleet: Fleet, t: Timing) -> None:
    """SIGSTOP etcd for twice the pause (leases cannot be renewed meanwhile), then SIGCONT."""
    mesh = fleet.mesh
    pid = mesh.etcd.pid if mesh.etcd is not None else None
    assert pid is not None, "this scenario needs the mesh's own etcd"
    await asyncio.sleep(t.warmup_s)
    os.kill(pid, signal.SIGSTOP)
    try:
        await asyncio.sleep(2 * t.pause_s)
    finally:
        os.kill(pid, signal.SIGCONT)
    await asyncio.sleep(t.settle_s)


async def kill_etcd(fleet: Fleet, t: Timing) -> None:
    """SIGKILL etcd, start it again on the same ports and data a pause later."""
    etcd = fleet.mesh.etcd
    assert etcd is not None, "this scenario needs the mesh's own etcd"
    await asyncio.sleep(t.warmup_s)
    await asyncio.to_thread(etcd.kill)
    await asyncio.sleep(t.pause_s)
    await asyncio.to_thread(etcd.start)
    await asyncio.sleep(t.settle_s)


async def kill_router(fleet: Fleet, t: Timing) -> None:
    """SIGKILL the first of two routers under load; a new one on its ports a pause later."""
    assert len(fleet.routers) > 1, "this scenario needs two routers (--routers 2)"
    await asyncio.sleep(t.warmup_s)
    await _kill_and_wait(fleet.routers[0])
    await asyncio.sleep(t.pause_s)
    await asyncio.to_thread(fleet.restart_router, 0)
    await asyncio.sleep(t.settle_s)


async def rolling_restart_routers(fleet: Fleet, t: Timing) -> None:
    """SIGTERM each router in turn (it drains its streams), a new one on its ports before the
    next."""
    assert len(fleet.routers) > 1, "this scenario needs two routers (--routers 2)"
    await asyncio.sleep(t.warmup_s)
    for i in range(len(fleet.routers)):
        await asyncio.to_thread(fleet.restart_router, i)
        await asyncio.sleep(1.0)
    await asyncio.sleep(t.settle_s)


async def kill_decode_worker(fleet: Fleet, t: Timing) -> None:
    """P/D (``--disagg``): SIGKILL a decode worker while requests are handed off to it and
    streamed from it, then start a new one in its place."""
    decode = [i for i, w in enumerate(fleet.mesh.workers) if w.name.startswith("decode-")]
    assert decode, "this scenario needs decode workers (--disagg)"
    await _kill_and_replace_worker(fleet, decode[0], t)


Scenario = Callable[[Fleet, Timing], Coroutine[Any, Any, None]]

# In the order ``--scenarios all`` runs them.
SCENARIOS: dict[str, Scenario] = {
    "kill-worker": kill_worker,
    "rolling-restart-workers": rolling_restart_workers,
    "stop-kvmanager": stop_kvmanager,
    "stop-etcd": stop_etcd,
    "kill-etcd": kill_etcd,
    "kill-router": kill_router,
    "rolling-restart-routers": rolling_restart_routers,
    "kill-kvmanager": kill_kvmanager,
}
# With --disagg (one prefill worker, two decode workers): what ``--scenarios all`` runs there.
PD_SCENARIOS: dict[str, Scenario] = {
    "kill-decode-worker": kill_decode_worker,
    "kill-worker": kill_worker,  # the first worker: the prefill one
}
