"""kvmesh's vLLM KV connector: offloads full KV blocks to a block store and loads them back.

- ``connector.py``: ``KvmeshConnector`` (vLLM's ``KVConnectorBase_V1``; imports vLLM and torch,
  so only vLLM imports it, by the module path below);
- ``client.py``: the ``KvBlockClient`` protocol the connector talks to, and its config;
- ``directory.py``: ``DirectoryBlockClient``, one file per block in a shared directory;
- ``plan.py``: the scheduler side's per-request bookkeeping (pure);
- ``saver.py``: the background saver with its bounded queue;
- ``layout.py``: the layout key (which engines may share block bytes).

See docs/connector.md. This package's ``__init__`` imports neither vLLM nor torch.
"""

from __future__ import annotations

from typing import Any

from .client import KvBlockClient, StoreConfig, make_client
from .directory import DirectoryBlockClient
from .layout import BlockLayout, parse_layout_key

CONNECTOR_NAME = "KvmeshConnector"
"""``KVTransferConfig.kv_connector``."""
MODULE_PATH = "services.worker.connector.connector"
"""``KVTransferConfig.kv_connector_module_path``."""


def kv_transfer_config(store_path: str, store: str = "directory", **extra: Any) -> dict[str, Any]:
    """vLLM ``KVTransferConfig`` fields that enable ``KvmeshConnector`` on a directory store, or
    with ``store="kvmanager"`` on the kvmanager at ``store_path`` (host:port); ``extra``: more
    ``StoreConfig`` fields. For ``EngineConfig.kv_transfer_config``."""
    return {
        "kv_connector": CONNECTOR_NAME,
        "kv_connector_module_path": MODULE_PATH,
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"store": store, "store_path": store_path, **extra},
    }


__all__ = [
    "CONNECTOR_NAME",
    "MODULE_PATH",
    "BlockLayout",
    "DirectoryBlockClient",
    "KvBlockClient",
    "StoreConfig",
    "kv_transfer_config",
    "make_client",
    "parse_layout_key",
]
