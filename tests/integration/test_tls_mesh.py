"""A mesh on mutual TLS end to end, with certificates the test made: a real etcd, a kvmanager,
a simulated worker (services/worker/sim: a simulator, not an engine) behind the real worker
service and a router, every one serving TLS and calling the others with its certificate.

A request goes client -> router -> worker and back; the router follows the worker's and the
kvmanager's KV event streams; blocks put into the kvmanager become the worker's lower tiers in
the router's index; the connector's kvmanager client saves and loads bytes over TLS; the HTTP
front door serves HTTPS. Clients without a certificate, with one from another CA, trusting
another CA, or speaking plaintext are refused quickly; a bad certificate file stops a service's
start with exit status 2 and a line naming the file."""

from __future__ import annotations

import asyncio
import os
import ssl
import subprocess
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import grpc
import pytest

from kvmesh.client import RouterClient, make_request
from kvmesh.errors import InvalidArgument
from kvmesh.tls import Tls, TlsConfig, open_channel
from kvmesh.tlsgen import Pki
from kvmesh.v1 import kvmanager_pb2, kvmanager_pb2_grpc
from services.kvmanager.config import KvManagerConfig
from services.kvmanager.core.config import StoreConfig
from services.kvmanager.main import RunningKvManager, start_kvmanager
from services.router.config import RouterConfig
from services.router.main import RunningRouter, start_router
from services.worker.config import WorkerConfig
from services.worker.connector.client import StoreConfig as ConnectorStore
from services.worker.connector.client import make_client
from services.worker.connector.kvmanager_client import KvManagerBlockClient
from services.worker.server import RunningWorker, start_worker
from tests.support import eventually

from .test_kvmanager_shm import KEY as CONNECTOR_KEY
from .test_router_kvmanager_tiers import BLOCK_BYTES, HASHES, KEY, LAYOUT, STORE, sim_engine

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

ROOT = Path(__file__).resolve().parents[2]
PROMPT = list(range(1, 20 * 32 + 1))  # the 20 blocks of HASHES


def mesh_tls(pki: Pki, **kw: object) -> TlsConfig:
    return TlsConfig(
        cert_file=pki.node.cert_file,
        key_file=pki.node.key_file,
        ca_file=pki.ca_file,
        **kw,  # type: ignore[arg-type]
    )


def loaded(cfg: TlsConfig, serving: bool = True) -> Tls:
    tls = cfg.load(serving=serving)
    assert tls is not None
    return tls


@dataclass
class Mesh:
    router: RunningRouter
    worker: RunningWorker
    kvm: RunningKvManager
    tls: Tls  # what a mesh member (or a trusted client) presents


@pytest.fixture(scope="module")
async def mesh(etcd, pki: Pki, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Mesh]:
    cluster, endpoints, cfg = "tls", tuple(etcd.endpoints), mesh_tls(pki)
    kvm = await start_kvmanager(
        KvManagerConfig(
            kvmanager_id="kvm-a",
            node="node-a",
            cluster=cluster,
            etcd_endpoints=endpoints,
            store=StoreConfig(cpu_bytes=64 * BLOCK_BYTES),
            drain_grace_s=1.0,
            metrics_port=-1,
            tls=cfg,
        )
    )
    worker = await start_worker(
        WorkerConfig(
            worker_id="a1",
            node="node-a",
            kv_layout=KEY,
            cluster=cluster,
            etcd_endpoints=endpoints,
            drain_grace_s=1.0,
            metrics_port=-1,
            tls=cfg,
        ),
        sim_engine(),
    )
    router = await start_router(
        RouterConfig(
            cluster=cluster,
            etcd_endpoints=endpoints,
            policy="precise-prefix",
            drain_grace_s=1.0,
            http_port=0,
            metrics_port=-1,
            tls=cfg,
        )
    )
    try:
        await eventually(lambda: router.kv_sync.not_live(["a1"]) == [], 15.0, "worker KV stream")
        await eventually(
            lambda: (s := router.tier_sync.stats().get(STORE)) is not None and s[1].live,
            15.0,
            "kvmanager tier stream",
        )
        yield Mesh(router, worker, kvm, loaded(cfg))
    finally:
        await router.stop()
        await worker.stop()
        await kvm.stop()


async def test_a_request_crosses_the_mesh_on_mutual_tls(mesh: Mesh):
    assert mesh.router.address.startswith("127.0.0.1:")
    async with RouterClient(mesh.router.address, tls=mesh.tls) as client:
        done = await client.complete(
            make_request(PROMPT, chat=False, max_tokens=4, model="sim"), timeout_s=30
        )
    assert len(done.token_ids) == 4 and done.usage is not None
    assert done.usage.worker_id == "a1" and done.usage.prompt_tokens == len(PROMPT)


async def test_kvmanager_blocks_reach_the_router_index_over_tls(mesh: Mesh):
    async with open_channel(mesh.kvm.address, mesh.tls) as channel:
        stub = kvmanager_pb2_grpc.KvManagerStub(channel)
        blocks = [
            kvmanager_pb2.KvBlock(block_hash=h, data=bytes([i]) * BLOCK_BYTES)
            for i, h in enumerate(HASHES)
        ]
        resp = await stub.PutBlocks(
            iter([kvmanager_pb2.PutBlocksRequest(layout=LAYOUT, blocks=blocks)]), timeout=10
        )
    assert resp.stored == len(HASHES)

    def lower_tier() -> bool:
        m = mesh.router.index.match(HASHES).get("a1")  # type: ignore[call-overload]
        return m is not None and m.blocks == len(HASHES)

    await eventually(lower_tier, 15.0, "the kvmanager's blocks in the router's index")


async def test_the_connector_saves_and_loads_through_a_tls_kvmanager(mesh: Mesh, pki: Pki):
    store = ConnectorStore(
        store="kvmanager", store_path=mesh.kvm.address, tls=mesh_tls(pki).to_extra()
    )
    client = make_client(store)
    assert isinstance(client, KvManagerBlockClient)
    data = [os.urandom(32 << 10) for _ in range(3)]  # the connector layout's block bytes
    try:
        await asyncio.to_thread(client.save, CONNECTOR_KEY, [71, 72, 73], None, data)
        assert await asyncio.to_thread(client.lookup, CONNECTOR_KEY, [71, 72, 73]) == 3
        got = await asyncio.to_thread(client.load, CONNECTOR_KEY, [71, 72, 73])
        assert [bytes(b) for b in got or []] == data
    finally:
        await asyncio.to_thread(client.close)
    # A plaintext connector gets nothing (and fails nothing): the engine would recompute.
    plain = KvManagerBlockClient(mesh.kvm.address, lookup_timeout_s=2.0, shm_bytes=0)
    try:
        assert await asyncio.to_thread(plain.lookup, CONNECTOR_KEY, [71, 72, 73]) == 0
    finally:
        await asyncio.to_thread(plain.close)


async def test_the_http_front_door_serves_https(mesh: Mesh, pki: Pki):
    http = mesh.router.http
    assert http is not None and http.base_url.startswith("https://127.0.0.1:")
    ok = aiohttp.TCPConnector(ssl=mesh.tls.client_ssl_context())
    timeout = aiohttp.ClientTimeout(5)
    async with (
        aiohttp.ClientSession(connector=ok) as session,
        session.get(f"{http.base_url}/models", timeout=timeout) as r,
    ):
        assert r.status == 200
        assert [m["id"] for m in (await r.json())["data"]] == ["sim"]
    no_cert = loaded(TlsConfig(ca_file=pki.ca_file), serving=False).client_ssl_context()
    plain_url = http.base_url.replace("https://", "http://")
    for url, ctx in ((http.base_url, no_cert), (plain_url, None)):
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=ctx)) as session:
            with pytest.raises(aiohttp.ClientError):
                async with session.get(f"{url}/models", timeout=aiohttp.ClientTimeout(5)) as r:
                    await r.read()


@pytest.mark.parametrize("who", ["plaintext", "no-certificate", "other-ca-cert", "trusts-other-ca"])
async def test_strangers_are_refused_by_the_router(mesh: Mesh, pki: Pki, other_pki: Pki, who):
    tls = {
        "plaintext": None,
        "no-certificate": loaded(TlsConfig(ca_file=pki.ca_file), serving=False),
        "other-ca-cert": loaded(
            TlsConfig(
                cert_file=other_pki.node.cert_file,
                key_file=other_pki.node.key_file,
                ca_file=pki.ca_file,
            )
        ),
        "trusts-other-ca": loaded(mesh_tls(other_pki)),
    }[who]
    async with RouterClient(mesh.router.address, tls=tls) as client:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await client.complete(
                make_request(PROMPT, chat=False, max_tokens=1, model="sim"), timeout_s=5
            )
    assert err.value.code() is grpc.StatusCode.UNAVAILABLE


async def test_a_router_without_tls_cannot_use_the_tls_worker(etcd, mesh: Mesh):
    """Plaintext to TLS services fails cleanly: the worker is known from etcd, its streams
    never go live, requests are refused, nothing hangs."""
    plain = await start_router(
        RouterConfig(
            cluster="tls",
            etcd_endpoints=tuple(etcd.endpoints),
            drain_grace_s=0.5,
            ready_timeout_s=0.5,
            http_port=-1,
            metrics_port=-1,
        )
    )
    try:
        assert len(plain.workers) == 1
        assert plain.kv_sync.not_live(["a1"]) == ["a1"]  # type: ignore[list-item]
        async with RouterClient(plain.address) as client:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await client.complete(
                    make_request(PROMPT, chat=False, max_tokens=1, model="sim"), timeout_s=10
                )
        assert err.value.code() is grpc.StatusCode.UNAVAILABLE
    finally:
        await plain.stop()


async def test_a_bad_certificate_file_fails_the_start(pki: Pki, other_pki: Pki, tmp_path: Path):
    missing = tmp_path / "nope.pem"
    with pytest.raises(InvalidArgument, match=str(missing)):
        await start_router(
            RouterConfig(
                etcd_endpoints=("127.0.0.1:9",),
                tls=TlsConfig(cert_file=missing, key_file=pki.node.key_file),
            )
        )
    proc = await asyncio.to_thread(
        subprocess.run,
        [
            sys.executable, "-m", "services.kvmanager.main", "--etcd", "",
            "--metrics-port", "-1", "--tls-cert-file", str(pki.node.cert_file),
            "--tls-key-file", str(other_pki.node.key_file),
        ],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert f"--tls-key-file {other_pki.node.key_file} is not the private key" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_client_contexts_verify_the_server(pki: Pki):
    ctx = loaded(mesh_tls(pki)).client_ssl_context()
    assert ctx.verify_mode is ssl.CERT_REQUIRED and ctx.check_hostname
