"""The kvmanager's pure config values: the store's (tier budgets, the disk directory, the write
policy) and peer fetch's (data plane, timeouts, window)."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

from kvmesh.errors import InvalidArgument
from kvmesh.settings import setting

GIB = 1 << 30
MIB = 1 << 20


class Populate(StrEnum):
    """When the CPU arena's memory is faulted in."""

    BACKGROUND = "background"  # by a thread from start; blocks use what is ready meanwhile
    START = "start"  # before the store opens (ready means populated: benchmarks, small tiers)
    OFF = "off"  # page by page as blocks first land (RSS grows with use; reused slots fault-free)


class DataPlaneSecurity(StrEnum):
    """What the peer data plane does with the mesh's certificates (with ``--tls-*``; without
    them it is plaintext whatever this says). docs/deploy.md#tls."""

    TLS = "tls"  # mutual TLS for the whole stream: both ends authenticated, bytes encrypted
    AUTH = "auth"  # mutual TLS for the handshake and the ticket, then the blocks in plaintext
    PLAIN = "plain"  # no TLS: the ticket and the blocks in plaintext


@dataclass(frozen=True, slots=True)
class StoreConfig:
    cpu_bytes: int = setting(4 * GIB, "CPU tier budget, bytes of block payloads (e.g. 4GiB)")
    disk_bytes: int = setting(
        64 * GIB, "disk tier budget, bytes of block files (headers, 4 KiB rounding)"
    )
    disk_dir: Path | None = setting(None, "directory of the disk tier; unset: no disk tier")
    write_through: bool = setting(
        False, "write every block to disk as it is stored (off: write back under pressure)"
    )
    fsync: bool = setting(False, "fsync each block file and its directory (survives power loss)")
    io_threads: int = setting(
        4, "threads doing disk I/O (reads, writes, deletes, the start-up scan)"
    )
    cpu_arena: bool = setting(
        True, "RAM blocks in one mapping of --cpu-bytes, slots reused (off: heap buffers, slower)"
    )
    cpu_populate: Populate = setting(
        Populate.BACKGROUND,
        "when the CPU arena is faulted in: background (a thread from start), start (before "
        "serving), off (as blocks land)",
    )

    def __post_init__(self) -> None:
        if self.cpu_bytes < 1:
            raise InvalidArgument(f"cpu_bytes must be >= 1, got {self.cpu_bytes}")
        if self.disk_bytes < 0:
            raise InvalidArgument(f"disk_bytes must be >= 0, got {self.disk_bytes}")
        if self.io_threads < 1:
            raise InvalidArgument(f"io_threads must be >= 1, got {self.io_threads}")

    @property
    def has_disk(self) -> bool:
        return self.disk_dir is not None and self.disk_bytes > 0


@dataclass(frozen=True, slots=True)
class RetentionConfig:
    """Session retention (``core/retention.py``; docs/agents.md#retention)."""

    bytes: int = setting(
        -1,
        "retention budget, bytes of blocks kept for live sessions; -1: a quarter of the disk "
        "tier (of the CPU tier without disk); 0: off; at most half of that tier",
    )
    tenant_bytes: int = setting(0, "each tenant's share of the retention budget; 0: no cap")
    max_ttl_s: float = setting(3600.0, "longest retention a session may ask for, seconds")

    def __post_init__(self) -> None:
        if self.bytes < -1:
            raise InvalidArgument(f"retention bytes must be >= -1, got {self.bytes}")
        if self.tenant_bytes < 0:
            raise InvalidArgument(f"retention tenant_bytes must be >= 0, got {self.tenant_bytes}")
        if not self.max_ttl_s > 0:
            raise InvalidArgument(f"retention max_ttl_s must be > 0, got {self.max_ttl_s}")

    def budget_bytes(self, store: StoreConfig) -> int:
        """The budget for ``store``'s tiers: retained blocks must leave the tier that keeps
        them room to turn over (RAM without disk, else disk), so at most half of it."""
        tier = store.disk_bytes if store.has_disk else store.cpu_bytes
        if self.bytes == -1:
            return tier // 4
        if self.bytes > tier // 2:
            raise InvalidArgument(
                f"retention budget {self.bytes} bytes is over half the "
                f"{'disk' if store.has_disk else 'CPU'} tier ({tier} bytes)"
            )
        return self.bytes


@dataclass(frozen=True, slots=True)
class PeerConfig:
    """Peer fetch: the data plane this kvmanager serves, and how it fetches from others."""

    data_plane_host: str = setting("", "data plane listen address; empty: the gRPC host")
    data_plane_port: int = setting(
        0, "bulk data plane TCP port for peer fetch; 0: the OS picks, -1: off"
    )
    max_streams: int = setting(
        16,
        "peer fetches served at once; more are refused (the peer recomputes)",
        flag="data-plane-max-streams",
    )
    data_plane_security: DataPlaneSecurity = setting(
        DataPlaneSecurity.TLS,
        "with --tls-*: tls, the data plane speaks mutual TLS too (encrypted); auth, mutual TLS "
        "authenticates the peer and carries the ticket, then the blocks follow in plaintext "
        "checked by their checksums (about the plaintext's throughput, not private: "
        "docs/deploy.md#tls); plain, no TLS on it at all",
    )
    ticket_ttl_s: float = setting(
        30.0,
        "default (and at most 10x) life of a granted, unredeemed ticket, seconds",
        flag="peer-ticket-ttl-s",
    )
    open_timeout_s: float = setting(
        5.0, "the most an OpenFetch call to a peer may take, seconds", flag="peer-open-timeout-s"
    )
    stall_timeout_s: float = setting(
        5.0,
        "a peer stream moving no byte this long is given up, either side, seconds",
        flag="peer-stall-timeout-s",
    )
    window_bytes: int = setting(
        32 * MIB,
        "bytes of verified blocks waiting to be stored before a peer read pauses",
        flag="peer-window-bytes",
    )
    fetch_timeout_s: float = setting(
        60.0,
        "deadline of a FetchFromPeer call that sets none, seconds",
        flag="peer-fetch-timeout-s",
    )
    pool_idle_per_peer: int = setting(
        4,
        "auth mode: authenticated data plane connections kept idle per peer between fetches "
        "(no TLS handshake per fetch); 0: a handshake every fetch",
        flag="peer-pool-idle-per-peer",
    )
    pool_idle_timeout_s: float = setting(
        30.0,
        "auth mode: a kept connection idle longer than this is closed, seconds (under the "
        "serving side's 60 s keep-alive)",
        flag="peer-pool-idle-timeout-s",
    )

    def __post_init__(self) -> None:
        if not -1 <= self.data_plane_port <= 65535:
            raise InvalidArgument(
                f"data_plane_port must be in [-1, 65535], got {self.data_plane_port}"
            )
        if self.max_streams < 1:
            raise InvalidArgument(f"max_streams must be >= 1, got {self.max_streams}")
        if self.window_bytes < 1:
            raise InvalidArgument(f"window_bytes must be >= 1, got {self.window_bytes}")
        if self.pool_idle_per_peer < 0:
            raise InvalidArgument(f"pool_idle_per_peer must be >= 0, got {self.pool_idle_per_peer}")
        for name in (
            "ticket_ttl_s",
            "open_timeout_s",
            "stall_timeout_s",
            "fetch_timeout_s",
            "pool_idle_timeout_s",
        ):
            if not getattr(self, name) > 0:
                raise InvalidArgument(f"{name} must be > 0, got {getattr(self, name)}")
