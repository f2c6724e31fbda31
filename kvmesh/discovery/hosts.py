"""Host names as the services publish them: the address others dial, and the node name that
pairs a kvmanager with the workers of its node (both must derive it the same way)."""

from __future__ import annotations

import socket

WILDCARD_HOSTS = ("0.0.0.0", "::", "[::]", "")


def advertised_host(host: str, advertise_host: str) -> str:
    """The host other services dial: explicit, else the listen host unless it is a wildcard."""
    if advertise_host:
        return advertise_host
    return socket.gethostname() if host in WILDCARD_HOSTS else host


def node_name() -> str:
    """This machine's hostname as a valid etcd key segment (letters, digits, '.', '_', '-'):
    the default node of workers and kvmanagers alike."""
    host = "".join(c if c.isalnum() or c in "._-" else "-" for c in socket.gethostname())
    return host.strip(".-_") or "node"
