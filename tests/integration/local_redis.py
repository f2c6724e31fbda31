"""A real redis-server (Debian's ``redis-server``) as a child process on a free loopback port,
for the tests of the routers' shared Responses state: no persistence, its own directory."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path
from types import TracebackType

from kvmesh.etcd_server import free_port

INSTALL_HINT = "install it with `apt-get install redis-server` or run `make setup`"


class LocalRedis:
    def __init__(self, data_dir: Path, host: str = "127.0.0.1") -> None:
        self.host = host
        self.port = 0
        self._dir = data_dir
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://{self.host}:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise FileNotFoundError(f"redis-server not found; {INSTALL_HINT}")
        self.port = free_port(self.host)
        self._dir.mkdir(parents=True, exist_ok=True)
        with (self._dir / "redis.log").open("ab") as log:  # the child keeps its own copy
            self._proc = subprocess.Popen(
                [
                    binary,
                    "--bind",
                    self.host,
                    "--port",
                    str(self.port),
                    "--save",
                    "",
                    "--appendonly",
                    "no",
                    "--dir",
                    str(self._dir),
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(f"redis-server exited; see {self._dir / 'redis.log'}")
            try:
                with socket.create_connection((self.host, self.port), timeout=0.5) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"redis-server did not answer PING within {timeout_s} s")

    def stop(self) -> None:
        if self._proc is not None:
            self._proc.terminate()
            try:
                self._proc.wait(5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
            self._proc = None

    def __enter__(self) -> LocalRedis:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
