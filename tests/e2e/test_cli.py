"""The commands a user types: `kvmesh up` in the foreground (with a scheduler profile, printing
every child's metrics URL), `kvmesh generate` and an OpenAI client against it, Ctrl-C stopping
every child."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import openai
import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.e2e

KVMESH = [sys.executable, "-m", "kvmesh.cli"]


def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(url, timeout=5) as resp:
        text = resp.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
    }


def test_up_generate_and_ctrl_c(tiny_model: Path, tmp_path: Path):
    env = {**os.environ, "KVMESH_HOME": str(tmp_path / "home")}
    up = subprocess.Popen(
        [*KVMESH, "up", "--model", str(tiny_model), "--served-model-name", "tiny", "--port", "0",
         "--workers", "1", "--kv-cache-bytes", str(64 << 20), "--max-model-len", "1024",
         "--http-port", "0", "--policy", "round-robin", "--log-dir", str(tmp_path / "logs")],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )  # fmt: skip
    try:
        lines = []
        deadline = time.monotonic() + 240
        assert up.stdout is not None
        while time.monotonic() < deadline:
            line = up.stdout.readline()
            if not line:
                break
            lines.append(line)
            if line.startswith("Ctrl-C stops everything."):
                break
        printed = "".join(lines)
        m = re.search(r"router\s+(127\.0\.0\.1:\d+)", printed)
        assert m, "kvmesh up never printed its router address:\n" + printed
        address = m.group(1)
        base_url = re.search(r"openai\s+(http://\S+/v1)", printed)
        assert base_url, printed
        # Every child's metrics URL, from its ready line.
        metrics = dict(re.findall(r"(\S+)\s+(http://127\.0\.0\.1:\d+/metrics)", printed))
        assert set(metrics) == {"router", "kvmanager", "worker-0"}, printed
        for name, url in metrics.items():
            assert scrape(url), name
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
        # Through the OpenAI front door too; both requests end OK (not CANCELLED), routed by the
        # profile given to kvmesh up.
        with openai.OpenAI(base_url=base_url.group(1), api_key="none", max_retries=0) as c:
            done = c.completions.create(model="tiny", prompt="hello", max_tokens=4)
        assert done.model == "tiny" and done.usage is not None
        router = scrape(metrics["router"])
        decisions = {
            k: v for k, v in router.items() if k[0].startswith("kvmesh_router_routing_decisions")
        }
        assert {dict(k[1])["profile"] for k in decisions} == {"round-robin"}, decisions
        assert router[("kvmesh_router_requests_total", (("code", "OK"), ("model", "tiny")))] == 2
        assert not any(
            k[0] == "kvmesh_router_requests_total" and ("code", "CANCELLED") in k[1] for k in router
        )

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
