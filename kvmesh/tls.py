"""TLS for every hop of the mesh, from certificate files named in the config.

``TlsConfig`` (flags ``--tls-cert-file``, ``--tls-key-file``, ``--tls-ca-file``,
``--[no-]tls-require-client-cert``, ``--tls-server-name`` on every service) says which files;
``TlsConfig.load()`` reads and checks them once, at start, and returns a ``Tls``: what the
gRPC server (``ServiceHost``), every gRPC client (``open_channel`` / ``open_blocking_channel``,
the one place a channel is made), the HTTP front door and the kvmanager's data plane (``ssl``
contexts) take. A file that is missing, unreadable, not PEM, or a key that does not match its
certificate is an ``InvalidArgument`` naming the file (a service's start fails with exit status
2 and that line).

One certificate per service serves both ends: the server presents it, and the same service
presents it as its client certificate when it calls another (mutual TLS). With ``ca_file`` the
other side's certificate must chain to it (servers then also ask clients for one, unless
``require_client_cert`` is off); without it the system's CAs check servers and no client
certificate is asked. See docs/deploy.md#tls.
"""

from __future__ import annotations

import ssl
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from kvmesh.errors import InvalidArgument
from kvmesh.settings import setting

ChannelOptions = Sequence[tuple[str, Any]]


@dataclass(frozen=True, slots=True)
class TlsConfig:
    """Which certificate files a service (or a client) uses; all unset: plaintext."""

    cert_file: Path | None = setting(
        None,
        "PEM certificate (chain) this service presents to its clients and, for mutual TLS, to "
        "the services it calls; with --tls-key-file: TLS on",
    )
    key_file: Path | None = setting(None, "PEM private key of --tls-cert-file")
    ca_file: Path | None = setting(
        None,
        "PEM CA certificate(s) the other side's certificate must chain to (servers then ask "
        "clients for one: mutual TLS); unset: the system's CAs check servers, clients show none",
    )
    require_client_cert: bool = setting(
        True,
        "with --tls-ca-file, refuse clients without a certificate from that CA (mutual TLS); "
        "off: ask clients for none (e.g. a router's front doors for outside clients)",
    )
    server_name: str = setting(
        "",
        "name the servers' certificates must carry instead of the host dialled (one "
        "certificate for many hosts); empty: the host",
    )

    def __post_init__(self) -> None:
        if (self.cert_file is None) != (self.key_file is None):
            given, missing = (
                ("--tls-cert-file", "--tls-key-file")
                if self.cert_file is not None
                else ("--tls-key-file", "--tls-cert-file")
            )
            raise InvalidArgument(
                f"{given} is set but {missing} is not: give the certificate and its private "
                "key together (or neither, for plaintext)"
            )

    @property
    def enabled(self) -> bool:
        """TLS on: a certificate, or (a client alone) a CA to check servers against."""
        return self.cert_file is not None or self.ca_file is not None

    def load(self, serving: bool = True) -> Tls | None:
        """The checked material (None: TLS off). ``serving``: for a service, which needs its
        own certificate; a client alone (``kvmesh generate``) may give only a CA."""
        if not self.enabled:
            return None
        if serving and self.cert_file is None:
            raise InvalidArgument(
                "--tls-ca-file is set without --tls-cert-file and --tls-key-file: a service "
                "needs its own certificate and key to serve TLS"
            )
        chain = key = None
        if self.cert_file is not None and self.key_file is not None:
            chain = _read_pem(self.cert_file, "--tls-cert-file", "CERTIFICATE")
            key = _read_pem(self.key_file, "--tls-key-file", "PRIVATE KEY")
        roots = _read_pem(self.ca_file, "--tls-ca-file", "CERTIFICATE") if self.ca_file else None
        tls = Tls(self, chain, key, roots)
        # Building both contexts checks what reading could not: the key matches the
        # certificate, the CA file holds certificates OpenSSL takes.
        tls.client_ssl_context()
        if chain is not None:
            tls.server_ssl_context()
        return tls

    def to_extra(self) -> dict[str, str]:
        """The files as a JSON-able dict (the KV connector's config, in vLLM's process)."""
        out = {
            name: str(value)
            for name in ("cert_file", "key_file", "ca_file")
            if (value := getattr(self, name)) is not None
        }
        if self.server_name:
            out["server_name"] = self.server_name
        return out

    @classmethod
    def from_extra(cls, extra: dict[str, Any] | None) -> TlsConfig:
        """``to_extra``'s dict back (unknown keys are errors)."""
        extra = dict(extra or {})
        known = {"cert_file", "key_file", "ca_file", "server_name"}
        unknown = sorted(set(extra) - known)
        if unknown:
            raise InvalidArgument(f"unknown TLS keys {unknown}; known: {sorted(known)}")

        def path(name: str) -> Path | None:
            value = extra.get(name)
            return Path(value) if value else None

        return cls(
            cert_file=path("cert_file"),
            key_file=path("key_file"),
            ca_file=path("ca_file"),
            server_name=str(extra.get("server_name", "")),
        )


@dataclass(frozen=True, slots=True)
class Tls:
    """Certificate material read and checked by ``TlsConfig.load``."""

    config: TlsConfig
    cert_chain: bytes | None  # PEM; None: a client without a certificate
    private_key: bytes | None
    root_certs: bytes | None  # PEM CA certificates; None: the system's

    @property
    def mutual(self) -> bool:
        """Servers ask clients for a certificate from ``root_certs`` and refuse those without."""
        return self.root_certs is not None and self.config.require_client_cert

    # ---- gRPC ------------------------------------------------------------------------------
    def server_credentials(self) -> grpc.ServerCredentials:
        if self.cert_chain is None or self.private_key is None:
            raise InvalidArgument("serving TLS needs --tls-cert-file and --tls-key-file")
        return grpc.ssl_server_credentials(
            [(self.private_key, self.cert_chain)],
            root_certificates=self.root_certs if self.mutual else None,
            require_client_auth=self.mutual,
        )

    def channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=self.root_certs,
            private_key=self.private_key,
            certificate_chain=self.cert_chain,
        )

    def channel_options(self) -> list[tuple[str, Any]]:
        name = self.config.server_name
        return [("grpc.ssl_target_name_override", name)] if name else []

    # ---- ssl (the HTTP front door, the kvmanager's data plane) -----------------------------
    def server_ssl_context(self) -> ssl.SSLContext:
        """For a server socket: this service's certificate; with ``mutual``, clients must show
        one from the CA."""
        cfg = self.config
        if cfg.cert_file is None or cfg.key_file is None:
            raise InvalidArgument("serving TLS needs --tls-cert-file and --tls-key-file")
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        _load_chain(ctx, cfg.cert_file, cfg.key_file)
        if self.mutual:
            _load_ca(ctx, self.root_certs, cfg.ca_file)
            ctx.verify_mode = ssl.CERT_REQUIRED
        return ctx

    def client_ssl_context(self) -> ssl.SSLContext:
        """For a client socket: the server's certificate checked against the CA (or the
        system's) and its name; this service's certificate shown when it has one."""
        cfg = self.config
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        if self.root_certs is not None:
            _load_ca(ctx, self.root_certs, cfg.ca_file)
        else:
            ctx.load_default_certs(ssl.Purpose.SERVER_AUTH)
        if cfg.cert_file is not None and cfg.key_file is not None:
            _load_chain(ctx, cfg.cert_file, cfg.key_file)
        return ctx

    def server_hostname(self, host: str) -> str:
        """The name a server at ``host`` must have in its certificate."""
        return self.config.server_name or host


def open_channel(
    address: str,
    tls: Tls | None,
    *,
    options: ChannelOptions = (),
    interceptors: Sequence[grpc.aio.ClientInterceptor] | None = None,
) -> grpc.aio.Channel:
    """A ``grpc.aio`` channel to ``address``: TLS with ``tls`` (mutual when it has a
    certificate), plaintext with None. Every asyncio client in the mesh opens channels here."""
    if tls is None:
        return grpc.aio.insecure_channel(address, options=list(options), interceptors=interceptors)
    return grpc.aio.secure_channel(
        address,
        tls.channel_credentials(),
        options=[*options, *tls.channel_options()],
        interceptors=interceptors,
    )


def open_blocking_channel(
    address: str, tls: Tls | None, *, options: ChannelOptions = ()
) -> grpc.Channel:
    """The same as a synchronous channel (the KV connector's threads in vLLM's process)."""
    if tls is None:
        return grpc.insecure_channel(address, options=list(options))
    return grpc.secure_channel(
        address, tls.channel_credentials(), options=[*options, *tls.channel_options()]
    )


# ---- checks ----------------------------------------------------------------------------------
def _read_pem(path: Path, flag: str, kind: str) -> bytes:
    """The file's bytes, if it holds a PEM block of ``kind`` (CERTIFICATE, ... PRIVATE KEY)."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise InvalidArgument(f"{flag} {path}: cannot read it: {exc.strerror or exc}") from None
    if b"-----BEGIN " not in data or f"{kind}-----".encode() not in data:
        what = "a PEM certificate" if kind == "CERTIFICATE" else "a PEM private key"
        raise InvalidArgument(f"{flag} {path}: not {what} (no '-----BEGIN ...{kind}-----' line)")
    return data


def _load_chain(ctx: ssl.SSLContext, cert: Path, key: Path) -> None:
    try:
        ctx.load_cert_chain(cert, key)
    except ssl.SSLError as exc:
        if "KEY_VALUES_MISMATCH" in str(exc) or "key values mismatch" in str(exc):
            raise InvalidArgument(
                f"--tls-key-file {key} is not the private key of --tls-cert-file {cert}: give "
                "the key the certificate was issued for"
            ) from None
        raise InvalidArgument(
            f"--tls-cert-file {cert} / --tls-key-file {key}: OpenSSL cannot load them: "
            f"{exc.reason or exc} (PEM, unencrypted key)"
        ) from None
    except OSError as exc:
        raise InvalidArgument(
            f"--tls-cert-file {cert} / --tls-key-file {key}: {exc.strerror or exc}"
        ) from None


def _load_ca(ctx: ssl.SSLContext, pem: bytes | None, path: Path | None) -> None:
    try:
        ctx.load_verify_locations(cadata=(pem or b"").decode("ascii", "replace"))
    except (ssl.SSLError, ValueError) as exc:
        raise InvalidArgument(
            f"--tls-ca-file {path}: OpenSSL takes no CA certificate from it: "
            f"{getattr(exc, 'reason', None) or exc}"
        ) from None
