"""etcd endpoints as settings name them (pure: no aetcd, so the config dataclasses can check
theirs): ``host:port``, ``http://host:port``, ``[v6addr]:port``."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvmesh.errors import InvalidArgument


@dataclass(frozen=True, slots=True)
class Endpoint:
    host: str
    port: int

    def __str__(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


def parse_endpoint(raw: str) -> Endpoint:
    """``host:port``, ``http://host:port`` or ``[v6addr]:port``; the port defaults to 2379."""
    text = raw.strip()
    for scheme in ("http://", "https://"):
        if text.startswith(scheme):
            text = text[len(scheme) :]
    text = text.rstrip("/")
    if text.startswith("["):
        host, sep, rest = text[1:].partition("]")
        port_text = rest[1:] if rest.startswith(":") else ""
        if not sep or (rest and not rest.startswith(":")):
            raise ValueError(f"bad etcd endpoint {raw!r}: expected [addr]:port")
    elif text.count(":") == 1:
        host, _, port_text = text.partition(":")
    elif ":" not in text:
        host, port_text = text, ""
    else:
        raise ValueError(f"bad etcd endpoint {raw!r}: write an IPv6 address as [addr]:port")
    if not host:
        raise ValueError(f"bad etcd endpoint {raw!r}: no host")
    try:
        port = int(port_text) if port_text else 2379
    except ValueError:
        raise ValueError(f"bad etcd endpoint {raw!r}: port {port_text!r} is not a number") from None
    if not 0 < port < 65536:
        raise ValueError(f"bad etcd endpoint {raw!r}: port {port} out of range")
    return Endpoint(host, port)


def parse_endpoints(raws: Sequence[str]) -> tuple[Endpoint, ...]:
    if isinstance(raws, str):
        raise TypeError("endpoints must be a sequence of 'host:port' strings, not one string")
    endpoints = tuple(parse_endpoint(r) for r in raws)
    if not endpoints:
        raise ValueError("no etcd endpoints given")
    return endpoints


def check_etcd_settings(endpoints: Sequence[str], retry_max_s: float) -> None:
    """A config's etcd settings (``etcd_endpoints``, ``etcd_retry_max_s``), checked when the
    config is built, so a bad one is a usage error naming it rather than a failed start."""
    for raw in endpoints:
        parse_endpoint(raw)
    if not retry_max_s > 0:
        raise InvalidArgument(f"--etcd-retry-max-s is {retry_max_s}; use > 0 seconds")
