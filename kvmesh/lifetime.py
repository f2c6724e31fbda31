"""Processes that must not outlive the process that started them.

A supervisor killed with SIGKILL (an OOM kill, ``kill -9``, a test runner timing out) cannot
stop its children; without help they run on as orphans, holding ports, etcd records and memory.
Two ways here:

- the kernel signals a child when its parent dies (``PR_SET_PDEATHSIG``), asked by the child
  right after the fork (``terminate_with_parent`` as ``preexec_fn``). Linux's rule: the signal
  follows the *thread* that forked the child, so only for children started from a thread that
  lives as long as the parent process (its main thread: the router's supervisor);
- a service started by a launcher that may fork from any thread (``kvmesh up``'s ``Mesh``, the
  tests) watches the launcher's pid itself (``stop_with_parent``, from ``KVMESH_PARENT_PID``).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import select
import signal
import threading
from collections.abc import Callable, Mapping

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1


def signal_on_parent_death(signum: int, parent_pid: int = 0) -> bool:
    """Asks the kernel to send ``signum`` to this process when its parent dies. ``parent_pid``
    (nonzero): the parent expected; if it already died (we were re-parented before asking),
    the signal is sent now. Returns whether it was set up (False off Linux)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, int(signum), 0, 0, 0) != 0:
            return False
    except (OSError, AttributeError):
        return False
    if parent_pid and os.getppid() != parent_pid:
        os.kill(os.getpid(), signum)
    return True


def terminate_with_parent() -> Callable[[], object]:
    """A ``subprocess.Popen(preexec_fn=...)`` for children to be stopped (SIGTERM: they drain
    and exit as on any stop) when this process, the one calling ``Popen``, dies."""
    return functools.partial(signal_on_parent_death, signal.SIGTERM, os.getpid())


PARENT_PID_ENV = "KVMESH_PARENT_PID"
"""Set by a launcher (``kvmesh up``'s ``Mesh``) in its children's environment: the pid whose
exit stops them (``stop_with_parent``)."""


def stop_with_parent(environ: Mapping[str, str] = os.environ) -> bool:
    """In a service's own process: SIGTERM to itself (a stop like any other: drain, leave
    etcd, exit) when the process ``KVMESH_PARENT_PID`` names exits. A pidfd, watched by a
    daemon thread: independent of which thread started this process, no polling, no pid reuse.
    Returns whether a watch started (no variable, or pidfds missing: False)."""
    try:
        pid = int(environ.get(PARENT_PID_ENV) or 0)
    except ValueError:
        return False
    if pid <= 0 or pid == os.getpid():
        return False
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:  # gone before we looked
        os.kill(os.getpid(), signal.SIGTERM)
        return True
    except (OSError, AttributeError):
        return False

    def watch() -> None:
        select.select([fd], [], [])  # readable once ``pid`` has exited
        os.close(fd)
        log.warning("launcher process %d is gone; stopping", pid)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="kvmesh-parent-watch", daemon=True).start()
    return True
