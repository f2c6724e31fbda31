"""Code that runs inside vLLM's engine-core process (loaded there by qualified name).

AsyncLLM always runs its EngineCore in a child process, so anything that must happen in the
process doing the attention math goes through this worker extension and
``AsyncLLM.collective_rpc``. Keep imports light: this module is imported in that process.
"""

from __future__ import annotations

import ctypes
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

    def kvmesh_die_with_parent(self, parent_pid: int) -> bool:
        """Makes the kernel SIGKILL this (engine core) process when the worker process dies.

        Without it a worker killed with SIGKILL leaves its engine core running as an orphan
        that holds the KV cache memory. Linux only; returns whether it was set up."""
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            pr_set_pdeathsig = 1
            if libc.prctl(pr_set_pdeathsig, int(signal.SIGKILL), 0, 0, 0) != 0:
                return False
        except (OSError, AttributeError):
            return False
        if os.getppid() != parent_pid:  # the parent died before we asked
            os.kill(os.getpid(), signal.SIGKILL)
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
