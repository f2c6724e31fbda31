"""The router's API key file (``--api-keys-file``): read at start, re-read when it changes
(polled every ``reload_s``, off the event loop) or on ``reload()`` (SIGHUP in ``main.serve``).

YAML, or TOML when the name ends in ``.toml``; the tree is the one ``core.auth.parse_key_table``
reads. A file that cannot be read or parsed at start fails the start (one error line); on a
reload it is logged and the keys in force stay, so a half-written edit locks nobody out."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import tomllib
from pathlib import Path

import yaml

from kvmesh.errors import InvalidArgument

from .core.auth import KeyTable, parse_key_table

log = logging.getLogger(__name__)

_Stamp = tuple[int, int, int, int]  # (device, inode, size, mtime ns): "the file changed"


def read_key_file(path: Path) -> KeyTable:
    """The table in ``path``; ``InvalidArgument`` naming the file when it is unreadable or
    wrong. Blocking: call it off the loop (``KeyFile`` does)."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise InvalidArgument(f"--api-keys-file {path}: {exc.strerror or exc}") from None
    try:
        tree = tomllib.loads(text) if path.suffix == ".toml" else yaml.safe_load(text)
    except (tomllib.TOMLDecodeError, yaml.YAMLError) as exc:
        raise InvalidArgument(f"--api-keys-file {path}: {exc}") from None
    return parse_key_table(tree, str(path))


def _warn_unseeded(table: KeyTable) -> None:
    if not table.seeded and len(table.tenants) > 1:
        log.warning(
            "%s sets no cache_salt_seed: each tenant still has its own cache salt, but one "
            "that follows from its name; add 'cache_salt_seed: <kvmesh auth new-seed>' so it "
            "cannot be guessed (docs/tenants.md)",
            table.source,
        )


def _stamp(path: Path) -> _Stamp | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


class KeyFile:
    """The key table in force (``current()``: what the auth adapters call per request) and the
    task that reloads it. Start with ``await KeyFile.open(path, reload_s)``; ``close()`` stops
    the polling."""

    def __init__(self, path: Path, table: KeyTable, stamp: _Stamp | None, reload_s: float) -> None:
        self.path = path
        self._table = table
        self._stamp = stamp
        self._reload_s = reload_s
        self._task: asyncio.Task[None] | None = None
        self._reloading: asyncio.Task[bool] | None = None
        self.reloads = 0  # tables taken after the first
        self.failed_reloads = 0

    @classmethod
    async def open(cls, path: Path, reload_s: float) -> KeyFile:
        stamp = await asyncio.to_thread(_stamp, path)
        table = await asyncio.to_thread(read_key_file, path)
        keys = cls(path, table, stamp, reload_s)
        log.info(
            "API keys from %s: %d tenants, %d keys", path, len(table.tenants), len(table.by_hash)
        )
        _warn_unseeded(table)
        if reload_s > 0:
            keys._task = asyncio.get_running_loop().create_task(keys._poll(), name="key-file")
        return keys

    def current(self) -> KeyTable:
        return self._table

    def reload(self) -> None:
        """Re-reads the file now, whether or not it looks changed (SIGHUP); one at a time."""
        if self._reloading is None or self._reloading.done():
            self._reloading = asyncio.get_running_loop().create_task(
                self._reload(force=True), name="key-file-reload"
            )

    async def _poll(self) -> None:
        while True:
            await asyncio.sleep(self._reload_s)
            try:
                await self._reload(force=False)
            except Exception:  # a bug here must not stop the reloads
                log.exception("checking the API key file %s failed", self.path)

    async def _reload(self, force: bool) -> bool:
        """True when a new table was taken."""
        stamp = await asyncio.to_thread(_stamp, self.path)
        if not force and stamp == self._stamp:
            return False
        try:
            table = await asyncio.to_thread(read_key_file, self.path)
        except InvalidArgument as exc:
            if stamp != self._stamp or force:
                self.failed_reloads += 1
                log.error("API keys not reloaded; the ones in force stay: %s", exc)
            self._stamp = stamp  # logged once per change, not once per poll
            return False
        self._stamp = stamp
        self._table = table
        self.reloads += 1
        log.info(
            "API keys reloaded from %s: %d tenants, %d keys",
            self.path,
            len(table.tenants),
            len(table.by_hash),
        )
        _warn_unseeded(table)
        return True

    async def close(self) -> None:
        for task in (self._task, self._reloading):
            if task is not None and not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        self._task = self._reloading = None
