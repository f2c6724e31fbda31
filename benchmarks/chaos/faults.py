"""The faults of ``kvmesh bench chaos``, one scenario at a time, on a running ``Mesh``.

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

from kvmesh.launcher import Child, Mesh


@dataclass(frozen=True, slots=True)
class Timing:
    warmup_s: float = 4.0  # load before the fault
    settle_s: float = 6.0  # load after the mesh is whole again
    pause_s: float = 10.0  # how long a SIGSTOPped process stays stopped (etcd: 20 s)


def _signal_group(child: Child, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(child.proc.pid, sig)  # its whole group: a worker's engine core too


async def _kill_and_wait(child: Child) -> None:
    _signal_group(child, signal.SIGKILL)
    await asyncio.to_thread(child.proc.wait, 30)


async def none(mesh: Mesh, t: Timing) -> None:
    await asyncio.sleep(t.warmup_s + t.settle_s)


async def kill_worker(mesh: Mesh, t: Timing) -> None:
    """SIGKILL one worker (and its engine core) mid-stream, then start a new one in its place."""
    await asyncio.sleep(t.warmup_s)
    await _kill_and_wait(mesh.workers[0])
    await asyncio.sleep(2.0)
    await asyncio.to_thread(mesh.restart_worker, 0)
    await asyncio.sleep(t.settle_s)


async def rolling_restart_workers(mesh: Mesh, t: Timing) -> None:
    """SIGTERM each worker in turn (it drains), a fresh one under the same id before the next."""
    await asyncio.sleep(t.warmup_s)
    for i in range(len(mesh.workers)):
        await asyncio.to_thread(mesh.restart_worker, i)
        await asyncio.sleep(1.0)
    await asyncio.sleep(t.settle_s)


async def stop_kvmanager(mesh: Mesh, t: Timing) -> None:
    """SIGSTOP the node's kvmanager (a hung daemon: connections open, nothing answered)."""
    assert mesh.kvmanager is not None, "this scenario needs the kvmanager"
    await asyncio.sleep(t.warmup_s)
    _signal_group(mesh.kvmanager, signal.SIGSTOP)
    try:
        await asyncio.sleep(t.pause_s)
    finally:
        _signal_group(mesh.kvmanager, signal.SIGCONT)
    await asyncio.sleep(t.settle_s)


async def kill_kvmanager(mesh: Mesh, t: Timing) -> None:
    """SIGKILL the node's kvmanager; it stays down (the workers recompute what it held)."""
    assert mesh.kvmanager is not None, "this scenario needs the kvmanager"
    await asyncio.sleep(t.warmup_s)
    await _kill_and_wait(mesh.kvmanager)
    await asyncio.sleep(t.settle_s + t.pause_s)


async def stop_etcd(mesh: Mesh, t: Timing) -> None:
    """SIGSTOP etcd for twice the pause (leases cannot be renewed meanwhile), then SIGCONT."""
    pid = mesh.etcd.pid if mesh.etcd is not None else None
    assert pid is not None, "this scenario needs the mesh's own etcd"
    await asyncio.sleep(t.warmup_s)
    os.kill(pid, signal.SIGSTOP)
    try:
        await asyncio.sleep(2 * t.pause_s)
    finally:
        os.kill(pid, signal.SIGCONT)
    await asyncio.sleep(t.settle_s)


async def kill_etcd(mesh: Mesh, t: Timing) -> None:
    """SIGKILL etcd, start it again on the same ports and data a pause later."""
    etcd = mesh.etcd
    assert etcd is not None, "this scenario needs the mesh's own etcd"
    await asyncio.sleep(t.warmup_s)
    await asyncio.to_thread(etcd.kill)
    await asyncio.sleep(t.pause_s)
    await asyncio.to_thread(etcd.start)
    await asyncio.sleep(t.settle_s)


Scenario = Callable[[Mesh, Timing], Coroutine[Any, Any, None]]

# In the order ``--scenarios all`` runs them: the kvmanager's death last (it stays down).
SCENARIOS: dict[str, Scenario] = {
    "kill-worker": kill_worker,
    "rolling-restart-workers": rolling_restart_workers,
    "stop-kvmanager": stop_kvmanager,
    "stop-etcd": stop_etcd,
    "kill-etcd": kill_etcd,
    "kill-kvmanager": kill_kvmanager,
}
