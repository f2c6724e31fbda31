"""Aggregated vs disaggregated serving on simulated workers, in one virtual clock.

The driver of ``benchmarks.replay.driver`` with a second stage: every worker's steps run in
global time order; at each arrival the real router core (``router.DisaggRouter``: KV index,
scheduler profile, ``DisaggHandler``) picks the decode worker and, when it disaggregates, a
prefill worker. A disaggregated request then runs in three parts:

1. prefill: the prompt on the prefill worker with one output token (discarded, as the router
   discards it);
2. transfer: the blocks the decode worker does not hold travel from the prefill node's store to
   the decode node's at ``transfer_bytes_per_s`` (the kvmanager peer fetch); the decode worker
   keeps decoding meanwhile (its connector answers vLLM "ask again"). Workers sit on nodes of
   ``MeshSetup.workers_per_node`` (prefill workers spread over them): when the two share a
   node the transfer is free and instant (one kvmanager, shared memory), and only bytes between
   nodes count as "cross-node";
3. decode: the full request on the decode worker with every full prompt block handed over
   (``SimRequest.external_blocks``): loading them into its KV cache costs the worker's
   ``load_s_per_token`` in the admitting step (a stall for its neighbours too); it computes the
   last token(s) and streams. TTFT counts from the arrival at the router.

Inter-token latency is per token: the gap between a request's consecutive token events on the
worker that streams it (a coalesced run of n decode steps counts as n gaps of a 1/n share; the
steps of a run differ by nanoseconds). A decode step that shares its batch with a prefill chunk
lasts longer by that chunk's cost (the simulator's step model), which is what disaggregation
takes away from decode workers.
"""

from __future__ import annotations

import functools
import heapq
import math
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace

from benchmarks.replay.traces import ReplayRequest, cacheable_blocks
from kvmesh.discovery.keys import Role
from services.router.core.disagg import DisaggConfig
from services.router.core.placement import Placement, PlacementConfig
from services.worker.sim.model import SimRequest, SimResult, SimulatedWorker, SimWorkerConfig

KV_BYTES_PER_TOKEN = 131_072  # Llama-3-8B, bf16: 32 layers x 8 KV heads x 128 x 2 (K, V) x 2 B
MODES = ("aggregated", "always", "selective")
PLACEMENTS = tuple(p.value for p in Placement)


@dataclass(frozen=True, slots=True)
class MeshSetup:
    """One column of the comparison."""

    mode: str  # aggregated | always | selective
    workers: int = 8  # total; disaggregated modes split them prefill_workers + the rest
    prefill_workers: int = 4
    threshold_tokens: int = 4096  # selective: DisaggConfig.threshold_tokens
    profile: str = "precise-prefix"  # the router's scheduler profile, both stages
    placement: str = "independent"  # DisaggConfig.placement.mode: independent | joint
    workers_per_node: int = 2  # workers sharing a node (and its kvmanager), in slot order

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"unknown mode {self.mode!r}; choose from {', '.join(MODES)}")
        if self.mode != "aggregated" and not 0 < self.prefill_workers < self.workers:
            raise ValueError("disaggregated modes need 1 <= prefill_workers < workers")
        if self.placement not in PLACEMENTS:
            raise ValueError(
                f"unknown placement {self.placement!r}; choose from {', '.join(PLACEMENTS)}"
            )
        if self.workers_per_node < 1:
            raise ValueError("workers_per_node must be >= 1")

    @property
    def label(self) -> str:
        """The row's mode: e.g. "aggregated", "always joint", "selective 4096 independent"."""
        if self.mode == "aggregated":
            return self.mode
        mode = f"selective {self.threshold_tokens}" if self.mode == "selective" else self.mode
        return f"{mode} {self.placement}"

    def roles(self) -> list[Role]:
        """Per slot; the prefill workers spread evenly over the slots (so over the nodes: with
        4 of 8 workers and 2 per node, every node has one prefill and one decode worker)."""
        if self.mode == "aggregated":
            return [Role.BOTH] * self.workers
        n, p = self.workers, self.prefill_workers
        return [
            Role.PREFILL if -(-(i + 1) * p // n) > -(-i * p // n) else Role.DECODE for i in range(n)
        ]

    def nodes(self) -> list[int]:
        """The node of each slot."""
        return [i // self.workers_per_node for i in range(self.workers)]

    def disagg_config(self, placement: PlacementConfig | None = None) -> DisaggConfig:
        """``placement``: the router's cost calibration (its mode is this setup's)."""
        if self.mode == "aggregated":
            return DisaggConfig(enabled=False)
        pc = replace(placement or PlacementConfig(), mode=Placement(self.placement))
        return DisaggConfig(
            threshold_tokens=1 if self.mode == "always" else self.threshold_tokens,
            placement=pc,
        )


def transfer_s(blocks: int, block_size: int, bytes_per_token: int, bytes_per_s: float) -> float:
    """Seconds to move ``blocks`` KV blocks at ``bytes_per_s`` (0 when infinite)."""
    if blocks <= 0 or math.isinf(bytes_per_s):
        return 0.0
    return blocks * block_size * bytes_per_token / bytes_per_s


def weighted_quantile(pairs: Sequence[tuple[float, int]], q: float) -> float:
    """Nearest-rank quantile of values given as (value, count) pairs (0 when empty)."""
    total = sum(n for _v, n in pairs)
    if total <= 0:
        return 0.0
    rank = min(total, max(1, math.ceil(q * total)))
    seen = 0
    for v, n in sorted(pairs):
        seen += n
        if seen >= rank:
            return v
    return sorted(pairs)[-1][0]


class TokenClock:
    """Per-request token times on the streaming workers: first token and inter-token gaps."""

    def __init__(self) -> None:
        self.first: dict[str, float] = {}
        self._last: dict[str, float] = {}
        self.gaps: list[tuple[float, int]] = []  # (gap per token, tokens)

    def __call__(self, rid: str, n: int, t: float) -> None:
        last = self._last.get(rid)
        if last is None:
            self.first[rid] = t
            n -= 1  # the first token ends TTFT; a later one in the same event is a gap of 0
            if n > 0:
                self.gaps.append((0.0, n))
        else:
            self.gaps.append(((t - last) / n, n))
        self._last[rid] = t


@dataclass(frozen=True, slots=True)
class DisaggReport:
    workload: str
    mode: str
    workers: str  # e.g. "8 both", "4 prefill + 4 decode"
    requests: int
    disaggregated: int  # requests that went through a prefill worker
    ttft_p50_s: float
    ttft_p99_s: float
    itl_p50_ms: float
    itl_p99_ms: float
    output_tokens: int
    output_tokens_per_s: float  # output tokens / (last finish - first arrival)
    e2e_mean_s: float  # arrival to last token, mean over requests
    hit_rate: float  # prompt tokens served from the (decode or both) worker's cache or hand-off
    handoff_gb: float  # KV handed over (blocks the decode worker lacked), 1e9 bytes
    cross_node_gb: float  # of it, moved between nodes (the rest stayed on one node's kvmanager)
    cross_node_mb_per_split: float  # cross-node bytes per disaggregated request, 1e6 bytes
    same_node_splits: int  # disaggregated requests whose two workers shared a node
    virtual_s: float
    wall_s: float

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


def simulate(
    requests: Sequence[ReplayRequest],
    setup: MeshSetup,
    *,
    config: SimWorkerConfig | None = None,
    transfer_bytes_per_s: float = 10e9,
    bytes_per_token: int = KV_BYTES_PER_TOKEN,
    workload: str = "",
    seed: int = 0,
    placement: PlacementConfig | None = None,
) -> DisaggReport:
    """``placement``: the router's cost model (its mode comes from ``setup``); default: the
    router's defaults calibrated to this simulation (bandwidth, KV bytes, prefill per token)."""
    from .router import DisaggRouter

    cfg = config or SimWorkerConfig()
    bs = cfg.block_size
    roles = setup.roles()
    nodes = setup.nodes()
    # The router's cost model calibrated to this simulation (an operator measures these).
    calibration = placement or PlacementConfig(
        network_gbps=transfer_bytes_per_s / 1e9 if math.isfinite(transfer_bytes_per_s) else 1e9,
        kv_bytes_per_token=bytes_per_token,
        prefill_s_per_token=cfg.prefill_s_per_token,
    )
    router = DisaggRouter(
        roles, setup.disagg_config(calibration), setup.profile, seed, nodes=nodes, block_size=bs
    )
    clock = TokenClock()
    fleet = [
        SimulatedWorker(
            cfg,
            kv_sink=functools.partial(router.on_kv_events, i),
            token_sink=None if role is Role.PREFILL else clock,
        )
        for i, role in enumerate(roles)
    ]
    started_wall = time.monotonic()
    heap: list[tuple[float, int]] = []
    scheduled = [math.inf] * len(fleet)
    handoffs: list[tuple[float, int, str]] = []  # (lands at, seq, request id)
    staged: dict[str, tuple[int, SimRequest]] = {}  # rid -> (decode slot, its request)
    prefill_of: dict[tuple[int, str], str] = {}  # (prefill slot, rid) -> rid
    finished: dict[str, SimResult] = {}
    moved_blocks = 0
    cross_blocks = 0
    same_node_splits = 0
    disaggregated = 0
    seq = 0

    def reschedule(i: int) -> None:
        t = fleet[i].next_event_time()
        if t != scheduled[i]:
            scheduled[i] = t
            if t < math.inf:
                heapq.heappush(heap, (t, i))

    def on_results(i: int, results: list[SimResult]) -> None:
        nonlocal moved_blocks, cross_blocks, seq
        for r in results:
            if (i, r.request_id) in prefill_of:  # prefill done: the blocks start travelling
                rid = prefill_of.pop((i, r.request_id))
                slot, sreq = staged[rid]
                have = fleet[slot].prefix_hit_blocks(sreq.block_hashes, sreq.external_blocks)
                missing = sreq.external_blocks - have
                moved_blocks += missing
                seq += 1
                lands = r.finish_s
                if nodes[i] != nodes[slot]:  # one node: its kvmanager already holds them
                    cross_blocks += missing
                    lands += transfer_s(missing, bs, bytes_per_token, transfer_bytes_per_s)
                heapq.heappush(handoffs, (lands, seq, rid))
            else:
                finished[r.request_id] = r

    def next_worker_time() -> float:
        while heap and heap[0][0] != scheduled[heap[0][1]]:
            heapq.heappop(heap)
        return heap[0][0] if heap else math.inf

    arrival_of: dict[str, float] = {}
    idx = 0
    n = len(requests)
    while True:
        tw = next_worker_time()
        th = handoffs[0][0] if handoffs else math.inf
        ta = requests[idx].arrival_s if idx < n else math.inf
        if tw == th == ta == math.inf:
            break
        if tw <= th and tw <= ta:
            _t, i = heapq.heappop(heap)
            scheduled[i] = math.inf
            on_results(i, fleet[i].advance_to(tw))
            reschedule(i)
        elif th <= ta:
            _t, _s, rid = heapq.heappop(handoffs)
            slot, sreq = staged.pop(rid)
            router.pending_decode.discard(rid)
            fleet[slot].advance_to(th)
            fleet[slot].submit(sreq)
            reschedule(slot)
        else:
            req = requests[idx]
            rid = str(idx)
            idx += 1
            arrival_of[rid] = ta
            route = router.route(rid, req, fleet)
            full = SimRequest(rid, req.block_hashes, req.input_tokens, req.output_tokens)
            if route.prefill is None:
                target, sreq = route.decode, full
            else:
                disaggregated += 1
                same_node_splits += nodes[route.prefill] == nodes[route.decode]
                ext = cacheable_blocks(req, bs)
                staged[rid] = (route.decode, replace(full, external_blocks=ext))
                router.pending_decode.add(rid)
                prefill_of[(route.prefill, rid)] = rid
                target, sreq = route.prefill, replace(full, output_tokens=1)
            fleet[target].advance_to(ta)
            fleet[target].submit(sreq)
            reschedule(target)

    ttfts = [clock.first[rid] - arrival_of[rid] for rid in arrival_of if rid in clock.first]
    first = min(arrival_of.values(), default=0.0)
    last = max((r.finish_s for r in finished.values()), default=first)
    out = sum(r.output_tokens for r in finished.values())
    prompt = sum(r.prompt_tokens for r in finished.values())
    cached = sum(r.cached_tokens for r in finished.values())
    e2e = [r.finish_s - arrival_of[r.request_id] for r in finished.values()]
    p = setup.prefill_workers
    return DisaggReport(
        workload=workload,
        mode=setup.label,
        workers=(
            f"{setup.workers} both"
            if setup.mode == "aggregated"
            else f"{p} prefill + {setup.workers - p} decode"
        ),
        requests=n,
        disaggregated=disaggregated,
        ttft_p50_s=_q(ttfts, 0.5),
        ttft_p99_s=_q(ttfts, 0.99),
        itl_p50_ms=weighted_quantile(clock.gaps, 0.5) * 1e3,
        itl_p99_ms=weighted_quantile(clock.gaps, 0.99) * 1e3,
        output_tokens=out,
        output_tokens_per_s=out / (last - first) if last > first else 0.0,
        e2e_mean_s=sum(e2e) / len(e2e) if e2e else 0.0,
        hit_rate=cached / prompt if prompt else 0.0,
        handoff_gb=moved_blocks * bs * bytes_per_token / 1e9,
        cross_node_gb=cross_blocks * bs * bytes_per_token / 1e9,
        cross_node_mb_per_split=(
            cross_blocks * bs * bytes_per_token / 1e6 / disaggregated if disaggregated else 0.0
        ),
        same_node_splits=same_node_splits,
        virtual_s=last - first,
        wall_s=time.monotonic() - started_wall,
    )


def _q(xs: list[float], q: float) -> float:
    return weighted_quantile([(x, 1) for x in xs], q)


def format_table(reports: Sequence[DisaggReport]) -> str:
    head = (
        "| workload | mode | workers | disagg'd | same node | TTFT p50 s | TTFT p99 s "
        "| ITL p50 ms | ITL p99 ms | out tok/s | e2e mean s | hit rate | hand-off GB "
        "| cross-node GB | cross-node MB/split |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
    )
    rows = [
        f"| {r.workload} | {r.mode} | {r.workers} | {r.disaggregated}/{r.requests} "
        f"| {r.same_node_splits} "
        f"| {r.ttft_p50_s:.2f} | {r.ttft_p99_s:.2f} | {r.itl_p50_ms:.1f} | {r.itl_p99_ms:.1f} "
        f"| {r.output_tokens_per_s:.0f} | {r.e2e_mean_s:.1f} | {r.hit_rate:.1%} "
        f"| {r.handoff_gb:.1f} | {r.cross_node_gb:.1f} | {r.cross_node_mb_per_split:.0f} |"
        for r in reports
    ]
    return "\n".join([head, *rows])
