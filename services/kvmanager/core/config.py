"""The KV store's config: tier budgets, the disk directory and the write policy."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from kvmesh.errors import InvalidArgument

GIB = 1 << 30


@dataclass(frozen=True, slots=True)
class StoreConfig:
    cpu_bytes: int = 4 * GIB  # CPU DRAM tier budget, bytes of block payloads
    disk_bytes: int = 64 * GIB  # disk tier budget, bytes of block files (headers, 4 KiB rounding)
    disk_dir: Path | None = None  # directory of the disk tier; None: no disk tier
    write_through: bool = False  # True: put also writes the block to disk before returning
    fsync: bool = False  # True: fsync each block file and its directory (survives power loss)
    io_threads: int = 4  # threads doing disk I/O (reads, writes, deletes, the start-up scan)

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
