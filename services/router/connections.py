"""One connection-like object per key (a worker, a kvmanager's layout), tied to an address.

``WorkerPool`` (channels and load streams), ``KvEventSync`` (workers' KV event streams) and
``TierSync`` (kvmanagers' tier event streams) each keep such a map and follow etcd with it: put
a new object when a key appears or its address changes, drop it when the key goes. Closing runs
in the background (a reference is kept) and ``close()`` awaits every close still running.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

K = TypeVar("K")
C = TypeVar("C")


class ConnectionMap(Generic[K, C]):
    def __init__(self, close: Callable[[C], Awaitable[None]]) -> None:
        self._close = close
        self._items: dict[K, tuple[str, C]] = {}
        self._closing: set[asyncio.Task[None]] = set()

    def address(self, key: K) -> str | None:
        entry = self._items.get(key)
        return entry[0] if entry else None

    def get(self, key: K) -> C | None:
        entry = self._items.get(key)
        return entry[1] if entry else None

    def put(self, key: K, address: str, conn: C) -> None:
        """Keeps ``conn`` for ``key``; one it replaces is closed (on the loop)."""
        self.drop(key)
        self._items[key] = (address, conn)

    def drop(self, key: K) -> C | None:
        """Forgets ``key`` and closes its object in the background; returns it (None: none)."""
        entry = self._items.pop(key, None)
        if entry is None:
            return None
        closer = asyncio.get_running_loop().create_task(self._close_one(entry[1]))
        self._closing.add(closer)
        closer.add_done_callback(self._closing.discard)
        return entry[1]

    def items(self) -> list[tuple[K, C]]:
        return [(k, c) for k, (_, c) in self._items.items()]

    def __contains__(self, key: object) -> bool:
        return key in self._items

    def __len__(self) -> int:
        return len(self._items)

    async def close(self) -> None:
        for key in list(self._items):
            self.drop(key)
        if self._closing:
            await asyncio.gather(*self._closing, return_exceptions=True)

    async def _close_one(self, conn: C) -> None:
        await self._close(conn)
