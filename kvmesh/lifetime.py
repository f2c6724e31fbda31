"""Processes that must not outlive the process that started them.

A supervisor killed with SIGKILL (an OOM kill, ``kill -9``, a test runner timing out) cannot
stop its children; without help they run on as orphans, holding ports, etcd records and memory.
The kernel can signal a child when its parent dies (``PR_SET_PDEATHSIG``): the child asks for
it itself, right after the fork (``preexec_fn``) or at start.

Linux's rule: the signal follows the *thread* that forked the child, so start such children
from a thread that lives as long as the parent process does (its main thread).
"""

from __future__ import annotations

import ctypes
import functools
import os
import signal
from collections.abc import Callable

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
