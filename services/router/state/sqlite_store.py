"""Stored responses in an embedded SQLite file (stdlib ``sqlite3``), for one host.

Every call runs on one thread of its own (a one-thread executor: the connection is used by
that thread only, and calls are serialized), never on the event loop. WAL journal: the router
processes of ``--processes`` share the file (readers do not wait for the writer; writers wait
up to the deadline for each other). Expired rows are skipped on read and deleted as new ones
are written."""

from __future__ import annotations

import asyncio
import logging
import sqlite3
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

from kvmesh import errors

from .records import StoredResponse

log = logging.getLogger(__name__)
T = TypeVar("T")

_SCHEMA = (
    "CREATE TABLE IF NOT EXISTS responses ("
    " id TEXT PRIMARY KEY,"
    " expires_at REAL NOT NULL,"
    " meta BLOB NOT NULL,"
    " ids BLOB NOT NULL)",
    "CREATE INDEX IF NOT EXISTS responses_expiry ON responses (expires_at)",
)
PRUNE_EVERY = 64  # writes between deletions of expired rows


class SqliteStore:
    def __init__(self, path: Path, ttl_s: float, timeout_s: float) -> None:
        self.path = path
        self._ttl_s = ttl_s
        self._timeout_s = timeout_s
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="responses-sqlite")
        self._db: sqlite3.Connection | None = None  # opened by the first call, on its thread
        self._writes = 0

    def describe(self) -> str:
        return f"sqlite at {self.path}"

    # ---- on the store's thread -----------------------------------------------------------
    def _conn(self) -> sqlite3.Connection:
        if self._db is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            db = sqlite3.connect(
                self.path, timeout=self._timeout_s, isolation_level=None, check_same_thread=False
            )
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=NORMAL")  # durable across a crash of the process
            for statement in _SCHEMA:
                db.execute(statement)
            self._db = db
            log.info("responses store: %s", self.describe())
        return self._db

    def _put(self, record: StoredResponse) -> None:
        db = self._conn()
        now = time.time()
        db.execute(
            "INSERT OR REPLACE INTO responses (id, expires_at, meta, ids) VALUES (?, ?, ?, ?)",
            (record.id, now + self._ttl_s, record.meta(), record.ids()),
        )
        self._writes += 1
        if self._writes % PRUNE_EVERY == 0:
            db.execute("DELETE FROM responses WHERE expires_at < ?", (now,))

    def _get(self, response_id: str) -> StoredResponse | None:
        row = (
            self._conn()
            .execute(
                "SELECT meta, ids FROM responses WHERE id = ? AND expires_at >= ?",
                (response_id, time.time()),
            )
            .fetchone()
        )
        return None if row is None else StoredResponse.decode(row[0], row[1])

    def _delete(self, response_id: str) -> bool:
        cur = self._conn().execute(
            "DELETE FROM responses WHERE id = ? AND expires_at >= ?", (response_id, time.time())
        )
        return cur.rowcount > 0

    def _close(self) -> None:
        if self._db is not None:
            self._db.close()
            self._db = None

    # ---- on the loop ---------------------------------------------------------------------
    async def _run(self, call: Callable[[], T]) -> T:
        loop = asyncio.get_running_loop()
        try:
            return await asyncio.wait_for(
                loop.run_in_executor(self._executor, call), self._timeout_s
            )
        except TimeoutError:
            raise errors.Unavailable(
                f"the responses store ({self.describe()}) did not answer within "
                f"{self._timeout_s:g} s"
            ) from None
        except (sqlite3.Error, OSError) as exc:
            raise errors.Unavailable(
                f"the responses store ({self.describe()}) failed: {exc}"
            ) from exc

    async def put(self, record: StoredResponse) -> None:
        await self._run(lambda: self._put(record))

    async def get(self, response_id: str) -> StoredResponse | None:
        return await self._run(lambda: self._get(response_id))

    async def delete(self, response_id: str) -> bool:
        return await self._run(lambda: self._delete(response_id))

    async def close(self) -> None:
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(self._executor, self._close)
        self._executor.shutdown(wait=False)
