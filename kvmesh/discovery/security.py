"""How a service authenticates to etcd: TLS (the CA etcd's certificate chains to, a client
certificate for etcd's ``--client-cert-auth``) and etcd's own users (``--etcd-user`` with a
password). One frozen config on every service (flags ``--etcd-ca-file``, ``--etcd-cert-file``,
``--etcd-key-file``, ``--etcd-server-name``, ``--etcd-user``, ``--etcd-password`` /
``--etcd-password-file``); ``load()`` reads and checks the files once, at start, and returns
the ``EtcdCredentials`` the etcd client (``client.RotatingClient``) connects with. See
docs/etcd.md#tls-and-authentication."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from kvmesh.errors import InvalidArgument
from kvmesh.settings import setting
from kvmesh.tls import Tls, TlsConfig


@dataclass(frozen=True, slots=True)
class EtcdSecurity:
    """TLS and user of the etcd client; all unset: plaintext, no user (etcd's default)."""

    ca_file: Path | None = setting(
        None, "PEM CA etcd's server certificate chains to: talk TLS to etcd (https)"
    )
    cert_file: Path | None = setting(
        None, "PEM client certificate for etcd (its --client-cert-auth); TLS to etcd"
    )
    key_file: Path | None = setting(None, "PEM private key of --etcd-cert-file")
    server_name: str = setting(
        "", "name etcd's certificate must carry when it is not the endpoint's host"
    )
    user: str = setting("", "etcd user (etcd auth enabled); with its password")
    password: str = dataclasses.field(
        default="",
        repr=False,  # never in a logged config
        metadata=setting(
            "",
            "password of --etcd-user (better in KVMESH_<SERVICE>_ETCD_PASSWORD or "
            "--etcd-password-file than on the command line)",
        ).metadata,
    )
    password_file: Path | None = setting(
        None, "file holding the password of --etcd-user (one line)"
    )

    def __post_init__(self) -> None:
        self.tls_config()  # a certificate without its key (or the reverse) is a usage error
        if self.password and self.password_file is not None:
            raise InvalidArgument("--etcd-password and --etcd-password-file both given; use one")
        has_password = bool(self.password) or self.password_file is not None
        if self.user and not has_password:
            raise InvalidArgument(
                f"--etcd-user {self.user} needs its password: --etcd-password-file FILE (or "
                "--etcd-password, or the environment)"
            )
        if has_password and not self.user:
            raise InvalidArgument("an etcd password is given without --etcd-user: give both")

    @property
    def tls_enabled(self) -> bool:
        return self.ca_file is not None or self.cert_file is not None

    def tls_config(self) -> TlsConfig:
        try:
            return TlsConfig(
                cert_file=self.cert_file,
                key_file=self.key_file,
                ca_file=self.ca_file,
                server_name=self.server_name,
            )
        except InvalidArgument as exc:  # its words name --tls-*: say --etcd-*
            raise InvalidArgument(str(exc).replace("--tls-", "--etcd-")) from None

    def check_endpoints(self, endpoints: Sequence[str]) -> None:
        """An ``https://`` endpoint needs TLS settings, an ``http://`` one must have none."""
        for raw in endpoints:
            text = raw.strip()
            if text.startswith("https://") and not self.tls_enabled:
                raise InvalidArgument(
                    f"etcd endpoint {raw!r} is https: give --etcd-ca-file (the CA of etcd's "
                    "certificate), or write it as host:port for plaintext"
                )
            if text.startswith("http://") and self.tls_enabled:
                raise InvalidArgument(
                    f"etcd endpoint {raw!r} is http but --etcd-ca-file/--etcd-cert-file are "
                    "set: write it as https://host:port or host:port"
                )

    def load(self) -> EtcdCredentials | None:
        """The checked credentials (None: none to use); a bad file is an ``InvalidArgument``
        naming it."""
        if not self.tls_enabled and not self.user:
            return None
        tls = None
        if self.tls_enabled:
            try:
                tls = self.tls_config().load(serving=False)
            except InvalidArgument as exc:
                raise InvalidArgument(str(exc).replace("--tls-", "--etcd-")) from None
        password = self.password
        if self.password_file is not None:
            try:
                lines = self.password_file.read_text().splitlines()
            except (OSError, UnicodeDecodeError) as exc:
                raise InvalidArgument(
                    f"--etcd-password-file {self.password_file}: cannot read it: {exc}"
                ) from None
            password = lines[0] if lines else ""
            if not password:
                raise InvalidArgument(f"--etcd-password-file {self.password_file} is empty")
        return EtcdCredentials(tls, self.user, password)


@dataclass(frozen=True, slots=True)
class EtcdCredentials:
    """What the etcd client connects with: TLS material (None: plaintext) and a user."""

    tls: Tls | None
    user: str = ""
    password: str = dataclasses.field(default="", repr=False)
