"""Fixtures for tests on a real etcd: a session-wide etcd, a private one for tests that stop it, a
direct client for checking what is stored, and a TCP proxy to cut a client off while etcd stays
up (a network partition)."""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator

import aetcd
import pytest

from kvmesh.etcd_server import LocalEtcd

from .local_redis import LocalRedis


@pytest.fixture(scope="session")
def etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalEtcd]:
    """One etcd for the session. Tests use their own key prefixes and must not stop it."""
    with LocalEtcd(data_dir=tmp_path_factory.mktemp("etcd")) as server:
        yield server


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalRedis]:
    """One real redis-server for the session (the routers' shared Responses state). Tests use
    their own key prefixes (clusters)."""
    with LocalRedis(tmp_path_factory.mktemp("redis")) as server:
        yield server


@pytest.fixture
def private_etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalEtcd]:
    """An etcd of this test alone, which it may stop, kill and restart."""
    with LocalEtcd(data_dir=tmp_path_factory.mktemp("etcd-private")) as server:
        yield server


@pytest.fixture
async def etcd_client(etcd: LocalEtcd) -> AsyncIterator[aetcd.Client]:
    """A plain aetcd client on the session etcd, to check and change keys behind the adapter."""
    assert etcd.client_port is not None
    client = aetcd.Client(host=etcd.host, port=etcd.client_port, timeout=5)
    yield client
    await client.close()


class TcpProxy:
    """Forwards a loopback port to etcd; ``cut()`` drops every connection and refuses new ones
    until ``resume()`` listens again on the same port."""

    def __init__(self, target_host: str, target_port: int) -> None:
        self.target_host = target_host
        self.target_port = target_port
        self.port = 0
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", self.port)
        self.port = self._server.sockets[0].getsockname()[1]

    async def cut(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None
        for writer in list(self._writers):
            writer.transport.abort()
        self._writers.clear()

    async def resume(self) -> None:
        await self.start()

    async def close(self) -> None:
        await self.cut()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(self.target_host, self.target_port)
        except OSError:
            writer.transport.abort()
            return
        self._writers.update((writer, up_writer))
        pumps = {
            asyncio.create_task(_pump(reader, up_writer)),
            asyncio.create_task(_pump(up_reader, writer)),
        }
        self._tasks.update(pumps)
        try:
            await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in (writer, up_writer):
                w.transport.abort()
                self._writers.discard(w)
            for task in pumps:
                task.cancel()
            await asyncio.gather(*pumps, return_exceptions=True)
            self._tasks.difference_update(pumps)


async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    with contextlib.suppress(ConnectionError, OSError):
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()


@pytest.fixture
async def tcp_proxy(
    etcd: LocalEtcd,
) -> AsyncIterator[Callable[[], Awaitable[TcpProxy]]]:
    """A factory of started proxies to the session etcd; all are closed after the test."""
    proxies: list[TcpProxy] = []

    async def make() -> TcpProxy:
        assert etcd.client_port is not None
        proxy = TcpProxy(etcd.host, etcd.client_port)
        await proxy.start()
        proxies.append(proxy)
        return proxy

    yield make
    for proxy in proxies:
        await proxy.close()


@pytest.fixture(scope="module")
def vllm_env() -> Iterator[None]:
    """The environment the worker gives vLLM (``VLLM_ENVIRONMENT``), for a module's engines
    started in this process; a variable already set wins."""
    from services.worker.main import VLLM_ENVIRONMENT

    with pytest.MonkeyPatch.context() as mp:
        for key, value in VLLM_ENVIRONMENT.items():
            mp.setenv(key, os.environ.get(key, value))
        yield None
