"""What the KV connector needs from a block store, and how it is chosen from vLLM's config.

A block is one full KV block of the engine (``block_size`` tokens, every layer, K and V) as
bytes; its key is the 64-bit block hash vLLM publishes in its KV events (low 64 bits of the
engine's chained block hash, ``kvmesh.kv.hashing.to_block_hash``). Keys are only meaningful
within one ``layout_key`` (model, block size, layers, KV heads, head size, dtype, TP rank, byte
layout: ``layout.layout_key``), so every call names the layout.

The node's kvmanager daemon (gRPC control + shared memory for the bytes) will implement this
protocol; ``DirectoryBlockClient`` (``directory.py``) implements it over a directory, one file
per block, for tests and single-host use.

Pure: no vLLM, torch or grpc imports (this module is imported in vLLM's engine process).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from kvmesh.kv.events import Tier

if TYPE_CHECKING:  # kvmesh.tls imports grpc: only where a client is made
    from kvmesh.tls import Tls

BlockBytes = bytes | bytearray | memoryview


@runtime_checkable
class KvBlockClient(Protocol):
    """A block store as the connector sees it. Implementations must be safe to call from two
    threads at once (the engine thread looks up and loads, the connector's saver thread saves).
    None of the calls may raise for a store that is down: they report "nothing" instead (the
    connector also catches exceptions, as a last resort, and treats them as misses)."""

    def lookup(self, layout_key: str, block_hashes: Sequence[int]) -> int:
        """How many leading blocks of ``block_hashes`` (a prompt's chain, in order) the store
        can supply now. Called on the scheduler's thread once per new request (keep it fast: it
        delays the request's first step), and on the saver thread before each save."""
        ...

    def load(self, layout_key: str, block_hashes: Sequence[int]) -> list[BlockBytes] | None:
        """The bytes of ``block_hashes``, in order. None, or a list shorter than asked, means
        the blocks from there on could not be supplied (the engine recomputes them). Called on
        the engine thread just before the forward pass that needs them."""
        ...

    def save(
        self,
        layout_key: str,
        block_hashes: Sequence[int],
        parent_hash: int | None,
        blocks: Sequence[BlockBytes],
    ) -> None:
        """Stores ``blocks`` under ``block_hashes``: consecutive blocks of one chain whose first
        block follows ``parent_hash`` (None: the chain's first block). Blocks the store already
        has may be skipped. Called only from the connector's saver thread, never from the
        engine step, so it may block (it should still finish in bounded time)."""
        ...

    def discard(self, layout_key: str, block_hashes: Sequence[int]) -> None:
        """Drops ``block_hashes``: the connector found their bytes unusable (wrong size for the
        layout). Rare; called on the engine thread after a failed load."""
        ...

    def close(self) -> None:
        """Releases resources; called once when the engine shuts down."""
        ...


@runtime_checkable
class TieredLookup(Protocol):
    """A store that also says where each block it holds lives (optional: the connector reports
    the blocks of a store without it as CPU)."""

    def lookup_tiers(self, layout_key: str, block_hashes: Sequence[int]) -> list[Tier]:
        """``lookup`` with the tier of each leading block held: its length is the answer of
        ``lookup``. Same rules (fast, never raises)."""
        ...


@dataclass(frozen=True, slots=True)
class SaveChain:
    """Consecutive blocks of one chain for ``BatchedSave.save_chains``: the first follows
    ``parent_hash`` (None: the chain's first block)."""

    block_hashes: Sequence[int]
    parent_hash: int | None
    blocks: Sequence[BlockBytes]


@runtime_checkable
class BatchedSave(Protocol):
    """A store that takes the blocks of many chains in one call and skips, by itself, the
    blocks it already holds (optional). The saver then sends everything queued in one call,
    without a lookup first: on a local kvmanager every call is a gRPC round trip whose CPU is
    taken from the engines' node (issue 11: two calls per chain per engine step before)."""

    def save_chains(self, layout_key: str, chains: Sequence[SaveChain]) -> int:
        """Stores every chain (same rules as ``KvBlockClient.save``); returns how many of the
        blocks the store held already. Saver thread only; may block (bounded)."""
        ...


@dataclass(frozen=True, slots=True)
class StoreConfig:
    """``kv_connector_extra_config`` of ``KvmeshConnector``. Unknown keys are errors."""

    store: str = "directory"
    """Which client: ``directory`` (``DirectoryBlockClient`` at ``store_path``), ``kvmanager``
    (``KvManagerBlockClient``: the node's kvmanager at ``store_path`` = host:port) or
    ``factory`` (``client_factory`` builds it)."""
    store_path: str = ""
    """The directory of the ``directory`` store; shared by every engine that should share KV."""
    client_factory: str = ""
    """``module:callable`` taking this ``StoreConfig`` and returning a ``KvBlockClient`` (for
    ``store=factory``: the kvmanager client, test doubles)."""
    max_pending_save_bytes: int = 256 * 1024 * 1024
    """Bytes of copied-out blocks waiting for the saver thread; a save that does not fit is
    skipped (never waited for)."""
    save_interval_s: float = 0.05
    """Least time between two saves to the kvmanager: the blocks copied out meanwhile (many
    engine steps' worth) go in one call, since each call costs the engine's process and the
    kvmanager a fixed few hundred microseconds of CPU. A block reaches the node's store (and the
    routers' view of it) at most this much later; the engine's own prefix cache has it at once.
    0: a call as soon as the saver thread is free."""
    remembered_saves: int = 65536
    """Block keys the worker remembers having handed to the store, so that blocks shared by many
    requests are copied out once."""
    save: bool = True
    """Offload computed blocks (also needs ``kv_role`` kv_producer or kv_both)."""
    load: bool = True
    """Load blocks from the store (also needs ``kv_role`` kv_consumer or kv_both)."""
    tls: Mapping[str, str] | None = None
    """The kvmanager's TLS: ``kvmesh.tls.TlsConfig.to_extra()`` (cert_file, key_file,
    ca_file, server_name: the worker's certificate, shown for mutual TLS); None: plaintext."""

    def __post_init__(self) -> None:
        if self.store not in ("directory", "factory", "kvmanager"):
            raise ValueError(
                f"store must be 'directory', 'kvmanager' or 'factory', got {self.store!r}"
            )
        if self.store == "kvmanager" and ":" not in self.store_path:
            raise ValueError("store 'kvmanager' needs store_path = the kvmanager's host:port")
        if self.store == "directory" and not self.store_path:
            raise ValueError("store 'directory' needs store_path (a directory shared by engines)")
        if self.store == "factory" and ":" not in self.client_factory:
            raise ValueError("store 'factory' needs client_factory as 'module:callable'")
        if self.max_pending_save_bytes < 0 or self.remembered_saves < 0:
            raise ValueError("max_pending_save_bytes and remembered_saves must be >= 0")
        if not 0 <= self.save_interval_s <= 10:
            raise ValueError(f"save_interval_s must be 0-10 seconds, not {self.save_interval_s}")

    def client_tls(self) -> Tls | None:
        """The checked TLS material of ``tls`` (None: plaintext)."""
        from kvmesh.tls import TlsConfig

        return TlsConfig.from_extra(dict(self.tls or {})).load(serving=False)

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any] | None) -> StoreConfig:
        """Parses vLLM's ``kv_connector_extra_config``."""
        extra = dict(extra or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(extra) - known)
        if unknown:
            raise ValueError(
                f"unknown kv_connector_extra_config keys for KvmeshConnector: {unknown}; "
                f"known: {sorted(known)}"
            )
        return cls(**extra)


def make_client(config: StoreConfig) -> KvBlockClient:
    """The client ``config`` names."""
    if config.store == "directory":
        from .directory import DirectoryBlockClient

        return DirectoryBlockClient(config.store_path)
    if config.store == "kvmanager":
        from .kvmanager_client import KvManagerBlockClient

        return KvManagerBlockClient(config.store_path, tls=config.client_tls())
    module_name, _, attr = config.client_factory.partition(":")
    factory: Callable[[StoreConfig], KvBlockClient] = getattr(
        importlib.import_module(module_name), attr
    )
    client = factory(config)
    if not isinstance(client, KvBlockClient):
        raise TypeError(f"{config.client_factory} returned {type(client).__name__}, not a client")
    return client
