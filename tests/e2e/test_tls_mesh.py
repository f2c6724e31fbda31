"""The whole mesh on mutual TLS as real processes (``kvmesh up --tls-dir``): a local etcd, a
kvmanager, a vLLM worker on the tiny model and a router, certificates made by the launcher. A
request goes through router and worker over TLS, the engine's KV connector (in vLLM's own
process) saves the prompt's blocks to the kvmanager over TLS, the HTTP front door answers over
HTTPS, and a plaintext client is refused."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import grpc
import pytest

from kvmesh.client import RouterClient, make_request
from kvmesh.launcher import Mesh, MeshSpec
from kvmesh.tls import open_channel
from kvmesh.v1 import kvmanager_pb2, kvmanager_pb2_grpc

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

PROMPT = " ".join(f"word{i}" for i in range(300))  # several full 32-token blocks


@pytest.fixture(scope="module")
def tls_mesh(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    spec = MeshSpec(
        model_path=tiny_model,
        served_model_name="tiny",
        workers=1,
        max_model_len=2048,
        kv_cache_bytes=64 << 20,
        kvmanager_cpu_bytes=64 << 20,
        log_dir=tmp_path_factory.mktemp("tls-mesh"),
        tls_dir=tmp_path_factory.mktemp("tls-certs"),
    )
    with Mesh(spec) as m:
        yield m


async def kvmanager_blocks(mesh: Mesh) -> int:
    assert mesh.kvmanager is not None
    async with open_channel(mesh.kvmanager.ready["address"], mesh.client_tls()) as channel:
        info = await kvmanager_pb2_grpc.KvManagerStub(channel).GetInfo(
            kvmanager_pb2.KvManagerInfoRequest(), timeout=5
        )
    return sum(t.blocks for t in info.tiers)


async def test_a_request_on_mutual_tls_and_the_connector_saves_over_tls(tls_mesh: Mesh):
    assert await kvmanager_blocks(tls_mesh) == 0
    async with RouterClient(tls_mesh.router_address, tls=tls_mesh.client_tls()) as client:
        await client.wait_for_models()
        done = await client.complete(
            make_request(PROMPT, max_tokens=4, temperature=0.0), timeout_s=120
        )
    assert done.usage is not None and done.usage.prompt_tokens > 200
    assert len(done.token_ids) == 4

    # The saver thread sends after the step: poll the kvmanager (eventually() takes a plain
    # predicate; this one is a gRPC call).
    want, blocks = done.usage.prompt_tokens // 32, 0
    deadline = asyncio.get_running_loop().time() + 60
    while (blocks := await kvmanager_blocks(tls_mesh)) < want:
        assert asyncio.get_running_loop().time() < deadline, f"{blocks} of {want} blocks saved"
        await asyncio.sleep(0.2)


async def test_https_front_door_and_a_plaintext_client_refused(tls_mesh: Mesh):
    base = tls_mesh.http_base_url
    assert base.startswith("https://")
    tls = tls_mesh.client_tls()
    assert tls is not None
    connector = aiohttp.TCPConnector(ssl=tls.client_ssl_context())
    async with (
        aiohttp.ClientSession(connector=connector) as session,
        session.get(f"{base}/models", timeout=aiohttp.ClientTimeout(10)) as r,
    ):
        assert r.status == 200
        assert [m["id"] for m in (await r.json())["data"]] == ["tiny"]
    async with RouterClient(tls_mesh.router_address) as plain:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await plain.complete(make_request("hi", max_tokens=1), timeout_s=10)
    assert err.value.code() is grpc.StatusCode.UNAVAILABLE
