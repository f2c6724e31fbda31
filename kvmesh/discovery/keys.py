"""The etcd key layout and the records stored under it. Pure: no etcd client here.

Layout (documented in docs/architecture.md)::

    /kvmesh/<cluster>/workers/<role>/<worker_id>  -> WorkerRecord as JSON, bound to the worker's lease
    /kvmesh/<cluster>/routers/<router_id>         -> RouterRecord as JSON, bound to the router's lease
    /kvmesh/<cluster>/kvmanagers/<kvmanager_id>   -> KvManagerRecord as JSON, bound to its lease

A key lives exactly as long as its owner's lease: a process that dies stops its keepalive and
etcd deletes its key after the TTL, which every watcher sees as a delete.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from enum import StrEnum
from typing import NewType

WorkerId = NewType("WorkerId", str)

log = logging.getLogger(__name__)

ROOT = "/kvmesh"
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


class Role(StrEnum):
    BOTH = "both"
    PREFILL = "prefill"
    DECODE = "decode"


class WorkerState(StrEnum):
    SERVING = "serving"
    DRAINING = "draining"


def check_name(kind: str, value: str) -> str:
    """Cluster names and ids become key segments: letters, digits, '.', '_' and '-' only."""
    if not _NAME_RE.fullmatch(value):
        raise ValueError(
            f"{kind} {value!r} is not a valid name: use 1-128 letters, digits, '.', '_' or '-', "
            "starting with a letter or digit"
        )
    return value


def cluster_prefix(cluster: str) -> str:
    return f"{ROOT}/{check_name('cluster', cluster)}/"


def workers_prefix(cluster: str) -> str:
    return f"{cluster_prefix(cluster)}workers/"


def worker_key(cluster: str, role: Role, worker_id: str) -> str:
    return f"{workers_prefix(cluster)}{Role(role).value}/{check_name('worker id', worker_id)}"


def routers_prefix(cluster: str) -> str:
    return f"{cluster_prefix(cluster)}routers/"


def router_key(cluster: str, router_id: str) -> str:
    return f"{routers_prefix(cluster)}{check_name('router id', router_id)}"


def kvmanagers_prefix(cluster: str) -> str:
    return f"{cluster_prefix(cluster)}kvmanagers/"


def kvmanager_key(cluster: str, kvmanager_id: str) -> str:
    return f"{kvmanagers_prefix(cluster)}{check_name('kvmanager id', kvmanager_id)}"


def parse_worker_key(cluster: str, key: str) -> tuple[Role, WorkerId] | None:
    """(role, worker id) for a key under the cluster's workers prefix, else None."""
    prefix = workers_prefix(cluster)
    if not key.startswith(prefix):
        return None
    parts = key[len(prefix) :].split("/")
    if len(parts) != 2 or not parts[1]:
        return None
    try:
        role = Role(parts[0])
    except ValueError:
        return None
    return role, WorkerId(parts[1])


@dataclass(frozen=True, slots=True)
class WorkerRecord:
    """What a worker publishes about itself."""

    worker_id: WorkerId
    address: str  # host:port of its gRPC server
    model: str  # served model name
    model_path: str  # where its weights/tokenizer live (routers load the tokenizer from here)
    role: Role = Role.BOTH
    node: str = ""  # node (host) name, for same-node KV transfer later
    version: str = ""  # kvmesh version of the worker
    state: WorkerState = WorkerState.SERVING
    max_model_len: int = 0  # tokens, prompt + completion
    block_size: int = 0  # tokens per KV block
    vocab_size: int = 0
    # KvLayout key (kvmesh/kv/layout.py) of the blocks it saves to its node's
    # kvmanager; empty when it has none. Routers read that kvmanager's tier events for it.
    kv_layout: str = ""
    vllm_version: str = ""  # the vLLM its engine runs; empty for the simulated engine
    # Most requests its engine runs at once (vLLM's max_num_seqs): routers count what they send
    # beyond it as waiting before the worker's next load report says so. 0: not known.
    max_running_requests: int = 0
    # Data-parallel ranks of its engine, each with its own KV cache: the router routes to each
    # (worker, rank) as a target of its own (``routing_targets``). 1: one.
    data_parallel_size: int = 1
    # Set only on a routing target of a worker with several ranks (never in etcd): its rank.
    # -1: the whole worker.
    data_parallel_rank: int = -1

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, raw: str | bytes) -> WorkerRecord:
        data = json.loads(raw)
        known = {f for f in cls.__slots__}  # type: ignore[attr-defined]
        data = {k: v for k, v in data.items() if k in known}  # newer writers may add fields
        data["worker_id"] = WorkerId(data["worker_id"])
        data["role"] = Role(data.get("role", Role.BOTH))
        data["state"] = WorkerState(data.get("state", WorkerState.SERVING))
        return cls(**data)


RANK_SEP = "#r"
"""``<worker_id>#r<rank>``: the id of one data-parallel rank of a worker as a routing target
(the KV index, the scheduler, the load and KV event streams know it by that id). ``#`` is not
allowed in a worker id, so a target id never collides with one."""


def target_id(worker_id: str, rank: int) -> WorkerId:
    """The routing target id of ``worker_id``'s data-parallel rank ``rank``."""
    return WorkerId(f"{worker_id}{RANK_SEP}{rank}")


def split_target(target: str) -> tuple[WorkerId, int | None]:
    """(worker id, rank) of a routing target id; (the id, None) for a whole worker's."""
    base, sep, rank = target.rpartition(RANK_SEP)
    if sep and base and rank.isdigit():
        return WorkerId(base), int(rank)
    return WorkerId(target), None


def routing_targets(record: WorkerRecord) -> tuple[WorkerRecord, ...]:
    """The routing targets of a registered worker: itself, or with ``data_parallel_size`` > 1
    one record per rank (id ``<worker_id>#r<rank>``, ``data_parallel_rank`` set; same address,
    node and model), so that each rank, with its own KV cache, is scored and loaded on its own."""
    if record.data_parallel_size <= 1:
        return (record,)
    return tuple(
        replace(record, worker_id=target_id(record.worker_id, r), data_parallel_rank=r)
        for r in range(record.data_parallel_size)
    )


@dataclass(frozen=True, slots=True)
class RouterRecord:
    router_id: str
    address: str
    version: str = ""
    metrics_url: str = ""  # its Prometheus /metrics ("" : none); kvmesh status reads tenants there

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, raw: str | bytes) -> RouterRecord:
        data = json.loads(raw)
        return cls(
            router_id=data["router_id"],
            address=data["address"],
            version=data.get("version", ""),
            metrics_url=data.get("metrics_url", ""),
        )


@dataclass(frozen=True, slots=True)
class KvManagerRecord:
    """What a node's kvmanager publishes about itself."""

    kvmanager_id: str
    address: str  # host:port of its gRPC server
    node: str  # the node it serves: workers with the same WorkerRecord.node use it
    data_plane_address: str = ""  # host:port of its bulk data plane; empty: off
    version: str = ""
    # Its measured transfer speeds, seconds per token of KV: layout key -> kind (cpu, disk: a
    # tier to a worker; peer: another kvmanager to this one) -> s/token. Only what it measured
    # (services/kvmanager/core/rates.py); routers use their configured rates for the rest.
    transfer_s_per_token: Mapping[str, Mapping[str, float]] = field(default_factory=dict)
    # Its measured speed of fetches from each peer, seconds per token: peer kvmanager id ->
    # layout key -> s/token (one link each: a slow one is priced as slow). Only what it measured.
    peer_s_per_token: Mapping[str, Mapping[str, float]] = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, raw: str | bytes) -> KvManagerRecord:
        data = json.loads(raw)
        known = {f for f in cls.__slots__}  # type: ignore[attr-defined]
        data = {k: v for k, v in data.items() if k in known}
        for rates in ("transfer_s_per_token", "peer_s_per_token"):
            if rates in data:
                data[rates] = _rates(data[rates])
        return cls(**data)


def _rates(raw: object) -> dict[str, dict[str, float]]:
    """The well-formed part of a record's transfer rates (two levels of names over seconds per
    token): positive finite numbers only."""
    out: dict[str, dict[str, float]] = {}
    if not isinstance(raw, dict):
        return out
    for layout, kinds in raw.items():
        if not isinstance(layout, str) or not isinstance(kinds, dict):
            continue
        good = {
            k: float(v)
            for k, v in kinds.items()
            if isinstance(k, str)
            and isinstance(v, int | float)
            and not isinstance(v, bool)
            and 0.0 < v < float("inf")
        }
        if good:
            out[layout] = good
    return out


# ---- etcd entries (key, value) -> records ---------------------------------------------------
# A watcher hands these raw entries over; a malformed one is logged and skipped (None) so it
# never breaks the watch. A key outside the prefix (another cluster, another kind) is None too.


def worker_id_from_key(cluster: str, key: str) -> WorkerId | None:
    """The worker id a key under the cluster's workers prefix names, else None."""
    parsed = parse_worker_key(cluster, key)
    return parsed[1] if parsed is not None else None


def worker_from_entry(cluster: str, key: str, value: str | bytes) -> WorkerRecord | None:
    """The worker record an etcd entry holds; None (and a warning) when it is malformed or
    disagrees with its key's id or role, None when the key is not a worker key."""
    parsed = parse_worker_key(cluster, key)
    if parsed is None:
        return None
    try:
        rec = WorkerRecord.from_json(value)
    except (ValueError, KeyError, TypeError) as exc:
        log.warning("skipping malformed worker record at %s: %s", key, exc)
        return None
    if rec.worker_id != parsed[1] or rec.role is not parsed[0]:
        log.warning("skipping worker record at %s: id/role disagree with its key", key)
        return None
    return rec


def worker_records(cluster: str, items: Mapping[str, str | bytes]) -> list[WorkerRecord]:
    """The well-formed worker records of a snapshot (key -> value)."""
    return [r for k, v in items.items() if (r := worker_from_entry(cluster, k, v)) is not None]


def kvmanager_id_from_key(cluster: str, key: str) -> str | None:
    """The kvmanager id a key under the cluster's kvmanagers prefix names, else None."""
    prefix = kvmanagers_prefix(cluster)
    if not key.startswith(prefix):
        return None
    kid = key[len(prefix) :]
    return kid if kid and "/" not in kid else None


def kvmanager_from_entry(cluster: str, key: str, value: str | bytes) -> KvManagerRecord | None:
    """The kvmanager record an etcd entry holds; None (and a warning) when it is malformed or
    its id disagrees with its key, None when the key is not a kvmanager key."""
    kid = kvmanager_id_from_key(cluster, key)
    if kid is None:
        return None
    try:
        rec = KvManagerRecord.from_json(value)
    except (ValueError, KeyError, TypeError) as exc:
        log.warning("skipping malformed kvmanager record at %s: %s", key, exc)
        return None
    if rec.kvmanager_id != kid:
        log.warning("skipping kvmanager record at %s: its id disagrees with its key", key)
        return None
    return rec


def kvmanager_records(cluster: str, items: Mapping[str, str | bytes]) -> list[KvManagerRecord]:
    """The well-formed kvmanager records of a snapshot (key -> value)."""
    return [r for k, v in items.items() if (r := kvmanager_from_entry(cluster, k, v)) is not None]
