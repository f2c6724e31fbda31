"""`kvmesh <service>` (the container image's entrypoint) logs at the service's --log-level: the
CLI must not configure the root logger first, which made the service's own logging setup a no-op
and hid every INFO line in the containers (seen in the first compose run)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_kvmesh_kvmanager_logs_at_info() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    argv = [sys.executable, "-m", "kvmesh.cli", "kvmanager", "--port", "0", "--cpu-bytes", "16MiB"]
    argv += ["--cpu-populate", "off", "--etcd", "127.0.0.1:1", "--metrics-port", "-1"]
    proc = subprocess.Popen(argv, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    assert proc.stderr is not None
    lines: list[str] = []
    deadline = time.monotonic() + 60
    try:
        while time.monotonic() < deadline:
            line = proc.stderr.readline()
            if not line:
                break
            lines.append(line)
            if " INFO kvmanager " in line:
                break
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=30)
    assert any(" INFO kvmanager " in line for line in lines), "".join(lines)
