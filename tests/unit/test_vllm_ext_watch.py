"""The data-parallel die-with-the-worker guard (``services/worker/vllm_ext.py``) on real
processes: a process that watches the worker's pid kills its own parent (a rank's engine core)
when the worker is SIGKILLed."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(not hasattr(os, "pidfd_open"), reason="needs pidfds (Linux)")

# Plays a rank's engine core: starts its model process (which watches the worker) and idles.
ENGINE_CORE = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", sys.argv[2], sys.argv[1]])
print(child.pid, flush=True)
time.sleep(60)
"""
MODEL_PROCESS = """
import sys, time
from services.worker.vllm_ext import _kill_parent_when_gone
assert _kill_parent_when_gone(int(sys.argv[1]))
print("watching", flush=True)
time.sleep(60)
"""


def test_the_model_process_kills_its_engine_core_when_the_worker_is_killed() -> None:
    worker = subprocess.Popen(["sleep", "60"])
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    core = subprocess.Popen(
        [sys.executable, "-c", ENGINE_CORE, str(worker.pid), MODEL_PROCESS],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    assert core.stdout is not None
    model_pid = int(core.stdout.readline())
    assert core.stdout.readline().strip() == "watching"
    try:
        assert core.poll() is None
        worker.kill()
        worker.wait()
        assert core.wait(timeout=10) == -signal.SIGKILL
    finally:
        for p in (core.pid, model_pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, signal.SIGKILL)
        core.wait()
        core.stdout.close()
        worker.wait()
