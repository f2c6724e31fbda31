"""Real kvmanager daemons as child processes (``python -m services.kvmanager.main``, no etcd), as
they run in production: one process per kvmanager, the caller in another."""

from __future__ import annotations

import os
import selectors
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc

from kvmesh.v1 import kvmanager_pb2, kvmanager_pb2_grpc

ROOT = Path(__file__).resolve().parents[2]
GRPC_OPTIONS = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]


@dataclass
class Daemon:
    name: str
    proc: subprocess.Popen[bytes]
    address: str
    channel: grpc.Channel
    stub: kvmanager_pb2_grpc.KvManagerStub
    log_path: Path

    @property
    def port(self) -> int:
        return int(self.address.rsplit(":", 1)[1])

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM and wait: the daemon drains and closes its store (RAM is not written back)."""
        self.channel.close()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log_path.unlink(missing_ok=True)


def start_daemon(
    name: str,
    *,
    cpu_bytes: int,
    disk_dir: Path | None = None,
    disk_bytes: int = 0,
    write_through: bool = False,
    port: int = 0,
    timeout_s: float = 60.0,
) -> Daemon:
    """A kvmanager child process on loopback, ready (its ready line read)."""
    args = [
        sys.executable, "-m", "services.kvmanager.main", "--kvmanager-id", name, "--node", name,
        "--etcd", "", "--metrics-port", "-1", "--port", str(port),
        "--cpu-bytes", str(cpu_bytes), "--log-level", "WARNING", "--cpu-populate", "start",
    ]  # fmt: skip
    if disk_dir is not None:
        args += ["--disk-dir", str(disk_dir), "--disk-bytes", str(disk_bytes)]
    if write_through:
        args.append("--write-through")
    fd, log_name = tempfile.mkstemp(prefix=f"kvmesh-bench-{name}-", suffix=".log")
    log_path = Path(log_name)
    with os.fdopen(fd, "wb") as log_file:
        proc = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.PIPE, stderr=log_file)
    assert proc.stdout is not None
    line = _read_line(proc, timeout_s)
    if not line.startswith("KVMESH_KVMANAGER_READY"):
        proc.kill()
        proc.wait()
        tail = log_path.read_text(errors="replace")[-2000:]
        log_path.unlink(missing_ok=True)
        raise RuntimeError(f"kvmanager {name} did not start ({line!r}):\n{tail}")
    fields = dict(kv.split("=", 1) for kv in line.split()[1:])
    channel = grpc.insecure_channel(fields["address"], options=GRPC_OPTIONS)
    grpc.channel_ready_future(channel).result(timeout=timeout_s)
    stub = kvmanager_pb2_grpc.KvManagerStub(channel)
    return Daemon(name, proc, fields["address"], channel, stub, log_path)


def _read_line(proc: subprocess.Popen[bytes], timeout_s: float) -> str:
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout_s
    buf = b""
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        while b"\n" not in buf:
            left = deadline - time.monotonic()
            if left <= 0 or not sel.select(left):
                return buf.decode(errors="replace")
            chunk = os.read(proc.stdout.fileno(), 4096)
            if not chunk:
                break
            buf += chunk
    return buf.split(b"\n", 1)[0].decode(errors="replace")


def put_blocks(
    daemon: Daemon,
    layout: kvmanager_pb2.KvLayout,
    hashes: Sequence[int],
    blocks: Sequence[bytes],
    batch_bytes: int = 32 << 20,
) -> int:
    """Stores blocks (a chain, in order) over gRPC PutBlocks; returns how many were stored."""

    def gen() -> Iterator[kvmanager_pb2.PutBlocksRequest]:
        msg = kvmanager_pb2.PutBlocksRequest(layout=layout)
        size = 0
        parent: int | None = None
        for h, data in zip(hashes, blocks, strict=True):
            b = msg.blocks.add(block_hash=h, data=data)
            if parent is not None:
                b.parent_hash = parent
            parent = h
            size += len(data)
            if size >= batch_bytes:
                yield msg
                msg, size = kvmanager_pb2.PutBlocksRequest(), 0
        if msg.blocks:
            yield msg

    return daemon.stub.PutBlocks(gen(), timeout=300).stored


def lookup(daemon: Daemon, layout: kvmanager_pb2.KvLayout, hashes: Sequence[int]) -> int:
    """The leading run of ``hashes`` the daemon holds, in blocks."""
    req = kvmanager_pb2.LookupRequest(layout=layout, block_hashes=hashes)
    return len(daemon.stub.Lookup(req, timeout=30).tiers)
