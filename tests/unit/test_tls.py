"""kvmesh/tls.py: the TLS settings, their flags, and the checks of the certificate files that
make a service's start fail with a line naming the file (real files, made by the test)."""

from __future__ import annotations

import argparse
import ssl
from pathlib import Path

import pytest

from kvmesh.errors import InvalidArgument
from kvmesh.settings import add_config_flags, load_config, options
from kvmesh.tls import TlsConfig
from kvmesh.tlsgen import Pki


def mesh(pki: Pki, **kw: object) -> TlsConfig:
    return TlsConfig(
        cert_file=pki.node.cert_file,
        key_file=pki.node.key_file,
        ca_file=pki.ca_file,
        **kw,  # type: ignore[arg-type]
    )


def test_flags_are_derived_from_the_dataclass() -> None:
    flags = {o.flag for o in options(TlsConfig, "tls-")}
    assert flags == {
        "tls-cert-file",
        "tls-key-file",
        "tls-ca-file",
        "tls-require-client-cert",
        "tls-server-name",
    }


def test_flags_and_environment_build_the_config(pki: Pki) -> None:
    from dataclasses import dataclass

    from kvmesh.settings import setting

    @dataclass(frozen=True, slots=True)
    class Cfg:
        tls: TlsConfig = setting(factory=TlsConfig, doc="TLS", prefix="tls-")

    p = argparse.ArgumentParser()
    opts = add_config_flags(p, Cfg)
    args = p.parse_args(
        ["--tls-cert-file", str(pki.node.cert_file), "--no-tls-require-client-cert"]
    )
    cfg, _ = load_config(p, Cfg, args, opts, {"X_TLS_KEY_FILE": str(pki.node.key_file)}, "X_")
    assert cfg.tls.cert_file == pki.node.cert_file
    assert cfg.tls.key_file == pki.node.key_file
    assert cfg.tls.require_client_cert is False


def test_off_by_default() -> None:
    assert TlsConfig().load() is None
    assert not TlsConfig().enabled


def test_loads_a_mesh_certificate(pki: Pki) -> None:
    tls = mesh(pki).load()
    assert tls is not None and tls.mutual
    assert tls.cert_chain is not None and b"BEGIN CERTIFICATE" in tls.cert_chain
    server, client = tls.server_ssl_context(), tls.client_ssl_context()
    assert server.verify_mode is ssl.CERT_REQUIRED
    assert client.verify_mode is ssl.CERT_REQUIRED and client.check_hostname
    assert not mesh(pki, require_client_cert=False).load().mutual  # type: ignore[union-attr]
    assert tls.server_hostname("10.0.0.1") == "10.0.0.1"
    assert mesh(pki, server_name="node").load().server_hostname("x") == "node"  # type: ignore[union-attr]


def test_cert_without_key_is_a_usage_error(pki: Pki) -> None:
    with pytest.raises(InvalidArgument, match="--tls-cert-file is set but --tls-key-file"):
        TlsConfig(cert_file=pki.node.cert_file)
    with pytest.raises(InvalidArgument, match="--tls-key-file is set but --tls-cert-file"):
        TlsConfig(key_file=pki.node.key_file)


def test_a_service_needs_its_own_certificate(pki: Pki) -> None:
    only_ca = TlsConfig(ca_file=pki.ca_file)
    with pytest.raises(InvalidArgument, match="needs its own certificate and key"):
        only_ca.load()
    client = only_ca.load(serving=False)  # kvmesh generate against a TLS router
    assert client is not None and client.cert_chain is None
    assert client.client_ssl_context().verify_mode is ssl.CERT_REQUIRED


@pytest.mark.parametrize(
    ("which", "content", "message"),
    [
        pytest.param("cert_file", None, "cannot read it: No such file", id="missing-cert"),
        pytest.param("key_file", None, "cannot read it: No such file", id="missing-key"),
        pytest.param("ca_file", None, "cannot read it: No such file", id="missing-ca"),
        pytest.param("cert_file", "dir", "cannot read it: Is a directory", id="cert-is-a-dir"),
        pytest.param("cert_file", b"hello\n", "not a PEM certificate", id="cert-not-pem"),
        pytest.param("key_file", b"hello\n", "not a PEM private key", id="key-not-pem"),
        pytest.param("ca_file", b"hello\n", "not a PEM certificate", id="ca-not-pem"),
        pytest.param(
            "ca_file",
            b"-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n",
            "OpenSSL takes no CA certificate from it",
            id="ca-garbage",
        ),
        pytest.param(
            "cert_file",
            b"-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n",
            "OpenSSL cannot load them",
            id="cert-garbage",
        ),
    ],
)
def test_bad_files_are_named(
    pki: Pki, tmp_path: Path, which: str, content: bytes | str | None, message: str
) -> None:
    bad = tmp_path / f"bad-{which}.pem"
    if content == "dir":
        bad.mkdir()
    elif isinstance(content, bytes):
        bad.write_bytes(content)
    fields = {
        "cert_file": pki.node.cert_file,
        "key_file": pki.node.key_file,
        "ca_file": pki.ca_file,
        which: bad,
    }
    with pytest.raises(InvalidArgument, match=message) as err:
        TlsConfig(**fields).load()  # type: ignore[arg-type]
    assert str(bad) in str(err.value)
    assert f"--tls-{which.replace('_', '-')}" in str(err.value)


def test_a_key_that_is_not_the_certificates(pki: Pki, other_pki: Pki) -> None:
    cfg = TlsConfig(
        cert_file=pki.node.cert_file, key_file=other_pki.node.key_file, ca_file=pki.ca_file
    )
    with pytest.raises(InvalidArgument, match="is not the private key of") as err:
        cfg.load()
    assert str(other_pki.node.key_file) in str(err.value)
    assert str(pki.node.cert_file) in str(err.value)


def test_the_connector_gets_the_files_as_json(pki: Pki) -> None:
    cfg = mesh(pki, server_name="node")
    extra = cfg.to_extra()
    assert all(isinstance(v, str) for v in extra.values())
    assert TlsConfig.from_extra(extra) == cfg
    assert TlsConfig.from_extra({}) == TlsConfig()
    with pytest.raises(InvalidArgument, match="unknown TLS keys"):
        TlsConfig.from_extra({"cert": "x"})


def test_every_service_takes_the_tls_flags_and_the_worker_hands_them_to_its_connector(
    pki: Pki,
) -> None:
    from services.kvmanager.main import parse_args as kvmanager_args
    from services.router.main import parse_args as router_args
    from services.worker.connector.client import StoreConfig
    from services.worker.main import parse_args as worker_args

    files = [
        "--tls-cert-file", str(pki.node.cert_file), "--tls-key-file", str(pki.node.key_file),
        "--tls-ca-file", str(pki.ca_file),
    ]  # fmt: skip
    want = mesh(pki)
    assert router_args(files, {}).tls == want
    assert kvmanager_args(files, {}).tls == want
    worker = worker_args(["--engine", "simulated", "--kvmanager", "127.0.0.1:7", *files], {})
    assert worker.tls == want
    extra = (worker.engine.kv_transfer_config or {})["kv_connector_extra_config"]
    store = StoreConfig.from_extra(extra)
    assert store.tls == want.to_extra()
    tls = store.client_tls()
    assert tls is not None and tls.cert_chain == pki.node.cert_file.read_bytes()
    plain = worker_args(["--engine", "simulated", "--kvmanager", "127.0.0.1:7"], {})
    assert "tls" not in (plain.engine.kv_transfer_config or {})["kv_connector_extra_config"]


def test_every_service_takes_the_etcd_tls_and_user_flags(pki: Pki) -> None:
    from services.kvmanager.main import parse_args as kvmanager_args
    from services.router.main import parse_args as router_args
    from services.worker.main import parse_args as worker_args

    args = [
        "--etcd", "127.0.0.1:2379", "--etcd-ca-file", str(pki.ca_file),
        "--etcd-cert-file", str(pki.node.cert_file), "--etcd-key-file", str(pki.node.key_file),
        "--etcd-user", "kvmesh",
    ]  # fmt: skip
    for parse, env in (
        (router_args, "KVMESH_ROUTER_ETCD_PASSWORD"),
        (kvmanager_args, "KVMESH_KVMANAGER_ETCD_PASSWORD"),
        (lambda a, e: worker_args(["--engine", "simulated", *a], e), "KVMESH_WORKER_ETCD_PASSWORD"),
    ):
        sec = parse(args, {env: "s3cret"}).etcd_security
        assert (sec.ca_file, sec.cert_file, sec.user) == (pki.ca_file, pki.node.cert_file, "kvmesh")
        creds = sec.load()
        assert creds is not None and creds.password == "s3cret" and creds.tls is not None
        assert "s3cret" not in repr(sec) and "s3cret" not in repr(creds)
    with pytest.raises(SystemExit):  # a user without a password: a usage error, exit 2
        router_args(args, {})


def test_kvmesh_up_tls_dir_makes_certificates_and_hands_them_to_every_child(
    tmp_path: Path,
) -> None:
    from kvmesh.cli import _mesh_spec, parse_args
    from kvmesh.launcher import Mesh
    from services.kvmanager.main import parse_args as kvmanager_args
    from services.router.main import parse_args as router_args
    from services.worker.main import parse_args as worker_args

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    certs = tmp_path / "certs"
    a = parse_args(
        ["up", "--model", str(model), "--etcd", "127.0.0.1:2379", "--tls-dir", str(certs)]
    )
    mesh = Mesh(_mesh_spec(a))
    built: dict[str, list[str]] = {}
    mesh._spawn = lambda name, module, args, tag: built.__setitem__(module, args)  # type: ignore[method-assign,assignment,func-returns-value]
    mesh.ensure_certificates()
    want = TlsConfig(
        cert_file=certs / "node.pem", key_file=certs / "node.key", ca_file=certs / "ca.pem"
    )
    assert want.load() is not None  # made, and they load
    mesh.start_router()
    mesh.start_kvmanager()
    mesh.start_worker("worker-0")
    assert router_args(built["services.router.main"], {}).tls == want
    assert kvmanager_args(built["services.kvmanager.main"], {}).tls == want
    worker = built["services.worker.main"]
    assert worker_args(["--engine", "simulated", *worker[2:]], {}).tls == want
    assert mesh.client_tls() is not None
    before = (certs / "ca.pem").read_bytes()
    mesh.ensure_certificates()  # kept: a second `kvmesh up` uses the same CA
    assert (certs / "ca.pem").read_bytes() == before


def test_the_cli_clients_take_tls_flags(pki: Pki, tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    from kvmesh.cli import _client_tls, _etcd_credentials, parse_args

    a = parse_args(["generate", "hi", "--tls-ca-file", str(pki.ca_file)])
    tls = _client_tls(a)
    assert tls is not None and tls.cert_chain is None and tls.root_certs is not None
    assert _client_tls(parse_args(["generate", "hi"])) is None
    s = parse_args(
        ["status", "--tls-ca-file", str(pki.ca_file), "--etcd-ca-file", str(pki.ca_file)]
    )
    creds = _etcd_credentials(s)
    assert creds is not None and creds.tls is not None and _client_tls(s) is not None
    bad = parse_args(["generate", "hi", "--tls-ca-file", str(tmp_path / "none.pem")])
    with pytest.raises(SystemExit) as err:
        _client_tls(bad)
    assert err.value.code == 2
    assert "none.pem: cannot read it" in capsys.readouterr().err
