"""``KvmeshConnector``: a vLLM v1 KV connector that offloads full KV blocks to a block store
and loads them back, so a later request (or another engine) skips their prefill.

vLLM builds one instance per role. The SCHEDULER instance (in the engine core, next to the
scheduler) asks the store how long a prefix it holds, decides which blocks to load and which
to save, and sends that to the workers as ``KvmeshConnectorMetadata`` every step. The WORKER
instance (in the process that owns the KV cache tensors) copies blocks into the paged KV cache
before the forward pass (``start_load_kv``) and out of it after the pass (``wait_for_save``),
handing the copies to a background saver. The scheduler instance also reports per request what
it loaded and from where (``plan.LoadReport``: the kvmanager's CPU or disk tier, or a peer), with
the request's final output and in its stats, for the worker's cached tokens by tier. See
docs/connector.md.

Enable it with ``services.worker.connector.kv_transfer_config(store_path=...)``, i.e.
``kv_connector="KvmeshConnector"``, ``kv_connector_module_path`` this module,
``kv_role="kv_both"``, ``kv_load_failure_policy="recompute"``.

Tracing: a request whose ``kv_transfer_params`` carry a trace context (the worker puts it there)
sends it as gRPC metadata on the store calls made for it: the scheduler's lookups, the peer
fetch, and the worker side's load (the context rides along in ``BlockTransfer.trace``). Saves
are batched across requests on the saver thread and go untraced.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
from vllm.v1.kv_cache_interface import FullAttentionSpec

from kvmesh.kv.events import Tier
from kvmesh.kv.hashing import Digest, to_block_hash

from . import CONNECTOR_NAME
from . import plan as plans
from .client import KvBlockClient, StoreConfig, TieredLookup, make_client
from .kv_copy import KvLayer, kv_layers, read_blocks, write_blocks
from .kvmanager_client import TraceMetadata, trace_metadata, traced_calls
from .layout import BlockLayout
from .peer_prefetch import PeerFetchConfig, PeerPrefetcher, make_prefetcher
from .saver import BlockSaver, SaveJob

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger(__name__)

SAVER_CLOSE_TIMEOUT_S = 10.0


# ---- metadata: scheduler -> worker, once per step (pickled) ---------------------------------
@dataclass(slots=True)
class BlockTransfer:
    """Blocks of one request: engine block ids and their store keys, in chain order."""

    req_id: str
    block_ids: list[int]
    keys: list[int]
    parent: int | None = None  # saves: the key of the block before keys[0]
    trace: TraceMetadata | None = None  # loads: the request's trace context (gRPC metadata)
    urgent: bool = False  # saves: another worker may be waiting for them (see _urgent)


@dataclass
class KvmeshConnectorMetadata(KVConnectorMetadata):
    loads: list[BlockTransfer] = field(default_factory=list)
    saves: list[BlockTransfer] = field(default_factory=list)


# ---- stats: through vLLM's KVConnectorStats to SchedulerStats.kv_connector_stats --------------
STAT_NAMES = (
    "lookups",  # store lookups (scheduler)
    "lookup_hit_blocks",  # leading blocks the store had, summed over lookups
    "lookups_skipped",  # not looked up: the router's count of the store's prefix said no need
    "load_blocks",  # blocks written into the KV cache from the store
    "load_bytes",
    "load_failed_blocks",  # blocks planned for loading that did not arrive sound (recomputed)
    "save_blocks",  # blocks copied out and handed to the saver
    "save_bytes",
    "save_skipped_blocks",  # not saved: the saver's queue was full
    "save_deduped_blocks",  # not copied: handed to the store before
    "peer_fetches",  # requests whose router hint made the local kvmanager fetch from a peer
    "peer_fetch_blocks",  # blocks those fetches stored in the local kvmanager
    "peer_fetch_failures",  # fetches that ended in an error (the rest is recomputed)
    "peer_fetch_timeouts",  # requests scheduled before their fetch finished (peer_fetch.timeout_s)
)


@dataclass
class KvmeshConnectorStats(KVConnectorStats):
    """Counters over an interval (``data``: name -> count); aggregating sums them. Also, under
    ``plans.LOAD_REPORTS_STAT``, the interval's per-request load reports (request id ->
    ``LoadReport.to_dict()``; aggregating merges them, the later one winning): the worker reads
    them from vLLM's stats (engine.py) for requests whose final output does not carry theirs."""

    def __post_init__(self) -> None:
        for name in STAT_NAMES:
            self.data.setdefault(name, 0)

    def reset(self) -> None:
        self.data = dict.fromkeys(STAT_NAMES, 0)

    def aggregate(self, other: KVConnectorStats) -> KvmeshConnectorStats:
        for name, value in other.data.items():
            if name == plans.LOAD_REPORTS_STAT:
                self.data[name] = {**self.data.get(name, {}), **value}
            else:
                self.data[name] = self.data.get(name, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        return {k: v for k, v in self.data.items() if k != plans.LOAD_REPORTS_STAT}

    def is_empty(self) -> bool:
        return not any(self.data.values())


class _Counters:
    """The current interval (handed to vLLM and reset) and totals since start; the interval's
    load reports (request id -> ``LoadReport.to_dict()``)."""

    def __init__(self) -> None:
        self.interval = dict.fromkeys(STAT_NAMES, 0)
        self.totals = dict.fromkeys(STAT_NAMES, 0)
        self.reports: dict[str, dict[str, int]] = {}

    def add(self, name: str, n: int) -> None:
        if n:
            self.interval[name] += n
            self.totals[name] += n

    def report(self, request_id: str, report: plans.LoadReport) -> None:
        self.reports[request_id] = report.to_dict()

    def take(self) -> KvmeshConnectorStats | None:
        if not any(self.interval.values()) and not self.reports:
            return None
        data: dict[str, Any] = self.interval
        if self.reports:
            data[plans.LOAD_REPORTS_STAT] = self.reports
            self.reports = {}
        self.interval = dict.fromkeys(STAT_NAMES, 0)
        return KvmeshConnectorStats(data=data)


# ---- layout --------------------------------------------------------------------------------
def _urgent(request: Request) -> bool:
    """A request for one token is a prefill whose KV is the point (the router's prefill of a
    disaggregated request, handed to a decode worker that waits for these blocks): its saves skip
    the saver's batching delay."""
    params = getattr(request, "sampling_params", None)
    return getattr(params, "max_tokens", None) == 1


def _attention_spec(kv_cache_config: KVCacheConfig) -> tuple[FullAttentionSpec, list[str]]:
    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1 or not isinstance(groups[0].kv_cache_spec, FullAttentionSpec):
        kinds = [type(g.kv_cache_spec).__name__ for g in groups]
        raise ValueError(
            f"{CONNECTOR_NAME} supports models with one full-attention KV cache group; this "
            f"model has {kinds}"
        )
    return groups[0].kv_cache_spec, list(groups[0].layer_names)


def block_layout(
    vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, tp_rank: int
) -> BlockLayout:
    """The layout of this engine's blocks (``tp_rank``'s shard)."""
    from vllm.platforms import current_platform

    spec, layer_names = _attention_spec(kv_cache_config)
    model = vllm_config.model_config.served_model_name or vllm_config.model_config.model
    if isinstance(model, list | tuple):
        model = model[0]
    if vllm_config.parallel_config.pipeline_parallel_size > 1:
        raise ValueError(f"{CONNECTOR_NAME} does not support pipeline parallelism yet")
    return BlockLayout(
        model=str(model),
        block_size=spec.block_size,
        num_layers=len(layer_names),
        num_kv_heads=spec.num_kv_heads,
        head_size=spec.head_size,
        dtype=str(spec.dtype).removeprefix("torch."),
        tp_rank=tp_rank,
        tp_size=vllm_config.parallel_config.tensor_parallel_size,
        device=str(current_platform.device_type),
    )


def init_amx() -> bool:
    """Asks the kernel for AMX tile permission in this process (what ``vllm_ext`` does for
    engines ``VllmEngine`` starts). Without it, vLLM's CPU attention in bf16 dies with "Illegal
    instruction" when an engine's first attention call is a short prefill over loaded KV:
    exactly what a store hit produces. Harmless where AMX is absent."""
    init = getattr(getattr(torch._C, "_cpu", None), "_init_amx", None)
    if init is None:
        return False
    try:
        return bool(init())
    except Exception:
        log.warning("torch._C._cpu._init_amx() failed", exc_info=True)
        return False


# ---- the connector ---------------------------------------------------------------------------
class KvmeshConnector(KVConnectorBase_V1):
    """See the module docstring and docs/connector.md."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig,
    ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        tc = self._kv_transfer_config
        if tc.kv_load_failure_policy != "recompute":
            raise ValueError(
                f"{CONNECTOR_NAME} needs kv_load_failure_policy='recompute' (a block that fails "
                f"to load is recomputed); got {tc.kv_load_failure_policy!r}"
            )
        extra = dict(tc.kv_connector_extra_config or {})
        peer_fetch = PeerFetchConfig.from_extra(extra.pop("peer_fetch", None))
        self.config = StoreConfig.from_extra(extra)
        self._do_load = self.config.load and tc.is_kv_consumer
        self._do_save = self.config.save and tc.is_kv_producer
        spec, self._layer_names = _attention_spec(kv_cache_config)
        self._block_size = spec.block_size
        self._num_blocks = kv_cache_config.num_blocks
        self._client: KvBlockClient = make_client(self.config)
        self._counters = _Counters()
        # scheduler side
        tp_size = vllm_config.parallel_config.tensor_parallel_size
        self._layout_keys = [
            block_layout(vllm_config, kv_cache_config, r).key() for r in range(tp_size)
        ]
        self._plans: dict[str, tuple[Request, plans.RequestPlan]] = {}
        self._pending_loads: dict[str, BlockTransfer] = {}
        self._pending_reports: dict[str, plans.LoadReport] = {}
        self._ledger = plans.LoadLedger()  # what each running request loaded
        self._prefetch: PeerPrefetcher | None = None  # the router's peer hints (peer_prefetch.py)
        if role == KVConnectorRole.SCHEDULER and self._do_load:
            self._prefetch = make_prefetcher(peer_fetch, self.config, self._counters.add)
        # worker side
        self._layout_key = ""
        self._layers: list[KvLayer] = []
        self._block_bytes = 0
        self._saver: BlockSaver | None = None
        self._handed_off: OrderedDict[int, None] = OrderedDict()  # under _handed_off_lock
        self._handed_off_lock = threading.Lock()
        self._load_errors: set[int] = set()
        self._failed_reqs: set[str] = set()
        if role == KVConnectorRole.WORKER:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            self._layout_key = block_layout(
                vllm_config, kv_cache_config, get_tensor_model_parallel_rank() if tp_size > 1 else 0
            ).key()
            if self._do_save:
                self._saver = BlockSaver(
                    self._client,
                    self.config.max_pending_save_bytes,
                    self._forget_saved,
                    batch_interval_s=self.config.save_interval_s,
                )
            init_amx()  # per process; vllm_ext does the same for VllmEngine's engines
        log.info(
            "%s (%s): load=%s save=%s layout=%s",
            CONNECTOR_NAME,
            role.name.lower(),
            self._do_load,
            self._do_save,
            self._layout_key or self._layout_keys[0],
        )

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a cache: a dropped save is a later miss, nothing waits for it

    @property
    def totals(self) -> dict[str, int]:
        """Counts since this instance started (this role's only)."""
        return dict(self._counters.totals)

    @property
    def layout_key(self) -> str:
        return self._layout_key or self._layout_keys[0]

    # ==== scheduler side ==========================================================================
    def _plan(self, request: Request) -> plans.RequestPlan:
        entry = self._plans.get(request.request_id)
        if entry is None:
            entry = (request, plans.RequestPlan())
            self._plans[request.request_id] = entry
        p = entry[1]
        # vLLM appends a block hash whenever a block's tokens are all known.
        hashes = request.block_hashes
        if len(p.keys) < len(hashes):
            p.keys.extend(to_block_hash(Digest(h)) for h in hashes[len(p.keys) :])
        return p

    def on_new_request(self, request: Request) -> None:
        self._plan(request)

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        p = self._plan(request)
        prefetch = self._prefetch
        rid = request.request_id
        if prefetch is not None and prefetch.pending(rid):
            return None, False  # its peer fetch is under way: vLLM asks again (bounded)
        tiers: list[Tier] = []
        params = getattr(request, "kv_transfer_params", None)
        known = plans.known_store_prefix(params, num_computed_tokens, self._block_size)
        if known is not None and plans.PeerSource.from_params(params) is None:
            # The router's index says the store has nothing past the engine's own cache.
            if p.keys and (self._do_load or self._do_save):
                self._counters.add("lookups_skipped", 1)
            plans.after_lookup(p, num_computed_tokens, min(known, len(p.keys)))
            return 0, False
        if p.keys and (self._do_load or self._do_save):
            trace = trace_metadata(params)
            tiers = self._lookup(p.keys, trace)
            if prefetch is not None and self._fetch_from_peer(
                request, p, len(tiers), num_computed_tokens, trace
            ):
                if prefetch.pending(rid):
                    return None, False
                tiers = self._lookup(p.keys, trace)
            if prefetch is not None:  # the blocks its (settled) fetch brought from the peer
                p.peer_blocks = range(p.peer_start, p.peer_start + prefetch.fetched(rid))
            self._counters.add("lookups", 1)
            self._counters.add("lookup_hit_blocks", len(tiers))
        plans.after_lookup(p, num_computed_tokens, len(tiers), tiers)
        if not self._do_load:
            return 0, False
        return plans.loadable_tokens(p, request.num_tokens, self._block_size), False

    def _fetch_from_peer(
        self,
        request: Request,
        p: plans.RequestPlan,
        store_blocks: int,
        computed: int,
        trace: TraceMetadata | None,
    ) -> bool:
        """Starts the local kvmanager fetching from the router's peer what the request could
        load beyond the store's and the engine's own prefix (once per request)."""
        peer = plans.PeerSource.from_params(getattr(request, "kv_transfer_params", None))
        if peer is None or self._prefetch is None:
            return False
        numbers = plans.peer_fetch_range(
            peer, len(p.keys), store_blocks, computed, request.num_tokens, self._block_size
        )
        keys = p.keys[numbers.start : numbers.stop]
        started = self._prefetch.start(request.request_id, peer, self._layout_keys, keys, trace)
        if started:
            p.peer_start = numbers.start
        return started

    def _lookup(self, keys: list[int], trace: TraceMetadata | None = None) -> list[Tier]:
        """The store's leading blocks of ``keys`` that every TP rank's layout has, each with its
        tier (the slowest of the ranks')."""
        try:
            if trace is None:
                return self._lookup_tiers(keys)
            with traced_calls(trace):
                return self._lookup_tiers(keys)
        except Exception:
            log.warning("KV store lookup failed; treating it as a miss", exc_info=True)
            return []

    def _lookup_tiers(self, keys: list[int]) -> list[Tier]:
        client = self._client
        out: list[Tier] | None = None
        for layout_key in self._layout_keys:
            if isinstance(client, TieredLookup):
                tiers = client.lookup_tiers(layout_key, keys)
            else:
                tiers = [Tier.CPU] * client.lookup(layout_key, keys)
            if out is None:
                out = list(tiers)
            else:
                out = [
                    Tier.DISK if Tier.DISK in (a, b) else a
                    for a, b in zip(out, tiers, strict=False)
                ]
        return out or []

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        if num_external_tokens <= 0:
            self._pending_loads.pop(request.request_id, None)
            self._pending_reports.pop(request.request_id, None)
            return
        p = self._plan(request)
        numbers = plans.load_blocks(p, num_external_tokens, self._block_size)
        (block_ids,) = blocks.get_block_ids()
        self._pending_loads[request.request_id] = BlockTransfer(
            req_id=request.request_id,
            block_ids=[block_ids[i] for i in numbers],
            keys=[p.keys[i] for i in numbers],
            trace=trace_metadata(getattr(request, "kv_transfer_params", None)),
        )
        self._pending_reports[request.request_id] = plans.load_report(p, numbers, self._block_size)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = KvmeshConnectorMetadata()
        scheduled = scheduler_output.num_scheduled_tokens
        for req_id, load in self._pending_loads.items():
            if req_id in scheduled:
                meta.loads.append(load)
                self._sent_load(load, self._pending_reports.get(req_id))
        self._pending_loads.clear()
        self._pending_reports.clear()
        if not self._do_save:
            return meta
        for req_id, n in scheduled.items():
            entry = self._plans.get(req_id)
            if entry is None:
                continue
            request, _ = entry
            p = self._plan(request)
            numbers = plans.save_blocks(p, request.num_computed_tokens, n, self._block_size)
            if not numbers:
                continue
            block_ids = self._block_ids(scheduler_output, req_id)
            if block_ids is None or len(block_ids) < numbers.stop:
                continue
            meta.saves.append(
                BlockTransfer(
                    req_id=req_id,
                    block_ids=[block_ids[i] for i in numbers],
                    keys=[p.keys[i] for i in numbers],
                    parent=p.keys[numbers.start - 1] if numbers.start else None,
                    urgent=_urgent(request),
                )
            )
        return meta

    def _sent_load(self, load: BlockTransfer, report: plans.LoadReport | None) -> None:
        """Remembers a load sent to the workers and reports it: vLLM's stats carry the report
        to the worker, in the step that runs the load."""
        entry = self._plans.get(load.req_id)
        params = getattr(entry[0], "kv_transfer_params", None) if entry else None
        report_id = plans.request_id_of(params, load.req_id)
        for rid, r in self._ledger.sent(
            load.req_id, report_id, report or plans.LoadReport(), load.block_ids
        ):
            self._counters.report(rid, r)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """A step's output from the workers: a request whose load names a block that failed
        recomputes from there (vLLM rolls it back), so it reports nothing loaded."""
        for rid, r in self._ledger.failed(connector_output.invalid_block_ids):
            self._counters.report(rid, r)

    def _block_ids(self, scheduler_output: SchedulerOutput, req_id: str) -> list[int] | None:
        state = getattr(scheduler_output, "kv_connector_block_state", None)
        groups = state.get_block_ids(req_id) if state is not None else None
        if groups is None and self._kv_cache_manager is not None:
            groups = self._kv_cache_manager.get_block_ids(req_id)
        return list(groups[0]) if groups else None

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        # Saves were copied out during the steps that computed the blocks: nothing pending.
        # What it loaded goes back with its final output (RequestOutput.kv_transfer_params).
        # Its load cannot have failed unnoticed: vLLM rolls a request back in the step whose
        # output names its failed blocks (that step does not finish it), and
        # update_connector_output sees those blocks at the end of that step.
        self._plans.pop(request.request_id, None)
        self._pending_loads.pop(request.request_id, None)
        self._pending_reports.pop(request.request_id, None)
        if self._prefetch is not None:
            self._prefetch.forget(request.request_id)
        report = self._ledger.finish(request.request_id)
        if report is None:
            return False, None
        return False, {plans.LOAD_REPORT_PARAM: report.to_dict()}

    # ==== worker side =============================================================================
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._layers = kv_layers(kv_caches, self._layer_names, self._num_blocks)
        self._block_bytes = sum(layer.nbytes for layer in self._layers)
        first = self._layers[0].tensor
        log.info(
            "%s: %d KV layers, shape %s (%s), %d bytes per block",
            CONNECTOR_NAME,
            len(self._layers),
            tuple(first.shape),
            first.dtype,
            self._block_bytes,
        )

    @property
    def kv_cache_shapes(self) -> list[tuple[str, tuple[int, ...], str, int]]:
        """Worker side: (layer, KV tensor shape, dtype, block dimension) of each layer copied."""
        return [
            (x.name, tuple(x.tensor.shape), str(x.tensor.dtype), x.block_dim) for x in self._layers
        ]

    @property
    def block_bytes(self) -> int:
        """Bytes of one block over all layers (worker side, after ``register_kv_caches``)."""
        return self._block_bytes

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        self._failed_reqs.clear()
        if not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvmeshConnectorMetadata)
        for load in meta.loads:
            loaded = self._load(load)
            if loaded < len(load.block_ids):
                # The scheduler rolls the request back to the first failed block and
                # recomputes from there (kv_load_failure_policy=recompute).
                self._load_errors.update(load.block_ids[loaded:])
                self._failed_reqs.add(load.req_id)
                self._counters.add("load_failed_blocks", len(load.block_ids) - loaded)
                log.warning(
                    "request %s: %d of %d KV blocks did not load; recomputing them",
                    load.req_id,
                    len(load.block_ids) - loaded,
                    len(load.block_ids),
                )

    def _load(self, load: BlockTransfer) -> int:
        """Writes the sound leading blocks of ``load`` into the KV cache; returns how many."""
        try:
            if load.trace is None:
                blocks = self._client.load(self._layout_key, load.keys) or []
            else:
                with traced_calls(load.trace):
                    blocks = self._client.load(self._layout_key, load.keys) or []
        except Exception:
            log.warning("KV store load failed", exc_info=True)
            blocks = []
        n = 0
        for payload in blocks[: len(load.keys)]:
            size = memoryview(payload).nbytes
            if size != self._block_bytes:
                log.warning(
                    "KV block %016x has %d bytes, expected %d; discarding it",
                    load.keys[n],
                    size,
                    self._block_bytes,
                )
                self._discard(load.keys[n])
                break
            n += 1
        if n == 0:
            return 0
        write_blocks(self._layers, load.block_ids[:n], blocks[:n])
        self._counters.add("load_blocks", n)
        self._counters.add("load_bytes", n * self._block_bytes)
        return n

    def _discard(self, key: int) -> None:
        """Tells the store a block is unusable, so that the recompute can save it again."""
        with self._handed_off_lock:
            self._handed_off.pop(key, None)
        try:
            self._client.discard(self._layout_key, [key])
        except Exception:
            log.warning("KV store discard failed", exc_info=True)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads are whole and synchronous, done in start_load_kv

    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: torch.Tensor,
        attn_metadata: AttentionMetadata,
        **kwargs: Any,
    ) -> None:
        return  # blocks are copied out once per step, after the forward pass (wait_for_save)

    def wait_for_save(self) -> None:
        if self._saver is None or not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvmeshConnectorMetadata)
        runs: list[BlockTransfer] = []
        step_keys: set[int] = set()  # two requests of one step may complete the same block
        for save in meta.saves:
            run = self._new_run(save, step_keys)
            if run is not None:
                runs.append(run)
                step_keys.update(run.keys)
        if runs:
            self._save(runs)

    def _new_run(self, save: BlockTransfer, step_keys: set[int]) -> BlockTransfer | None:
        """The part of ``save`` to copy out: from its first block not handed off before nor
        taken by another run of this step (a chain stays a chain); None when nothing is left,
        or its request must not save."""
        if save.req_id in self._failed_reqs:
            return None  # computed over a block that failed to load: never store that
        first = 0
        keys = save.keys
        with self._handed_off_lock:
            while first < len(keys) and (
                keys[first] in self._handed_off or keys[first] in step_keys
            ):
                first += 1
        self._counters.add("save_deduped_blocks", first)
        if first == len(save.keys):
            return None
        if not first:
            return save
        return BlockTransfer(
            save.req_id,
            save.block_ids[first:],
            save.keys[first:],
            save.keys[first - 1],
            urgent=save.urgent,
        )

    def _save(self, runs: list[BlockTransfer]) -> None:
        """Copies every run of this step out in one pass over the layers and hands each to the
        saver as a job (views of the one copy)."""
        assert self._saver is not None
        n = sum(len(r.keys) for r in runs)
        nbytes = n * self._block_bytes
        if not self._saver.has_room(nbytes):
            self._saver.note_refused(n)
            self._counters.add("save_skipped_blocks", n)
            return
        out = read_blocks(self._layers, [b for r in runs for b in r.block_ids])
        row = 0
        for r in runs:
            k = len(r.keys)
            job = SaveJob(
                layout_key=self._layout_key,
                block_hashes=r.keys,
                parent_hash=r.parent,
                blocks=[memoryview(out[i]) for i in range(row, row + k)],
                nbytes=k * self._block_bytes,
                keep_alive=out,
                urgent=r.urgent,
            )
            row += k
            if not self._saver.try_submit(job):
                self._counters.add("save_skipped_blocks", k)
                continue
            self._counters.add("save_blocks", k)
            self._counters.add("save_bytes", job.nbytes)
            with self._handed_off_lock:
                for key in r.keys:
                    self._handed_off[key] = None
                while len(self._handed_off) > self.config.remembered_saves:
                    self._handed_off.popitem(last=False)

    def _forget_saved(self, job: SaveJob) -> None:
        """Saver thread: the store refused ``job``; let later requests try again."""
        with self._handed_off_lock:
            for k in job.block_hashes:
                self._handed_off.pop(k, None)

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def flush(self, timeout_s: float = SAVER_CLOSE_TIMEOUT_S) -> bool:
        """Waits until every block handed to the saver is in the store (tests, shutdown)."""
        return self._saver.flush(timeout_s) if self._saver is not None else True

    def saver_stats(self) -> dict[str, int]:
        if self._saver is None:
            return {}
        return asdict(self._saver.stats())

    # ==== both sides ==============================================================================
    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        return self._counters.take()

    @classmethod
    def build_kv_connector_stats(
        cls, data: dict[str, Any] | None = None
    ) -> KVConnectorStats | None:
        return KvmeshConnectorStats(data=dict(data or {}))

    def reset_cache(self) -> bool | None:
        with self._handed_off_lock:  # the store may have been reset too: allow saving again
            self._handed_off.clear()
        return True

    def take_events(self) -> Iterable[Any]:
        return ()

    def shutdown(self) -> None:
        if self._prefetch is not None:
            self._prefetch.close()
            self._prefetch = None
        if self._saver is not None:
            self._saver.close(SAVER_CLOSE_TIMEOUT_S)
            self._saver = None
        try:
            self._client.close()
        except Exception:
            log.warning("closing the KV store client failed", exc_info=True)
