"""The service host serving TLS on real gRPC over loopback, with certificates the test made:
mutual TLS lets in a client with the mesh CA's certificate and refuses one without a
certificate, one with another CA's certificate, one trusting another CA, and a plaintext client,
each with UNAVAILABLE within the deadline (no hang)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvmesh.service import Bind, ServiceHost
from kvmesh.tls import Tls, TlsConfig, open_channel
from kvmesh.tlsgen import Pki

pytestmark = pytest.mark.integration


def tls_of(pki: Pki, *, cert: bool = True, ca: Pki | None = None, **kw: object) -> Tls:
    ca_pki = ca or pki
    tls = TlsConfig(
        cert_file=pki.node.cert_file if cert else None,
        key_file=pki.node.key_file if cert else None,
        ca_file=ca_pki.ca_file,
        **kw,  # type: ignore[arg-type]
    ).load(serving=cert)
    assert tls is not None
    return tls


@contextlib.asynccontextmanager
async def host_serving(tls: Tls | None) -> AsyncIterator[ServiceHost]:
    host = ServiceHost(("t.T",), Bind("127.0.0.1", 0), drain_grace_s=0.1, tls=tls)
    async with host.starting():
        await host.start_server()
    try:
        yield host
    finally:
        await host.stop()


async def check(address: str, tls: Tls | None) -> int:
    async with open_channel(address, tls) as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=""), timeout=5
        )
    return int(reply.status)


async def refused(address: str, tls: Tls | None) -> grpc.aio.AioRpcError:
    began = time.monotonic()
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await check(address, tls)
    assert err.value.code() is grpc.StatusCode.UNAVAILABLE, err.value
    assert time.monotonic() - began < 4.5  # refused, not left to time out
    return err.value


async def test_mutual_tls_admits_the_mesh_and_refuses_everyone_else(pki: Pki, other_pki: Pki):
    async with host_serving(tls_of(pki)) as host:
        assert host.tls is not None and host.tls.mutual
        assert await check(host.address, tls_of(pki)) == health_pb2.HealthCheckResponse.SERVING
        await refused(host.address, tls_of(pki, cert=False))  # no client certificate
        # A client certificate from another CA, though the client trusts the server.
        stranger = TlsConfig(
            cert_file=other_pki.node.cert_file,
            key_file=other_pki.node.key_file,
            ca_file=pki.ca_file,
        ).load()
        await refused(host.address, stranger)
        await refused(host.address, tls_of(other_pki))  # trusts another CA: server refused
        await refused(host.address, None)  # plaintext to a TLS port
        # The server still serves the mesh after the strangers.
        assert await check(host.address, tls_of(pki)) == health_pb2.HealthCheckResponse.SERVING


async def test_tls_without_client_certificates(pki: Pki):
    async with host_serving(tls_of(pki, require_client_cert=False)) as host:
        ok = health_pb2.HealthCheckResponse.SERVING
        assert await check(host.address, tls_of(pki, cert=False)) == ok
        assert await check(host.address, tls_of(pki)) == ok
        await refused(host.address, None)


async def test_a_tls_client_to_a_plaintext_server_is_refused(pki: Pki):
    async with host_serving(None) as host:
        await refused(host.address, tls_of(pki))


async def test_server_name_override(pki: Pki, tmp_path):
    """A certificate issued for one name only; clients dial 127.0.0.1 and check that name."""
    from dataclasses import replace

    named = replace(pki, node=pki.issue("named", ["kvmesh-node"]))
    async with host_serving(tls_of(named)) as host:
        await refused(host.address, tls_of(named))  # 127.0.0.1 is not in the certificate
        ok = await check(host.address, tls_of(named, server_name="kvmesh-node"))
        assert ok == health_pb2.HealthCheckResponse.SERVING
