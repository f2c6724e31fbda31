"""``kvmesh status``: the cluster at a glance. Reads the cluster's records from etcd (workers,
kvmanagers, routers), then asks every service in parallel, each under a short deadline: workers
for GetLoad and GetInfo, kvmanagers for GetInfo (tier fill), routers for their gRPC health and
the tenants' flow control on their /metrics (queued, admitted, rejected, tokens). A
service that does not answer shows as unreachable with the reason; only etcd not answering is an
error.

``gather`` does the I/O; ``format_table`` and ``ClusterStatus.to_dict`` are pure.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any, TypeVar

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvmesh.discovery.client import RotatingClient
from kvmesh.discovery.keys import (
    KvManagerRecord,
    RouterRecord,
    WorkerRecord,
    cluster_prefix,
    kvmanagers_prefix,
    routers_prefix,
    workers_prefix,
)
from kvmesh.discovery.security import EtcdCredentials
from kvmesh.kv_wire import TIER_PB
from kvmesh.tls import Tls, open_channel

log = logging.getLogger(__name__)

T = TypeVar("T")
_TIER_NAME = {pb: tier.value for tier, pb in TIER_PB.items()}
UNREACHABLE = "unreachable"


@dataclass(frozen=True, slots=True)
class WorkerStatus:
    worker_id: str
    role: str
    node: str
    state: str  # from etcd: serving, draining
    address: str
    model: str
    reachable: bool = False
    error: str = ""  # why it is unreachable (or answers as another worker)
    running: int | None = None  # requests the engine runs
    waiting: int | None = None  # requests waiting to be scheduled
    in_flight: int | None = None  # Generate calls accepted, not finished
    kv_cache_usage: float | None = None  # fraction of its KV cache blocks in use
    # Prefix cache hit tokens / queried tokens since the engine started; None: nothing queried.
    cache_hit_rate: float | None = None


@dataclass(frozen=True, slots=True)
class TierFill:
    tier: str  # cpu, disk
    used_bytes: int
    capacity_bytes: int
    blocks: int


@dataclass(frozen=True, slots=True)
class KvManagerStatus:
    kvmanager_id: str
    node: str
    address: str
    reachable: bool = False
    error: str = ""
    tiers: tuple[TierFill, ...] = ()

    def tier(self, name: str) -> TierFill | None:
        return next((t for t in self.tiers if t.tier == name), None)


@dataclass(frozen=True, slots=True)
class RouterStatus:
    router_id: str
    address: str
    version: str
    reachable: bool = False
    error: str = ""
    serving: bool = False  # its gRPC health says SERVING


@dataclass(frozen=True, slots=True)
class TenantStatus:
    """One tenant's flow control, summed over the routers' /metrics (every model and band)."""

    tenant: str  # the key file's name; "-" on an open router
    queued: int = 0  # waiting now
    admitted: int = 0
    rejected: int = 0
    rejected_by: tuple[tuple[str, int], ...] = ()  # (reason, count), most first
    uncached_tokens: int = 0  # prompt tokens prefilled for it
    output_tokens: int = 0


@dataclass(frozen=True, slots=True)
class ClusterStatus:
    cluster: str
    etcd: str  # the endpoint(s) read
    workers: tuple[WorkerStatus, ...] = ()
    kvmanagers: tuple[KvManagerStatus, ...] = ()
    routers: tuple[RouterStatus, ...] = ()
    bad_records: tuple[str, ...] = field(default=())  # keys whose value could not be parsed
    tenants: tuple[TenantStatus, ...] = ()  # from the routers' /metrics (flow control on)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# ---- I/O ------------------------------------------------------------------------------------
def _describe(exc: BaseException) -> str:
    if isinstance(exc, grpc.aio.AioRpcError):
        return f"{exc.code().name}: {exc.details() or ''}".strip().rstrip(":")
    if isinstance(exc, TimeoutError):
        return "DEADLINE_EXCEEDED: no answer in time"
    return f"{type(exc).__name__}: {exc}"


async def _ask(
    address: str,
    timeout_s: float,
    call: Callable[[grpc.aio.Channel], Awaitable[T]],
    tls: Tls | None,
) -> T:
    """One exchange with ``address`` on its own channel, bounded end to end by ``timeout_s``."""
    async with asyncio.timeout(timeout_s):
        async with open_channel(address, tls) as channel:
            return await call(channel)


async def _worker(rec: WorkerRecord, timeout_s: float, tls: Tls | None) -> WorkerStatus:
    from kvmesh.v1 import worker_pb2, worker_pb2_grpc

    base = WorkerStatus(
        worker_id=rec.worker_id,
        role=rec.role.value,
        node=rec.node,
        state=rec.state.value,
        address=rec.address,
        model=rec.model,
    )

    async def call(channel: grpc.aio.Channel) -> tuple[Any, Any]:
        stub = worker_pb2_grpc.WorkerStub(channel)
        return await asyncio.gather(
            stub.GetLoad(worker_pb2.GetLoadRequest(), timeout=timeout_s),
            stub.GetInfo(worker_pb2.GetInfoRequest(), timeout=timeout_s),
        )

    try:
        load, info = await _ask(rec.address, timeout_s, call, tls)
    except Exception as exc:
        return replace(base, error=_describe(exc))
    if info.worker_id != rec.worker_id:
        return replace(base, error=f"{rec.address} answers as worker {info.worker_id!r}")
    queried = load.prefix_cache_queried_tokens
    return replace(
        base,
        reachable=True,
        running=load.running_requests,
        waiting=load.waiting_requests,
        in_flight=load.in_flight_requests,
        kv_cache_usage=load.kv_cache_usage,
        cache_hit_rate=load.prefix_cache_hit_tokens / queried if queried else None,
    )


async def _kvmanager(rec: KvManagerRecord, timeout_s: float, tls: Tls | None) -> KvManagerStatus:
    from kvmesh.v1 import kvmanager_pb2, kvmanager_pb2_grpc

    base = KvManagerStatus(kvmanager_id=rec.kvmanager_id, node=rec.node, address=rec.address)

    async def call(channel: grpc.aio.Channel) -> Any:
        stub = kvmanager_pb2_grpc.KvManagerStub(channel)
        return await stub.GetInfo(kvmanager_pb2.KvManagerInfoRequest(), timeout=timeout_s)

    try:
        info = await _ask(rec.address, timeout_s, call, tls)
    except Exception as exc:
        return replace(base, error=_describe(exc))
    tiers = tuple(
        TierFill(_TIER_NAME.get(t.tier, str(t.tier)), t.used_bytes, t.capacity_bytes, t.blocks)
        for t in info.tiers
    )
    return replace(base, reachable=True, tiers=tiers)


TENANT_METRICS = (
    "kvmesh_router_admission_queue_depth",
    "kvmesh_router_admission_admitted_total",
    "kvmesh_router_admission_rejected_total",
    "kvmesh_router_tenant_tokens_total",
)


def tenant_samples(text: str) -> list[tuple[str, dict[str, str], float]]:
    """The flow-control samples of one router's Prometheus text (name, labels, value)."""
    from prometheus_client.parser import text_string_to_metric_families

    out = []
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in TENANT_METRICS:
                out.append((sample.name, dict(sample.labels), float(sample.value)))
    return out


def tenants_of(samples: Sequence[tuple[str, dict[str, str], float]]) -> tuple[TenantStatus, ...]:
    """Sums the samples of every router per tenant (pure)."""
    acc: dict[str, dict[str, float]] = {}
    reasons: dict[str, dict[str, float]] = {}
    for name, labels, value in samples:
        tenant = labels.get("tenant", "-")
        row = acc.setdefault(tenant, {})
        if name == "kvmesh_router_admission_queue_depth":
            row["queued"] = row.get("queued", 0.0) + value
        elif name == "kvmesh_router_admission_admitted_total":
            row["admitted"] = row.get("admitted", 0.0) + value
        elif name == "kvmesh_router_admission_rejected_total":
            row["rejected"] = row.get("rejected", 0.0) + value
            by = reasons.setdefault(tenant, {})
            reason = labels.get("reason", "?")
            by[reason] = by.get(reason, 0.0) + value
        elif labels.get("kind") in ("prompt-uncached", "output"):
            key = "uncached" if labels["kind"] == "prompt-uncached" else "output"
            row[key] = row.get(key, 0.0) + value
    out = []
    for tenant, row in sorted(acc.items()):
        counts = sorted(
            ((r, int(n)) for r, n in reasons.get(tenant, {}).items() if n), key=lambda x: -x[1]
        )
        out.append(
            TenantStatus(
                tenant,
                int(row.get("queued", 0)),
                int(row.get("admitted", 0)),
                int(row.get("rejected", 0)),
                tuple(counts),
                int(row.get("uncached", 0)),
                int(row.get("output", 0)),
            )
        )
    return tuple(t for t in out if t.queued or t.admitted or t.rejected or t.output_tokens)


async def _router_metrics(
    rec: RouterRecord, timeout_s: float
) -> list[tuple[str, dict[str, str], float]]:
    """The router's flow-control samples; none when it publishes no metrics URL or does not
    answer within ``timeout_s`` (its row says whether it is reachable)."""
    if not rec.metrics_url:
        return []
    import aiohttp

    try:
        timeout = aiohttp.ClientTimeout(total=timeout_s)
        async with (
            aiohttp.ClientSession(timeout=timeout) as session,
            session.get(rec.metrics_url) as resp,
        ):
            if resp.status != 200:
                return []
            text = await resp.text()
    except (aiohttp.ClientError, TimeoutError, OSError) as exc:
        log.info("router %s metrics at %s: %s", rec.router_id, rec.metrics_url, _describe(exc))
        return []
    return tenant_samples(text)


async def _router(rec: RouterRecord, timeout_s: float, tls: Tls | None) -> RouterStatus:
    base = RouterStatus(router_id=rec.router_id, address=rec.address, version=rec.version)

    async def call(channel: grpc.aio.Channel) -> Any:
        stub = health_pb2_grpc.HealthStub(channel)
        return await stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout_s)

    try:
        reply = await _ask(rec.address, timeout_s, call, tls)
    except Exception as exc:
        return replace(base, error=_describe(exc))
    serving = reply.status == health_pb2.HealthCheckResponse.SERVING
    return replace(base, reachable=True, serving=serving)


async def read_records(
    endpoints: Sequence[str],
    cluster: str,
    timeout_s: float,
    credentials: EtcdCredentials | None = None,
) -> tuple[dict[str, bytes], str]:
    """Every key under the cluster's prefix, and the endpoint that answered. Raises
    ``EtcdUnavailable`` if no endpoint answers within ``timeout_s``."""
    conn = RotatingClient(endpoints, timeout_s, credentials)
    prefix = cluster_prefix(cluster)
    try:
        listing = await conn.call_within(
            lambda client: client.get_prefix(prefix.encode()), f"read {prefix}"
        )
        return {kv.key.decode(): kv.value for kv in listing}, str(conn.endpoint)
    finally:
        await conn.close()


async def gather(
    endpoints: Sequence[str],
    cluster: str,
    timeout_s: float = 2.0,
    tls: Tls | None = None,
    etcd_credentials: EtcdCredentials | None = None,
) -> ClusterStatus:
    """The cluster's status: etcd's records, each service asked in parallel within
    ``timeout_s`` (over TLS with ``tls``: the mesh's CA and a client certificate; etcd with
    ``etcd_credentials``). Raises ``EtcdUnavailable`` only if etcd does not answer."""
    records, etcd = await read_records(endpoints, cluster, timeout_s, etcd_credentials)
    workers: list[WorkerRecord] = []
    kvmanagers: list[KvManagerRecord] = []
    routers: list[RouterRecord] = []
    bad: list[str] = []
    for key, raw in sorted(records.items()):
        try:
            if key.startswith(workers_prefix(cluster)):
                workers.append(WorkerRecord.from_json(raw))
            elif key.startswith(kvmanagers_prefix(cluster)):
                kvmanagers.append(KvManagerRecord.from_json(raw))
            elif key.startswith(routers_prefix(cluster)):
                routers.append(RouterRecord.from_json(raw))
        except (ValueError, KeyError, TypeError) as exc:
            log.warning("unreadable record %s: %s", key, exc)
            bad.append(key)
    w, k, r, m = await asyncio.gather(
        asyncio.gather(*(_worker(x, timeout_s, tls) for x in workers)),
        asyncio.gather(*(_kvmanager(x, timeout_s, tls) for x in kvmanagers)),
        asyncio.gather(*(_router(x, timeout_s, tls) for x in routers)),
        asyncio.gather(*(_router_metrics(x, timeout_s) for x in routers)),
    )
    return ClusterStatus(
        cluster=cluster,
        etcd=etcd,
        workers=tuple(sorted(w, key=lambda s: s.worker_id)),
        kvmanagers=tuple(sorted(k, key=lambda s: s.kvmanager_id)),
        routers=tuple(sorted(r, key=lambda s: s.router_id)),
        bad_records=tuple(bad),
        tenants=tenants_of([sample for samples in m for sample in samples]),
    )


# ---- formatting (pure) ----------------------------------------------------------------------
def human_bytes(n: int) -> str:
    """1536 -> '1.5 KiB'; whole bytes below 1 KiB."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{n} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def _num(x: int | None) -> str:
    return "-" if x is None else str(x)


def _fill(t: TierFill | None) -> str:
    if t is None:
        return "-"
    pct = f" ({100 * t.used_bytes / t.capacity_bytes:.0f}%)" if t.capacity_bytes else ""
    return f"{human_bytes(t.used_bytes)} / {human_bytes(t.capacity_bytes)}{pct}"


def _table(header: Sequence[str], rows: Sequence[Sequence[str]], right: set[int]) -> list[str]:
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows, strict=False)]

    def line(cells: Sequence[str]) -> str:
        out = [
            c.rjust(w) if i in right else c.ljust(w)
            for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        ]
        return "  ".join(out).rstrip()

    return [line(header), *(line(r) for r in rows)]


def format_table(s: ClusterStatus) -> str:
    """The human view: one table per kind of service, then why any service was unreachable."""
    out = [f"cluster {s.cluster} (etcd {s.etcd})", ""]
    problems: list[str] = []

    out.append(f"WORKERS ({len(s.workers)})")
    if s.workers:
        rows = []
        for w in s.workers:
            state = w.state if w.reachable else UNREACHABLE
            rows.append(
                [
                    w.worker_id,
                    w.role,
                    w.node,
                    state,
                    w.address,
                    w.model,
                    _num(w.running),
                    _num(w.waiting),
                    _pct(w.kv_cache_usage),
                    _pct(w.cache_hit_rate),
                ]
            )
            if w.error:
                problems.append(f"worker {w.worker_id}: {w.error}")
        header = ["ID", "ROLE", "NODE", "STATE", "ADDRESS", "MODEL", "RUN", "WAIT", "KV", "HIT"]
        out += _table(header, rows, right={6, 7, 8, 9})
    out.append("")

    out.append(f"KVMANAGERS ({len(s.kvmanagers)})")
    if s.kvmanagers:
        rows = []
        for k in s.kvmanagers:
            cpu, disk = k.tier("cpu"), k.tier("disk")
            blocks = _num(sum(t.blocks for t in k.tiers)) if k.reachable else "-"
            rows.append(
                [
                    k.kvmanager_id,
                    k.node,
                    "serving" if k.reachable else UNREACHABLE,
                    k.address,
                    _fill(cpu),
                    _fill(disk),
                    blocks,
                ]
            )
            if k.error:
                problems.append(f"kvmanager {k.kvmanager_id}: {k.error}")
        header = ["ID", "NODE", "STATE", "ADDRESS", "CPU USED / CAP", "DISK USED / CAP", "BLOCKS"]
        out += _table(header, rows, right={6})
    out.append("")

    out.append(f"ROUTERS ({len(s.routers)})")
    if s.routers:
        rows = []
        for r in s.routers:
            state = UNREACHABLE if not r.reachable else "serving" if r.serving else "not serving"
            rows.append([r.router_id, state, r.address, r.version or "-"])
            if r.error:
                problems.append(f"router {r.router_id}: {r.error}")
        out += _table(["ID", "STATE", "ADDRESS", "VERSION"], rows, right=set())
    if s.tenants:
        out += ["", f"TENANTS ({len(s.tenants)}, flow control over every router)"]
        rows = [
            [
                t.tenant,
                _num(t.queued),
                _num(t.admitted),
                _num(t.rejected),
                ", ".join(f"{r} {n}" for r, n in t.rejected_by) or "-",
                _num(t.uncached_tokens),
                _num(t.output_tokens),
            ]
            for t in s.tenants
        ]
        header = ["TENANT", "QUEUED", "ADMITTED", "REJECTED", "BY REASON", "UNCACHED", "OUTPUT"]
        out += _table(header, rows, right={1, 2, 3, 5, 6})
    for key in s.bad_records:
        problems.append(f"unreadable etcd record {key}")
    if problems:
        out += ["", "PROBLEMS", *(f"  {p}" for p in problems)]
    return "\n".join(out) + "\n"
