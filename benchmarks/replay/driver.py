"""Replays a request stream against N simulated workers in one virtual clock.

    .venv/bin/python -m benchmarks.replay.driver --trace mooncake --workers 16
    .venv/bin/python -m benchmarks.replay.driver --trace agentic --sessions 32 --workers 16

For each request, in arrival order: every worker runs up to the arrival (all workers' steps in
global time order, so KV events reach ``on_kv_events`` in the order they happened), the routing
policy picks a worker (``route(request, view) -> index``), the worker queues it. After the last
arrival the workers run dry. Metrics (``ReplayReport``):

- input tokens; cached tokens (served from the chosen worker's cache at admission);
- reusable tokens: the longest prefix of the request cached on any one worker when it arrived;
  reusable captured: of those, served from the cache (per request, min(cached, reusable));
- the ceiling: tokens an infinite cache shared by all workers would serve (``traces.Ceiling``);
- load balance: max / mean input tokens per worker; simulated TTFT p50 / p99.

With a ``MeshConfig`` whose nodes have tiers (``mesh.py``), the workers are grouped into nodes,
each with a kvmanager CPU (and disk) tier, and a request is also served from its node's tiers and
from a peer node (its fetch delays its start; TTFT counts from the arrival). The report then says
both: ``cached_tokens`` / ``reusable_tokens`` / ``reusable_captured_tokens`` stay the engines'
own (GPU) figures, comparable with replays without tiers, and the ``*_all`` fields count tokens
served from any tier or peer (``tier_tokens``: how many from each), against the longest prefix
held anywhere (any engine or node store) when the request arrived.
"""

from __future__ import annotations

import argparse
import heapq
import math
import time
from collections.abc import Callable, Container, Iterable, Sequence
from dataclasses import asdict, dataclass, replace

from kvmesh.kv.events import BlockStored, KvEvent
from services.worker.sim.model import SimRequest, SimResult, SimulatedWorker, SimWorkerConfig

from .decisions import DecisionTrace
from .mesh import FetchPlan, MeshConfig, NodeStore, apply_fetch, plan_fetch
from .retention import ReplayRetention
from .traces import Ceiling, ReplayRequest, cacheable_blocks, iter_sorted, quantile


@dataclass(slots=True)
class ClusterView:
    """What a routing policy may look at when a request arrives."""

    now_s: float
    workers: Sequence[SimulatedWorker]  # read only: ``load()``, ``config``
    # Ground truth, per worker: leading blocks of the request in its cache now. Only oracles
    # may use it; a real router knows what its index learned from KV events.
    prefix_hit_blocks: list[int]
    mesh: MeshConfig | None = None  # nodes and tiers; None: workers alone
    stores: Sequence[NodeStore] = ()  # per node: its kvmanager's tiers (read only; oracles)
    # Requests routed whose blocks are still being fetched (not on their engine yet), by id
    in_fetch: Container[str] = frozenset()


RoutePolicy = Callable[[ReplayRequest, ClusterView], int]
KvEventsCallback = Callable[[int, Sequence[KvEvent]], None]  # (worker or node, events)


@dataclass(frozen=True, slots=True)
class ReplayReport:
    policy: str
    workers: int
    requests: int
    input_tokens: int
    cached_tokens: int
    reusable_tokens: int
    reusable_captured_tokens: int
    ceiling_tokens: int
    worker_input_tokens: tuple[int, ...]
    ttft_p50_s: float
    ttft_p99_s: float
    ttft_mean_s: float
    virtual_s: float  # from the first arrival to the last finish
    wall_s: float  # real seconds the replay took
    # Any tier or peer (equal to the GPU figures without tiers):
    cached_all_tokens: int = 0  # prompt tokens served from the engine, a node tier or a peer
    reusable_all_tokens: int = 0  # longest prefix held by any engine or node store at arrival
    reusable_captured_all_tokens: int = 0
    tier_tokens: tuple[tuple[str, int], ...] = ()  # (gpu|cpu|disk|peer, tokens served)
    nodes: int = 0  # 0: no node tiers
    # Prompt tokens each worker's engine computed (prefilled, not served from any cache)
    worker_computed_tokens: tuple[int, ...] = ()

    @property
    def hit_rate(self) -> float:
        return _ratio(self.cached_tokens, self.input_tokens)

    @property
    def ceiling(self) -> float:
        return _ratio(self.ceiling_tokens, self.input_tokens)

    @property
    def reusable_rate(self) -> float:
        return _ratio(self.reusable_tokens, self.input_tokens)

    @property
    def capture_rate(self) -> float:
        """Share of reusable tokens that were served from the cache."""
        return _ratio(self.reusable_captured_tokens, self.reusable_tokens)

    @property
    def hit_rate_all(self) -> float:
        return _ratio(self.cached_all_tokens, self.input_tokens)

    @property
    def capture_rate_all(self) -> float:
        """Share of the reusable tokens (held anywhere) served from any tier or peer."""
        return _ratio(self.reusable_captured_all_tokens, self.reusable_all_tokens)

    @property
    def load_balance(self) -> float:
        """Max over mean input tokens per worker (1.0: perfectly even)."""
        mean = sum(self.worker_input_tokens) / len(self.worker_input_tokens)
        return max(self.worker_input_tokens) / mean if mean else 1.0

    @property
    def computed_balance(self) -> float:
        """Max over mean prompt tokens computed per worker: the prefill work, where
        ``load_balance`` counts cached tokens too (1.0: even)."""
        w = self.worker_computed_tokens
        mean = sum(w) / len(w) if w else 0.0
        return max(w) / mean if mean else 1.0

    @property
    def requests_per_wall_s(self) -> float:
        return _ratio(self.requests, self.wall_s)

    def as_dict(self) -> dict[str, object]:
        d = asdict(self)
        for name in (
            "hit_rate",
            "ceiling",
            "reusable_rate",
            "capture_rate",
            "load_balance",
            "hit_rate_all",
            "capture_rate_all",
        ):
            d[name] = getattr(self, name)
        return d


def _ratio(a: float, b: float) -> float:
    return a / b if b else 0.0


def replay(
    requests: Iterable[ReplayRequest],
    route: RoutePolicy,
    *,
    workers: int = 16,
    config: SimWorkerConfig | None = None,
    on_kv_events: KvEventsCallback | None = None,
    pace: float | None = None,
    policy_name: str = "",
    mesh: MeshConfig | None = None,
    on_tier_events: KvEventsCallback | None = None,
    retention: ReplayRetention | None = None,
    trace: DecisionTrace | None = None,
) -> ReplayReport:
    """Replays ``requests`` (arrival order) on ``workers`` simulated workers of ``config``.
    ``pace``: if set, virtual seconds per wall second (sleeps to keep up; None: flat out).
    ``mesh``: nodes and their tiers (``mesh.py``); ``on_tier_events(node, events)`` gets each
    node store's changes, as the router gets a kvmanager's tier event stream. ``retention``:
    session retention on the node stores (``retention.py``; its ``result`` once done).
    ``trace``: records each request's placement and outcome (``decisions.py``; None: not)."""
    cfg = config or SimWorkerConfig()
    bs = cfg.block_size
    tiered = mesh is not None and mesh.tiered
    if tiered and mesh is not None:
        # The engine loads what it lacks from its node's CPU tier when it admits the request
        # (the connector's lookup at scheduling time), at the CPU link's rate; what the node
        # lacks comes to its CPU tier before (peer, disk: mesh.py).
        cfg = replace(cfg, load_s_per_token=mesh.cpu.s_per_token)
    n_nodes = -(-workers // mesh.workers_per_node) if mesh is not None and tiered else 0

    def tier_sink(j: int) -> Callable[[Sequence[KvEvent]], None] | None:
        if on_tier_events is None:
            return None
        return lambda events: on_tier_events(j, events)

    new_store = retention.store if retention is not None else NodeStore
    stores = [
        new_store(mesh.cpu_blocks, mesh.disk_blocks, bs, tier_sink(j))
        for j in range(n_nodes)
        if mesh is not None
    ]

    def sink(i: int) -> Callable[[Sequence[KvEvent]], None] | None:
        store = stores[mesh.node_of(i)] if tiered and mesh is not None else None
        if on_kv_events is None and store is None:
            return None

        def deliver(events: Sequence[KvEvent]) -> None:
            if on_kv_events is not None:
                on_kv_events(i, events)
            if store is not None:  # write-through: what the engine stores, its node saves
                for ev in events:
                    if isinstance(ev, BlockStored):
                        store.save(ev.block_hashes)

        return deliver

    fleet = [SimulatedWorker(cfg, kv_sink=sink(i)) for i in range(workers)]
    heap: list[tuple[float, int]] = []
    scheduled = [math.inf] * workers  # the live heap entry of each worker
    results: list[SimResult] = []
    # Requests whose blocks are being fetched: (ready at, n, worker, request)
    fetching: list[tuple[float, int, int, SimRequest]] = []
    in_fetch: set[str] = set()
    arrival: dict[str, float] = {}
    plans: dict[str, FetchPlan] = {}
    started_wall = time.monotonic()

    def wait_for(t: float) -> None:
        if pace is not None and pace > 0:
            delay = started_wall + t / pace - time.monotonic()
            if delay > 0:
                time.sleep(delay)

    def reschedule(i: int) -> None:
        t = fleet[i].next_event_time()
        if t != scheduled[i]:
            scheduled[i] = t
            if t < math.inf:
                heapq.heappush(heap, (t, i))

    def run_until(t: float) -> None:
        while True:
            step_t = heap[0][0] if heap else math.inf
            fetch_t = fetching[0][0] if fetching else math.inf
            if min(step_t, fetch_t) > t or not (heap or fetching):
                return
            if fetch_t < step_t:  # a fetch done: the request reaches its engine
                ft, _n, i, sreq = heapq.heappop(fetching)
                in_fetch.discard(sreq.request_id)
                wait_for(ft)
                fleet[i].advance_to(ft)  # runs nothing: only sets its clock
                fleet[i].submit(sreq)
                reschedule(i)
                continue
            et, i = heapq.heappop(heap)
            if et != scheduled[i]:
                continue  # stale
            wait_for(et)
            scheduled[i] = math.inf
            results.extend(fleet[i].advance_to(et))
            reschedule(i)

    ceiling = Ceiling(bs)
    reusable: list[int] = []
    reusable_all: list[int] = []
    worker_input = [0] * workers
    input_tokens = ceiling_tokens = 0
    first_arrival: float | None = None
    for n, req in enumerate(iter_sorted(requests)):
        t = req.arrival_s
        if first_arrival is None:
            first_arrival = t
        run_until(t)
        wait_for(t)
        limit = cacheable_blocks(req, bs)
        hits = [w.prefix_hit_blocks(req.block_hashes, limit) for w in fleet]
        best_gpu = max(hits)
        reusable.append(best_gpu * bs)
        held = best_gpu
        for st in stores:
            if held >= limit:
                break
            if req.block_hashes[held] in st:
                held = max(held, st.prefix(req.block_hashes, limit))
        reusable_all.append(held * bs)
        ceiling_tokens += ceiling.observe(req)
        input_tokens += req.input_tokens
        i = route(req, ClusterView(t, fleet, hits, mesh, stores, in_fetch))
        if not 0 <= i < workers:
            raise ValueError(f"the policy chose worker {i}; there are {workers}")
        if trace is not None:
            trace.routed(n, t, req, i, worker_input, reusable_all[-1])
        worker_input[i] += req.input_tokens
        rid = str(n)
        arrival[rid] = t
        external = 0
        delay = 0.0
        if tiered and mesh is not None:
            node = mesh.node_of(i)
            plan = plan_fetch(mesh, stores, node, req.block_hashes, hits[i], limit, bs)
            apply_fetch(stores, node, req.block_hashes, plan)
            plans[rid] = plan
            if retention is not None:
                retention.routed(rid, req, node, plan, t)
            external = plan.blocks if plan.blocks > hits[i] else 0
            if stores[node].prefix(req.block_hashes, plan.gpu_blocks) >= plan.gpu_blocks:
                # Written through, the node holds the engine's own prefix too: blocks the engine
                # evicts while the request waits are loaded from the node at admission.
                external = plan.blocks
            delay = plan.fetch_s
        sreq = SimRequest(rid, req.block_hashes, req.input_tokens, req.output_tokens, external)
        if delay > 0:
            heapq.heappush(fetching, (t + delay, n, i, sreq))
            in_fetch.add(rid)
            continue
        w = fleet[i]
        w.advance_to(t)  # runs nothing (run_until did): only sets its clock to the arrival
        w.submit(sreq)
        reschedule(i)
    run_until(math.inf)
    if retention is not None:
        retention.finished(results, arrival)
    if trace is not None:
        for r in results:
            trace.served(r, served_from(r, plans.get(r.request_id), bs), arrival[r.request_id])
    rep = _report(
        policy_name or getattr(route, "name", type(route).__name__),
        workers,
        results,
        reusable,
        reusable_all,
        worker_input,
        input_tokens,
        ceiling_tokens,
        first_arrival or 0.0,
        time.monotonic() - started_wall,
        arrival,
        plans,
        n_nodes,
        bs,
    )
    return replace(
        rep, worker_computed_tokens=tuple(w.load().prefill_computed_tokens for w in fleet)
    )


def _report(
    policy: str,
    workers: int,
    results: list[SimResult],
    reusable: list[int],
    reusable_all: list[int],
    worker_input: list[int],
    input_tokens: int,
    ceiling_tokens: int,
    first_arrival: float,
    wall_s: float,
    arrival: dict[str, float],
    plans: dict[str, FetchPlan],
    nodes: int,
    bs: int,
) -> ReplayReport:
    cached = captured = cached_all = captured_all = 0
    tiers = {"gpu": 0, "cpu": 0, "disk": 0, "peer": 0}
    ttfts: list[float] = []
    last = first_arrival
    for r in results:
        n = int(r.request_id)
        gpu, cpu, disk, peer = served_from(r, plans.get(r.request_id), bs)
        cached += gpu
        captured += min(gpu, reusable[n])
        cached_all += r.cached_tokens
        captured_all += min(r.cached_tokens, reusable_all[n])
        tiers["gpu"] += gpu
        tiers["cpu"] += cpu
        tiers["disk"] += disk
        tiers["peer"] += peer
        if r.first_token_s is not None:
            ttfts.append(r.first_token_s - arrival.get(r.request_id, r.arrival_s))
        last = max(last, r.finish_s)
    return ReplayReport(
        policy=policy,
        workers=workers,
        requests=len(reusable),
        input_tokens=input_tokens,
        cached_tokens=cached,
        reusable_tokens=sum(reusable),
        reusable_captured_tokens=captured,
        ceiling_tokens=ceiling_tokens,
        worker_input_tokens=tuple(worker_input),
        ttft_p50_s=quantile(ttfts, 0.5),
        ttft_p99_s=quantile(ttfts, 0.99),
        ttft_mean_s=sum(ttfts) / len(ttfts) if ttfts else 0.0,
        virtual_s=last - first_arrival,
        wall_s=wall_s,
        cached_all_tokens=cached_all,
        reusable_all_tokens=sum(reusable_all),
        reusable_captured_all_tokens=captured_all,
        tier_tokens=tuple(tiers.items()),
        nodes=nodes,
    )


def served_from(r: SimResult, plan: FetchPlan | None, bs: int) -> tuple[int, int, int, int]:
    """A finished request's cached prompt tokens by where they came from: (gpu, cpu, disk,
    peer); what is left of its prompt was computed."""
    gpu = r.cached_tokens - r.loaded_tokens  # served by the engine's own cache
    if plan is None or not r.loaded_tokens:
        return gpu, 0, 0, 0
    peer = min(plan.peer_blocks * bs, r.loaded_tokens)
    disk = min(plan.disk_blocks * bs, r.loaded_tokens - peer)
    # The rest came from the node's CPU tier (the engine lost some of its own blocks while the
    # fetch ran: the node had them, written through).
    return gpu, r.loaded_tokens - peer - disk, disk, peer


def format_table(reports: Sequence[ReplayReport]) -> str:
    """A markdown table of reports side by side."""
    head = (
        "| policy | hit rate | ceiling | reusable | captured | max/mean load | TTFT p50 s "
        "| TTFT p99 s | wall s | req/s |\n|---|---|---|---|---|---|---|---|---|---|"
    )
    rows = [
        f"| {r.policy} | {r.hit_rate:.1%} | {r.ceiling:.1%} | {r.reusable_rate:.1%} "
        f"| {r.capture_rate:.1%} | {r.load_balance:.2f} | {r.ttft_p50_s:.2f} "
        f"| {r.ttft_p99_s:.2f} | {r.wall_s:.1f} | {r.requests_per_wall_s:.0f} |"
        for r in reports
    ]
    return "\n".join([head, *rows])


def main(argv: Sequence[str] | None = None) -> None:
    from .agentic import AgenticConfig, agentic_sessions
    from .policies import BUILTIN
    from .traces import MOONCAKE_TRACE, load_mooncake

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--trace", choices=["mooncake", "agentic"], default="mooncake")
    p.add_argument("--trace-file", default=str(MOONCAKE_TRACE), help="Mooncake JSONL file")
    p.add_argument("--limit", type=int, default=None, help="first N Mooncake requests only")
    p.add_argument("--sessions", type=int, default=32, help="agentic: main sessions")
    p.add_argument("--seed", type=int, default=0, help="agentic: generator seed")
    p.add_argument("--workers", type=int, default=16)
    defaults = SimWorkerConfig()
    p.add_argument("--capacity-blocks", type=int, default=defaults.capacity_blocks)
    p.add_argument("--block-size", type=int, default=defaults.block_size)
    p.add_argument("--policies", default=",".join(BUILTIN), help="comma-separated")
    p.add_argument("--pace", type=float, default=None, help="virtual s per wall s (sleeps)")
    args = p.parse_args(argv)
    cfg = replace(defaults, capacity_blocks=args.capacity_blocks, block_size=args.block_size)
    reports = []
    for name in args.policies.split(","):
        if name not in BUILTIN:
            p.error(f"unknown policy {name!r}; choose from {', '.join(BUILTIN)}")
        if args.trace == "mooncake":
            reqs: Iterable[ReplayRequest] = load_mooncake(
                args.trace_file, args.block_size, args.limit
            )
        else:
            acfg = AgenticConfig(seed=args.seed, sessions=args.sessions, block_size=args.block_size)
            reqs = agentic_sessions(acfg)
        report = replay(reqs, BUILTIN[name](), workers=args.workers, config=cfg, pace=args.pace)
        reports.append(report)
        print(
            f"{name}: {report.requests} requests, {report.virtual_s:.0f} virtual s in "
            f"{report.wall_s:.1f} wall s",
            flush=True,
        )
    print(format_table(reports))


if __name__ == "__main__":
    main()
