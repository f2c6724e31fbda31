"""The kvmanager's pure config values: the store's (tier budgets, the disk directory, the write
policy) and peer fetch's (data plane, timeouts, window)."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

from kvmesh.errors import InvalidArgument

GIB = 1 << 30
MIB = 1 << 20


class Populate(StrEnum):
    """When the CPU arena's memory is faulted in."""

    BACKGROUND = "background"  # by a thread from start; blocks use what is ready meanwhile
    START = "start"  # before the store opens (ready means populated: benchmarks, small tiers)
    OFF = "off"  # page by page as blocks first land (RSS grows with use; reused slots fault-free)


@dataclass(frozen=True, slots=True)
class StoreConfig:
    cpu_bytes: int = 4 * GIB  # CPU DRAM tier budget, bytes of block payloads
    disk_bytes: int = 64 * GIB  # disk tier budget, bytes of block files (headers, 4 KiB rounding)
    disk_dir: Path | None = None  # directory of the disk tier; None: no disk tier
    write_through: bool = False  # True: put also writes the block to disk before returning
    fsync: bool = False  # True: fsync each block file and its directory (survives power loss)
    io_threads: int = 4  # threads doing disk I/O (reads, writes, deletes, the start-up scan)
    cpu_arena: bool = True  # RAM blocks live in one mapping of cpu_bytes, slots reused
    cpu_populate: Populate = Populate.BACKGROUND  # when the arena is faulted in

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
class PeerConfig:
    """Peer fetch: the data plane this kvmanager serves, and how it fetches from others."""

    data_plane_host: str = ""  # data plane listen address; empty: the gRPC host
    data_plane_port: int = 0  # data plane TCP port; 0 lets the OS pick, -1 turns serving off
    max_streams: int = 16  # peer fetches served at once; more are refused (the peer recomputes)
    ticket_ttl_s: float = 30.0  # default (and at most 10x) life of a granted, unredeemed ticket
    open_timeout_s: float = 5.0  # the most an OpenFetch call to a peer may take
    stall_timeout_s: float = 5.0  # a stream moving no byte this long is given up, either side
    window_bytes: int = 32 * MIB  # verified blocks waiting to be stored before reading pauses
    fetch_timeout_s: float = 60.0  # deadline of a FetchFromPeer whose caller set none

    def __post_init__(self) -> None:
        if not -1 <= self.data_plane_port <= 65535:
            raise InvalidArgument(
                f"data_plane_port must be in [-1, 65535], got {self.data_plane_port}"
            )
        if self.max_streams < 1:
            raise InvalidArgument(f"max_streams must be >= 1, got {self.max_streams}")
        if self.window_bytes < 1:
            raise InvalidArgument(f"window_bytes must be >= 1, got {self.window_bytes}")
        for name in ("ticket_ttl_s", "open_timeout_s", "stall_timeout_s", "fetch_timeout_s"):
            if not getattr(self, name) > 0:
                raise InvalidArgument(f"{name} must be > 0, got {getattr(self, name)}")
