"""Makes a private CA and certificates signed by it, for tests, benchmarks and ``kvmesh up
--tls-dir``: not for production (keys are written unencrypted, the CA key beside them).

Uses the ``cryptography`` package (imported here only). ``make_pki(dir)`` writes::

    ca.pem                 the CA certificate (every service's --tls-ca-file)
    ca.key                 its private key (to sign more certificates: ``issue``)
    node.pem / node.key    one certificate for every service of the mesh: server and client
                           use, for the hosts given (default localhost, 127.0.0.1, ::1)
"""

from __future__ import annotations

import datetime
import ipaddress
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DEFAULT_HOSTS = ("localhost", "127.0.0.1", "::1")


@dataclass(frozen=True, slots=True)
class Issued:
    cert_file: Path
    key_file: Path


@dataclass(frozen=True, slots=True)
class Pki:
    """A CA on disk and the node certificate it signed."""

    dir: Path
    ca_file: Path
    ca_key_file: Path
    node: Issued

    def issue(
        self,
        name: str,
        hosts: Sequence[str] = DEFAULT_HOSTS,
        *,
        server: bool = True,
        client: bool = True,
    ) -> Issued:
        """Another certificate from this CA, written as ``<name>.pem`` / ``<name>.key``."""
        ca_cert, ca_key = _load(self.ca_file, self.ca_key_file)
        return _issue(self.dir, name, hosts, ca_cert, ca_key, server=server, client=client)


def make_pki(
    directory: Path, hosts: Sequence[str] = DEFAULT_HOSTS, *, ca_name: str = "kvmesh test CA"
) -> Pki:
    """A fresh CA and a node certificate for ``hosts`` in ``directory`` (created)."""
    x509, hashes, ec, NameOID = _crypto()
    directory.mkdir(parents=True, exist_ok=True)
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, ca_name)])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=365))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    ca_file, ca_key_file = directory / "ca.pem", directory / "ca.key"
    _write(ca_file, ca_key_file, cert, key)
    node = _issue(directory, "node", hosts, cert, key, server=True, client=True)
    return Pki(directory, ca_file, ca_key_file, node)


def _issue(
    directory: Path,
    name: str,
    hosts: Sequence[str],
    ca_cert: Any,
    ca_key: Any,
    *,
    server: bool,
    client: bool,
) -> Issued:
    x509, hashes, ec, NameOID = _crypto()
    from cryptography.x509.oid import ExtendedKeyUsageOID

    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    sans: list[Any] = []
    for host in hosts:
        try:
            sans.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            sans.append(x509.DNSName(host))
    usages = [
        *([ExtendedKeyUsageOID.SERVER_AUTH] if server else []),
        *([ExtendedKeyUsageOID.CLIENT_AUTH] if client else []),
    ]
    builder = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=30))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
            critical=False,
        )
    )
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    cert = builder.sign(ca_key, hashes.SHA256())
    issued = Issued(directory / f"{name}.pem", directory / f"{name}.key")
    _write(issued.cert_file, issued.key_file, cert, key)
    return issued


def _write(cert_file: Path, key_file: Path, cert: Any, key: Any) -> None:
    from cryptography.hazmat.primitives import serialization

    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file.touch(mode=0o600)
    key_file.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )


def _load(cert_file: Path, key_file: Path) -> tuple[Any, Any]:
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    cert = x509.load_pem_x509_certificate(cert_file.read_bytes())
    key = serialization.load_pem_private_key(key_file.read_bytes(), password=None)
    return cert, key


def _crypto() -> tuple[Any, Any, Any, Any]:
    try:
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import NameOID
    except ImportError:  # pragma: no cover - the test extra installs it
        raise RuntimeError(
            "making certificates needs the 'cryptography' package: pip install cryptography "
            "(or make your own with openssl and pass --tls-cert-file/--tls-key-file/--tls-ca-file)"
        ) from None
    return x509, hashes, ec, NameOID
