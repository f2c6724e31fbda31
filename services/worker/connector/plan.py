"""The scheduler side's per-request bookkeeping: which blocks to load, which to save. Pure.

Token counts are vLLM's: ``num_tokens`` (prompt + output so far), ``computed`` (tokens whose KV
is in the engine's cache). Blocks are full blocks of ``block_size`` tokens, numbered from the
start of the prompt; block ``i`` has key ``keys[i]`` (its 64-bit block hash).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvmesh.kv.events import Tier

KV_SOURCE_PARAM = "kvmesh_kv_source"
"""The key of the router's peer hint in a request's ``kv_transfer_params`` (vLLM hands those to
the connector as ``Request.kv_transfer_params``; the worker puts them in
``SamplingParams.extra_args["kv_transfer_params"]``)."""


@dataclass(frozen=True, slots=True)
class PeerSource:
    """A peer kvmanager holding ``blocks`` leading blocks of the request (the router's hint)."""

    kvmanager_id: str
    blocks: int
    wait_s: float = 0.0  # how long to wait for them to land there (0: the connector's default)
    # The longest the fetch is worth waiting for (the router's estimate of recomputing what it
    # brings); 0: the connector's peer_fetch.timeout_s.
    max_s: float = 0.0

    def to_params(self) -> dict[str, Any]:
        """The request's ``kv_transfer_params`` carrying this hint (plain types: it is pickled
        to the engine core)."""
        raw: dict[str, Any] = {"kvmanager_id": self.kvmanager_id, "blocks": self.blocks}
        if self.wait_s > 0:
            raw["wait_s"] = self.wait_s
        if self.max_s > 0:
            raw["max_s"] = self.max_s
        return {KV_SOURCE_PARAM: raw}

    @classmethod
    def from_params(cls, params: Mapping[str, Any] | None) -> PeerSource | None:
        """The hint in a request's ``kv_transfer_params``; None when absent or malformed (a
        hint is only ever an optimisation)."""
        raw = params.get(KV_SOURCE_PARAM) if isinstance(params, Mapping) else None
        if not isinstance(raw, Mapping):
            return None
        kid, blocks = raw.get("kvmanager_id"), raw.get("blocks")
        if not isinstance(kid, str) or not kid or not isinstance(blocks, int) or blocks <= 0:
            return None
        wait_s, max_s = (_seconds(raw.get(k, 0.0)) for k in ("wait_s", "max_s"))
        return cls(kid, blocks, wait_s, max_s)


def _seconds(v: object) -> float:
    """A hint's time in seconds (0 to 600); 0 (the default) when malformed, NaN too."""
    if isinstance(v, bool) or not isinstance(v, int | float) or not 0 <= v <= 600:
        return 0.0
    return float(v)


REQUEST_ID_PARAM = "kvmesh_request_id"
"""The key of the worker's own request id in a request's ``kv_transfer_params``: vLLM's engine
core names the request ``<id>-<random>``, so the connector tags its load reports (which reach the
worker through vLLM's stats) with this one."""
STORE_PREFIX_PARAM = "kvmesh_store_prefix_blocks"
"""kv_transfer_params key: the router's count of the prompt's leading blocks the node store
holds (``WorkerGenerateRequest.store_prefix_blocks``); absent: unknown."""

LOAD_REPORT_PARAM = "kvmesh_load"
"""The key of the connector's ``LoadReport`` (``to_dict``) in the ``kv_transfer_params`` that
``request_finished`` returns: vLLM hands them back with the request's final output, when the
engine core finished the request (not for stop strings, which the front end applies)."""
LOAD_REPORTS_STAT = "load_reports"
"""The key of an interval's load reports in the connector's stats (vLLM's
``SchedulerStats.kv_connector_stats``): request id (``REQUEST_ID_PARAM``) -> ``to_dict``. A
request's report arrives in the stats of the step that sent its load (before or with its first
token), and again, ``as_failed``, with those of the step whose output said the load failed."""


@dataclass(frozen=True, slots=True)
class LoadReport:
    """Prompt tokens the connector loaded into the engine's KV cache for one request, by where
    they came from. ``failed``: tokens it planned to load that did not arrive sound; the engine
    recomputed them, but vLLM's ``num_cached_tokens`` still counts them. A request whose load
    failed reports nothing loaded (its planned tokens are all ``failed``)."""

    cpu: int = 0  # the node kvmanager's CPU tier (or a store without tiers)
    disk: int = 0  # the node kvmanager's disk tier (or the directory store)
    peer: int = 0  # fetched from another node's kvmanager for this request, then loaded
    failed: int = 0

    @property
    def loaded(self) -> int:
        return self.cpu + self.disk + self.peer

    def as_failed(self) -> LoadReport:
        """The report of the same load after it failed: nothing loaded."""
        return LoadReport(failed=self.loaded + self.failed)

    def to_dict(self) -> dict[str, int]:
        """Plain types: it is pickled from the engine core to the front end."""
        return {"cpu": self.cpu, "disk": self.disk, "peer": self.peer, "failed": self.failed}

    @classmethod
    def from_dict(cls, raw: object) -> LoadReport | None:
        """The report in ``raw`` (``to_dict``'s form); None when absent or malformed."""
        if not isinstance(raw, Mapping):
            return None
        values = [raw.get(k, 0) for k in ("cpu", "disk", "peer", "failed")]
        if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
            return None
        return cls(*values)

    @classmethod
    def from_params(cls, params: Mapping[str, Any] | None) -> LoadReport | None:
        """The report in a finished request's ``kv_transfer_params``, if any."""
        return cls.from_dict(params.get(LOAD_REPORT_PARAM)) if isinstance(params, Mapping) else None


def request_id_of(params: Mapping[str, Any] | None, default: str) -> str:
    """The worker's request id in ``kv_transfer_params`` (``REQUEST_ID_PARAM``), else
    ``default`` (vLLM's own)."""
    rid = params.get(REQUEST_ID_PARAM) if isinstance(params, Mapping) else None
    return rid if isinstance(rid, str) and rid else default


def known_store_prefix(
    params: Mapping[str, Any] | None, computed_tokens: int, block_size: int
) -> int | None:
    """The router's count of the node store's prefix (``STORE_PREFIX_PARAM``) when it makes a
    lookup pointless: the engine's own cache covers it (``computed_tokens``), so the store has
    nothing to load. None: look up (no count, a bad one, or the store holds more)."""
    n = params.get(STORE_PREFIX_PARAM) if isinstance(params, Mapping) else None
    if not isinstance(n, int) or isinstance(n, bool) or n < 0:
        return None
    return n if n * block_size <= computed_tokens else None


def peer_fetch_range(
    peer: PeerSource,
    keys_known: int,
    store_blocks: int,
    computed_tokens: int,
    num_tokens: int,
    block_size: int,
) -> range:
    """Block numbers worth fetching from ``peer`` into the local store: from the end of the
    store's leading run to the end of the peer's, within the blocks the request could load
    (whole known blocks, never its last token). Empty when the store or the engine's own cache
    already reach as far."""
    limit = min(peer.blocks, max(0, num_tokens - 1) // block_size, keys_known)
    if limit <= max(store_blocks, computed_tokens // block_size):
        return range(0)
    return range(store_blocks, limit)


@dataclass(slots=True)
class RequestPlan:
    """What the connector knows about one request."""

    keys: list[int] = field(default_factory=list)
    """Keys of the request's full blocks so far (grow as decoding fills blocks)."""
    store_blocks: int = 0
    """Leading blocks the store had at the latest lookup."""
    store_tiers: list[Tier] = field(default_factory=list)
    """The store's tier of each of those blocks, when it says (empty: unknown, counted as CPU)."""
    peer_start: int = 0
    """The first block number the request's peer fetch asked for (see ``peer_blocks``)."""
    peer_blocks: range = range(0)
    """Block numbers the request's peer fetch stored in the local store (from ``peer_start``)."""
    local_tokens: int = 0
    """Engine-computed tokens the latest lookup was asked to go beyond (block-aligned)."""
    saved_blocks: int = 0
    """Blocks ``[0, saved_blocks)`` are in the store or were handed to the worker to save."""
    expected_tokens: int | None = None
    """Computed tokens the request will have after the step last planned; fewer at the next
    step means the engine rolled it back (a failed load, a preemption, rejected drafts)."""


def loadable_tokens(plan: RequestPlan, num_tokens: int, block_size: int) -> int:
    """Tokens beyond ``plan.local_tokens`` the store can supply: whole blocks only, and never
    the last token of the request (the engine must compute at least one to sample from)."""
    limit_blocks = max(0, num_tokens - 1) // block_size
    blocks = min(plan.store_blocks, limit_blocks, len(plan.keys))
    return max(0, blocks * block_size - plan.local_tokens)


def after_lookup(
    plan: RequestPlan, local_tokens: int, store_blocks: int, tiers: Sequence[Tier] = ()
) -> None:
    """Records a lookup's answer (``tiers``: of each leading block, when the store says).
    Blocks the store has need no saving."""
    plan.local_tokens = local_tokens
    plan.store_blocks = store_blocks
    plan.store_tiers = list(tiers[:store_blocks])
    plan.saved_blocks = store_blocks


def load_report(plan: RequestPlan, numbers: range, block_size: int) -> LoadReport:
    """Where the blocks ``numbers`` about to be loaded come from: the peer for those the
    request's peer fetch stored, else their tier at the latest lookup (CPU when unknown)."""
    counts = {Tier.CPU: 0, Tier.DISK: 0}
    peer = 0
    tiers = plan.store_tiers
    for i in numbers:
        if i in plan.peer_blocks:
            peer += 1
        else:
            tier = tiers[i] if i < len(tiers) else Tier.CPU
            counts[Tier.DISK if tier == Tier.DISK else Tier.CPU] += 1
    return LoadReport(
        cpu=counts[Tier.CPU] * block_size,
        disk=counts[Tier.DISK] * block_size,
        peer=peer * block_size,
    )


def load_blocks(plan: RequestPlan, num_external_tokens: int, block_size: int) -> range:
    """Block numbers to load for ``num_external_tokens`` granted by the scheduler."""
    if num_external_tokens <= 0:
        return range(0)
    start = plan.local_tokens // block_size
    return range(start, start + num_external_tokens // block_size)


def save_blocks(plan: RequestPlan, computed: int, scheduled: int, block_size: int) -> range:
    """Block numbers to save after a step that computes ``scheduled`` tokens on top of
    ``computed``: the full blocks completed by then that are not saved yet. Updates ``plan``
    as if the worker saves them."""
    if plan.expected_tokens is not None and computed < plan.expected_tokens:
        # Rolled back: blocks from the new frontier on are recomputed, and may have been
        # garbage (failed load) or never saved (the worker skips saves of a failed request).
        plan.saved_blocks = min(plan.saved_blocks, computed // block_size)
    plan.expected_tokens = computed + scheduled
    # Only blocks whose tokens are known (keys exist): drafts are not saved.
    end = min((computed + scheduled) // block_size, len(plan.keys))
    start = plan.saved_blocks
    if end <= start:
        return range(0)
    plan.saved_blocks = end
    return range(start, end)


@dataclass(slots=True)
class _SentLoad:
    report_id: str  # the worker's request id (REQUEST_ID_PARAM)
    report: LoadReport  # of its first load (what vLLM's num_cached_tokens counted)
    block_ids: frozenset[int]  # engine blocks of its latest load: a failure names one of them


class LoadLedger:
    """What each running request loaded (the scheduler side): the loads sent to the workers,
    the failures the workers' output names, the report at the end. Each method returns the
    reports to publish now, as (report id, report)."""

    def __init__(self) -> None:
        self._loads: dict[str, _SentLoad] = {}

    def sent(
        self, req_id: str, report_id: str, report: LoadReport, block_ids: Sequence[int]
    ) -> list[tuple[str, LoadReport]]:
        """A load went to the workers. A request loading again (after a preemption) keeps its
        first report: vLLM's ``num_cached_tokens`` counts only its first scheduling."""
        sent = self._loads.get(req_id)
        if sent is not None:
            sent.block_ids = frozenset(block_ids)
            return []
        self._loads[req_id] = _SentLoad(report_id, report, frozenset(block_ids))
        return [(report_id, report)]

    def failed(self, invalid_block_ids: set[int]) -> list[tuple[str, LoadReport]]:
        """The workers could not load these engine blocks: the requests whose load names one
        recompute from there (vLLM rolls them back), so they report nothing loaded."""
        out: list[tuple[str, LoadReport]] = []
        if not invalid_block_ids:
            return out
        for sent in self._loads.values():
            if sent.report.loaded and not invalid_block_ids.isdisjoint(sent.block_ids):
                sent.report = sent.report.as_failed()
                out.append((sent.report_id, sent.report))
        return out

    def finish(self, req_id: str) -> LoadReport | None:
        """The request finished: its report (None: it loaded nothing), forgotten."""
        sent = self._loads.pop(req_id, None)
        return sent.report if sent is not None else None

    def __len__(self) -> int:
        return len(self._loads)
