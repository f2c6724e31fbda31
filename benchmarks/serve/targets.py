"""What ``kvmesh bench serve`` measures: plain ``vllm serve``, and kvmesh meshes, on the same
engine settings. Each target is started, measured and stopped on its own (two would share the
machine's cores), and says which processes are its own so their CPU time can be counted."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from kvmesh.launcher import Mesh, MeshSpec, child_env, tail

REPO = Path(__file__).resolve().parents[2]  # where `python -m benchmarks...` runs


@dataclass(frozen=True, slots=True)
class EngineSettings:
    """The vLLM settings both kinds of target get, so they run the same engine."""

    max_model_len: int = 4096
    block_size: int = 32
    kv_cache_bytes: int = 256 << 20  # per engine
    seed: int = 0
    dtype: str = "auto"  # vLLM's --dtype (on CPUs without AVX-512 BF16, bf16 is slow: float32)


@dataclass(frozen=True, slots=True)
class TargetSpec:
    """One side of the comparison. ``kind``: vllm (``vllm serve``) or kvmesh."""

    label: str
    kind: str
    workers: int = 1
    policy: str = ""  # kvmesh: the router's --policy; empty: the default profile
    kvmanager_cpu_bytes: int = 1 << 30  # kvmesh: the node kvmanager (0: none), as kvmesh up
    colocate: bool = False  # kvmesh: the first worker in the router's process (kvmesh node)
    bind_cpus: bool = True  # kvmesh: engines on cores of their own (kvmesh up --no-cpu-binding)


@dataclass
class Running:
    """A started target: where clients go, and the processes whose CPU time is its cost."""

    spec: TargetSpec
    http_base_url: str  # http://host:port (no /v1)
    grpc_address: str  # kvmesh router's gRPC address; "" for vllm
    served_model: str
    roles: dict[str, list[int]] = field(default_factory=dict)  # role -> pids (children too)
    _stop: list[Callable[[], None]] = field(default_factory=list)

    def stop(self) -> None:
        for stop in reversed(self._stop):
            stop()
        self._stop.clear()


def _descendants(pid: int) -> list[int]:
    """``pid`` and every process below it (from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, ()))
    return out


def _wait_http(url: str, proc: subprocess.Popen[bytes], log: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"vllm serve exited ({proc.returncode}); log:\n{tail(log)}")
        with contextlib.suppress(OSError), urllib.request.urlopen(url, timeout=2) as resp:
            if resp.status == 200:
                return
        time.sleep(1.0)
    raise TimeoutError(f"vllm serve not ready in {timeout_s:.0f} s; log:\n{tail(log)}")


def start_vllm(
    spec: TargetSpec,
    model: Path,
    served: str,
    engine: EngineSettings,
    port: int,
    log_dir: Path,
) -> Running:
    """``vllm serve`` with the engine settings kvmesh's workers use (eager, prefix caching,
    the same block size, context and KV cache bytes)."""
    log = log_dir / f"{spec.label}.log"
    args = [
        sys.executable, "-m", "benchmarks.serve.vllm_entry", "serve", str(model),
        "--served-model-name", served,
        "--host", "127.0.0.1",
        "--port", str(port),
        "--max-model-len", str(engine.max_model_len),
        "--block-size", str(engine.block_size),
        "--kv-cache-memory-bytes", str(engine.kv_cache_bytes),
        "--enforce-eager",
        "--enable-prefix-caching",
        "--seed", str(engine.seed),
        "--dtype", engine.dtype,
        "--disable-uvicorn-access-log",
    ]  # fmt: skip
    logf = open(log, "ab")  # noqa: SIM115 - the server's log, open while it runs (closed by stop)
    proc = subprocess.Popen(
        args,
        stdout=logf,
        stderr=subprocess.STDOUT,
        env={**os.environ, **child_env()},
        cwd=REPO,
        start_new_session=True,
    )

    def stop() -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
        logf.close()

    try:
        _wait_http(f"http://127.0.0.1:{port}/v1/models", proc, log, 600.0)
    except BaseException:
        stop()
        raise
    return Running(
        spec,
        f"http://127.0.0.1:{port}",
        "",
        served,
        {"vllm-api": [proc.pid], "engine": _descendants(proc.pid)[1:]},
        [stop],
    )


def start_kvmesh(
    spec: TargetSpec, model: Path, served: str, engine: EngineSettings, log_dir: Path
) -> Running:
    """A mesh as ``kvmesh up`` starts it (etcd, the node kvmanager, workers, a router)."""
    mesh = Mesh(
        MeshSpec(
            model_path=model,
            served_model_name=served,
            workers=spec.workers,
            max_model_len=engine.max_model_len,
            kv_cache_bytes=engine.kv_cache_bytes,
            block_size=engine.block_size,
            kvmanager_cpu_bytes=spec.kvmanager_cpu_bytes,
            router_policy=spec.policy,
            colocate=spec.colocate,
            bind_cpus=spec.bind_cpus,
            worker_args=(
                "--seed",
                str(engine.seed),
                "--dtype",
                engine.dtype,
            ),
            log_dir=Path(tempfile.mkdtemp(prefix=f"{spec.label}-", dir=log_dir)),
        )
    )
    mesh.start()
    roles: dict[str, list[int]] = {}
    assert mesh.router is not None
    router_pid = mesh.router.proc.pid
    roles["node" if mesh.colocated else "router"] = [router_pid]
    for w in mesh.workers:
        pids = _descendants(w.proc.pid)
        if w.proc.pid != router_pid:
            roles.setdefault("worker", []).append(w.proc.pid)
        roles.setdefault("engine", []).extend(p for p in pids if p != w.proc.pid)
    if mesh.kvmanager is not None:
        roles["kvmanager"] = [mesh.kvmanager.proc.pid]
    base = mesh.http_base_url.removesuffix("/v1")
    return Running(spec, base, mesh.router_address, served, roles, [mesh.stop])


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU seconds so far of the live processes among ``pids``."""
    ticks = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for pid in pids:
        with contextlib.suppress(OSError, IndexError, ValueError):
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / ticks
    return total
