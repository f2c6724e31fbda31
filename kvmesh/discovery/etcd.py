"""The etcd adapter of discovery, in one import: ``Registrar`` publishes a key bound to a lease,
``PrefixWatcher`` follows a prefix, ``EtcdUnavailable`` is what they raise when etcd does not
answer. See docs/etcd.md for the semantics (leases, reconnects, compaction)."""

from __future__ import annotations

from kvmesh.discovery.client import EtcdUnavailable, parse_endpoint
from kvmesh.discovery.registrar import Registrar
from kvmesh.discovery.watcher import PrefixWatcher

__all__ = ["EtcdUnavailable", "PrefixWatcher", "Registrar", "parse_endpoint"]
