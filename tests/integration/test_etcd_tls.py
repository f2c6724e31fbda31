"""The services' etcd client on TLS and etcd's users, against a real etcd started with TLS and
client certificate checks (``LocalEtcd(tls=...)``), certificates made by the test: a registrar
and a watcher with the mesh's certificate work; without a certificate, trusting another CA, or
in plaintext they get ``EtcdUnavailable`` within their op timeout saying why; with etcd's users
on, the right password works and a wrong one does not; a kvmanager registers there and
``kvmesh status`` reads it."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvmesh.discovery.client import RotatingClient
from kvmesh.discovery.etcd import EtcdUnavailable, PrefixWatcher, Registrar
from kvmesh.discovery.security import EtcdCredentials, EtcdSecurity
from kvmesh.errors import InvalidArgument
from kvmesh.etcd_server import EtcdServerTls, LocalEtcd, enable_auth
from kvmesh.status import gather
from kvmesh.tls import TlsConfig
from kvmesh.tlsgen import Pki
from services.kvmanager.config import KvManagerConfig
from services.kvmanager.core.config import StoreConfig
from services.kvmanager.main import start_kvmanager
from tests.support import eventually

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


@pytest.fixture(scope="module")
def tls_etcd(pki: Pki, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalEtcd]:
    tls = EtcdServerTls(pki.node.cert_file, pki.node.key_file, pki.ca_file)
    with LocalEtcd(data_dir=tmp_path_factory.mktemp("etcd-tls"), tls=tls) as server:
        yield server


def security(pki: Pki, *, cert: bool = True, **kw: object) -> EtcdSecurity:
    return EtcdSecurity(
        ca_file=pki.ca_file,
        cert_file=pki.node.cert_file if cert else None,
        key_file=pki.node.key_file if cert else None,
        **kw,  # type: ignore[arg-type]
    )


async def register_and_watch(endpoint: str, creds: EtcdCredentials | None, key: str) -> None:
    seen: dict[str, str] = {}
    watcher = PrefixWatcher(
        [endpoint],
        key.rsplit("/", 1)[0] + "/",
        on_snapshot=seen.update,
        on_put=seen.__setitem__,
        on_delete=seen.pop,
        op_timeout_s=2.0,
        credentials=creds,
    )
    registrar = Registrar([endpoint], key, "v1", ttl_s=5, op_timeout_s=2.0, credentials=creds)
    await watcher.start()
    try:
        await registrar.start()
        await eventually(lambda: seen.get(key) == "v1", 10.0, "the watcher sees the key")
        await registrar.update("v2")
        await eventually(lambda: seen.get(key) == "v2", 10.0, "and its update")
    finally:
        await registrar.close(revoke=True)
        await watcher.close()
    await asyncio.sleep(0)


async def test_registrar_and_watcher_over_mutual_tls(tls_etcd: LocalEtcd, pki: Pki):
    assert tls_etcd.client_url.startswith("https://")
    creds = security(pki).load()
    assert creds is not None and creds.tls is not None
    await register_and_watch(tls_etcd.endpoint, creds, "/kvmesh/tls-a/workers/w1")


@pytest.mark.parametrize("who", ["plaintext", "no-certificate", "trusts-other-ca"])
async def test_etcd_refuses_strangers(tls_etcd: LocalEtcd, pki: Pki, other_pki: Pki, who: str):
    creds = {
        "plaintext": None,
        "no-certificate": security(pki, cert=False).load(),
        "trusts-other-ca": security(other_pki).load(),
    }[who]
    registrar = Registrar(
        [tls_etcd.endpoint], "/kvmesh/tls-b/x", "v", ttl_s=5, op_timeout_s=1.0, credentials=creds
    )
    loop = asyncio.get_running_loop()
    began = loop.time()
    with pytest.raises(EtcdUnavailable, match="etcd unreachable"):
        await registrar.start()
    assert loop.time() - began < 3.0
    await registrar.close()


async def test_a_kvmanager_registers_in_a_tls_etcd_and_status_reads_it(
    tls_etcd: LocalEtcd, pki: Pki
):
    mesh_tls = TlsConfig(
        cert_file=pki.node.cert_file, key_file=pki.node.key_file, ca_file=pki.ca_file
    )
    kvm = await start_kvmanager(
        KvManagerConfig(
            kvmanager_id="kvm-tls",
            cluster="tls-status",
            etcd_endpoints=(tls_etcd.endpoint,),
            etcd_security=security(pki),
            store=StoreConfig(cpu_bytes=1 << 20),
            metrics_port=-1,
            drain_grace_s=0.5,
            tls=mesh_tls,
        )
    )
    try:
        status = await gather(
            [tls_etcd.endpoint],
            "tls-status",
            timeout_s=5.0,
            tls=mesh_tls.load(),
            etcd_credentials=security(pki).load(),
        )
        assert [k.kvmanager_id for k in status.kvmanagers] == ["kvm-tls"]
        assert status.kvmanagers[0].reachable, status.kvmanagers[0]
    finally:
        await kvm.stop()


async def test_etcd_users(pki: Pki, tmp_path: Path):
    """etcd with TLS and its users on: the right password works, a wrong one and a certificate
    alone (etcd would take its common name as the user) do not."""
    tls = EtcdServerTls(pki.node.cert_file, pki.node.key_file, pki.ca_file)
    with LocalEtcd(data_dir=tmp_path / "etcd", tls=tls) as etcd:
        client_tls = security(pki).load()
        assert client_tls is not None and client_tls.tls is not None
        await enable_auth(
            etcd.endpoint,
            "root-secret",
            {"kvmesh": "s3cret"},
            channel_credentials=client_tls.tls.channel_credentials(),
        )
        password_file = tmp_path / "etcd-password"
        password_file.write_text("s3cret\n")
        good = security(pki, user="kvmesh", password_file=password_file).load()
        await register_and_watch(etcd.endpoint, good, "/kvmesh/users/workers/w1")
        wrong = security(pki, user="kvmesh", password="nope").load()
        for creds, why in ((wrong, "authentication failed"), (client_tls, "permission denied")):
            conn = RotatingClient([etcd.endpoint], 3.0, creds)  # bcrypt checks take time
            with pytest.raises(EtcdUnavailable, match=why):
                await conn.call_within(lambda c: c.put(b"/kvmesh/users/x", b"v"), "put a key")
            await conn.close()


def test_etcd_settings_are_checked(pki: Pki, tmp_path: Path):
    with pytest.raises(InvalidArgument, match="--etcd-user kvmesh needs its password"):
        EtcdSecurity(user="kvmesh")
    with pytest.raises(InvalidArgument, match="without --etcd-user"):
        EtcdSecurity(password="x")
    with pytest.raises(InvalidArgument, match="--etcd-cert-file is set but --etcd-key-file"):
        EtcdSecurity(cert_file=pki.node.cert_file)
    with pytest.raises(InvalidArgument, match="is https: give --etcd-ca-file"):
        EtcdSecurity().check_endpoints(["https://etcd:2379"])
    with pytest.raises(InvalidArgument, match="is http but"):
        security(pki).check_endpoints(["http://etcd:2379"])
    missing = tmp_path / "none"
    with pytest.raises(InvalidArgument, match=f"--etcd-password-file {missing}: cannot read"):
        EtcdSecurity(user="u", password_file=missing).load()
    with pytest.raises(InvalidArgument, match=f"--etcd-ca-file {missing}: cannot read"):
        EtcdSecurity(ca_file=missing).load()
    assert "s3cret" not in repr(EtcdSecurity(user="u", password="s3cret"))
    assert EtcdSecurity().load() is None
