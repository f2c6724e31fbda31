"""The commands a user types: `kvmesh up` in the foreground, `kvmesh generate` against it,
Ctrl-C stopping every child."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

pytestmark = pytest.mark.e2e

KVMESH = [sys.executable, "-m", "kvmesh.cli"]


def test_up_generate_and_ctrl_c(tiny_model: Path, tmp_path: Path):
    env = {**os.environ, "KVMESH_HOME": str(tmp_path / "home")}
    up = subprocess.Popen(
        [*KVMESH, "up", "--model", str(tiny_model), "--served-model-name", "tiny", "--port", "0",
         "--workers", "1", "--kv-cache-bytes", str(64 << 20), "--max-model-len", "1024",
         "--log-dir", str(tmp_path / "logs")],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )  # fmt: skip
    try:
        lines = []
        deadline = time.monotonic() + 240
        address = None
        assert up.stdout is not None
        while address is None and time.monotonic() < deadline:
            line = up.stdout.readline()
            if not line:
                break
            lines.append(line)
            m = re.search(r"router\s+(127\.0\.0\.1:\d+)", line)
            if m:
                address = m.group(1)
        assert address, "kvmesh up never printed its router address:\n" + "".join(lines)
        children = psutil.Process(up.pid).children(recursive=True)
        assert len(children) >= 3, "etcd, a worker (with its engine core) and a router"

        gen = subprocess.run(
            [*KVMESH, "generate", "hello there", "--router", address, "--max-tokens", "8",
             "--temperature", "0", "--ignore-eos"],
            capture_output=True,
            text=True,
            timeout=60,
            env=env,
        )  # fmt: skip
        assert gen.returncode == 0, gen.stderr
        assert re.search(
            r"\[usage\] prompt_tokens=\d+ cached_tokens=\d+ output_tokens=8 ", gen.stderr
        )
        assert "worker=worker-0" in gen.stderr

        up.send_signal(signal.SIGINT)  # what Ctrl-C sends
        out, _ = up.communicate(timeout=90)
        assert up.returncode == 0, out
        assert "kvmesh up: stopped" in out
        time.sleep(0.5)
        alive = [c for c in children if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]
        assert not alive, f"children left running: {alive}"
    finally:
        if up.poll() is None:
            up.kill()
            up.wait(10)


def test_generate_help_explains_every_flag():
    out = subprocess.run(
        [*KVMESH, "generate", "--help"], capture_output=True, text=True, check=True
    ).stdout
    for flag in ("--router", "--max-tokens", "--temperature", "--top-p", "--top-k", "--seed", "--stop",
                 "--ignore-eos", "--system", "--raw", "--token-ids", "--session-id", "--timeout-s"):  # fmt: skip
        assert flag in out


def test_generate_without_a_router_fails_clearly(tmp_path: Path):
    gen = subprocess.run(
        [*KVMESH, "generate", "hi", "--router", "127.0.0.1:1", "--timeout-s", "5"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert gen.returncode == 1
    assert "UNAVAILABLE" in gen.stderr
