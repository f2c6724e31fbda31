"""Code that runs inside vLLM's engine-core process (loaded there by qualified name).

AsyncLLM always runs its EngineCore in a child process, so anything that must happen in the
process doing the attention math goes through this worker extension and
``AsyncLLM.collective_rpc``. Keep imports light: this module is imported in that process.
"""

from __future__ import annotations

import logging
import os
import signal

log = logging.getLogger(__name__)

EXTENSION_CLS = "services.worker.vllm_ext.KvmeshWorkerExtension"
"""What ``EngineArgs.worker_extension_cls`` is set to."""


class KvmeshWorkerExtension:
    """Mixed into vLLM's worker class; methods are called with ``collective_rpc(name)``."""

    def kvmesh_init_amx(self) -> bool:
        """Asks the kernel for AMX tile permission before the first attention call.

        vLLM's CPU attention kernel uses AMX without asking; in bf16 a first attention call that
        is a short prefill over existing KV then dies with "Illegal instruction". Returns whether
        AMX is available (False also where torch has no such call)."""
        import torch

        init = getattr(getattr(torch._C, "_cpu", None), "_init_amx", None)
        if init is None:
            return False
        try:
            return bool(init())
        except Exception:  # defensive: a torch without AMX support must not stop the engine
            log.warning("torch._C._cpu._init_amx() failed", exc_info=True)
            return False

    def kvmesh_die_with_parent(self, parent_pid: int, worker_pid: int = 0) -> bool:
        """Makes the kernel SIGKILL this (engine core) process when the worker process dies.

        Without it a worker killed with SIGKILL leaves its engine core running as an orphan
        that holds the KV cache memory. Linux only; returns whether it was set up.
        ``parent_pid`` 0: with data-parallel ranks the model runs in a process of each rank's
        engine core (vLLM's multiprocessing executor), whose death it then follows instead;
        and since vLLM's rank engine cores, children of the worker, outlive a SIGKILLed worker
        (seen on vLLM 0.32), ``worker_pid`` (the worker) is watched from here too: when it
        goes, this process kills its parent, the rank's engine core, and the kernel it."""
        from kvmesh.lifetime import signal_on_parent_death

        if not signal_on_parent_death(signal.SIGKILL, parent_pid):
            return False
        if worker_pid and worker_pid != os.getppid():
            return _kill_parent_when_gone(worker_pid)
        return True

    def kvmesh_kv_layout(self) -> str:
        """The layout key of the KV connector in this process (``KvmeshConnector.layout_key``),
        or "" when the engine runs without one."""
        try:
            from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group
        except ImportError:
            return ""
        if not has_kv_transfer_group():
            return ""
        return str(getattr(get_kv_transfer_group(), "layout_key", ""))


def _kill_parent_when_gone(pid: int) -> bool:
    """Starts a daemon thread that SIGKILLs this process's parent when process ``pid`` exits
    (a pidfd: no polling, no pid reuse). False where pidfds are missing (Linux < 5.3)."""
    import select
    import threading

    try:
        fd = os.pidfd_open(pid)
    except (OSError, AttributeError):
        return False
    parent = os.getppid()

    def watch() -> None:
        select.select([fd], [], [])  # readable once ``pid`` has exited
        log.warning("worker process %d is gone; killing engine core %d", pid, parent)
        os.kill(parent, signal.SIGKILL)

    threading.Thread(target=watch, name="kvmesh-worker-watch", daemon=True).start()
    return True
