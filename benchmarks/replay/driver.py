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
"""

from __future__ import annotations

import argparse
import heapq
import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, replace

from kvmesh.kv.events import KvEvent
from services.worker.sim.model import SimRequest, SimResult, SimulatedWorker, SimWorkerConfig

from .traces import Ceiling, ReplayRequest, cacheable_blocks, iter_sorted, quantile


@dataclass(slots=True)
class ClusterView:
    """What a routing policy may look at when a request arrives."""

    now_s: float
    workers: Sequence[SimulatedWorker]  # read only: ``load()``, ``config``
    # Ground truth, per worker: leading blocks of the request in its cache now. Only oracles
    # may use it; a real router knows what its index learned from KV events.
    prefix_hit_blocks: list[int]


RoutePolicy = Callable[[ReplayRequest, ClusterView], int]
KvEventsCallback = Callable[[int, Sequence[KvEvent]], None]


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
    def load_balance(self) -> float:
        """Max over mean input tokens per worker (1.0: perfectly even)."""
        mean = sum(self.worker_input_tokens) / len(self.worker_input_tokens)
        return max(self.worker_input_tokens) / mean if mean else 1.0

    @property
    def requests_per_wall_s(self) -> float:
        return _ratio(self.requests, self.wall_s)

    def as_dict(self) -> dict[str, object]:
        d = asdict(self)
        for name in ("hit_rate", "ceiling", "reusable_rate", "capture_rate", "load_balance"):
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
) -> ReplayReport:
    """Replays ``requests`` (arrival order) on ``workers`` simulated workers of ``config``.
    ``pace``: if set, virtual seconds per wall second (sleeps to keep up; None: flat out)."""
    cfg = config or SimWorkerConfig()
    bs = cfg.block_size

    def sink(i: int) -> Callable[[Sequence[KvEvent]], None] | None:
        if on_kv_events is None:
            return None
        return lambda events: on_kv_events(i, events)

    fleet = [SimulatedWorker(cfg, kv_sink=sink(i)) for i in range(workers)]
    heap: list[tuple[float, int]] = []
    scheduled = [math.inf] * workers  # the live heap entry of each worker
    results: list[SimResult] = []
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
        while heap and heap[0][0] <= t:
            et, i = heapq.heappop(heap)
            if et != scheduled[i]:
                continue  # stale
            wait_for(et)
            scheduled[i] = math.inf
            results.extend(fleet[i].advance_to(et))
            reschedule(i)

    ceiling = Ceiling(bs)
    reusable: list[int] = []
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
        reusable.append(max(hits) * bs)
        ceiling_tokens += ceiling.observe(req)
        input_tokens += req.input_tokens
        i = route(req, ClusterView(t, fleet, hits))
        if not 0 <= i < workers:
            raise ValueError(f"the policy chose worker {i}; there are {workers}")
        worker_input[i] += req.input_tokens
        w = fleet[i]
        w.advance_to(t)  # runs nothing (run_until did): only sets its clock to the arrival
        w.submit(SimRequest(str(n), req.block_hashes, req.input_tokens, req.output_tokens))
        reschedule(i)
    run_until(math.inf)
    return _report(
        policy_name or getattr(route, "name", type(route).__name__),
        workers,
        results,
        reusable,
        worker_input,
        input_tokens,
        ceiling_tokens,
        first_arrival or 0.0,
        time.monotonic() - started_wall,
    )


def _report(
    policy: str,
    workers: int,
    results: list[SimResult],
    reusable: list[int],
    worker_input: list[int],
    input_tokens: int,
    ceiling_tokens: int,
    first_arrival: float,
    wall_s: float,
) -> ReplayReport:
    cached = captured = 0
    ttfts: list[float] = []
    last = first_arrival
    for r in results:
        cached += r.cached_tokens
        captured += min(r.cached_tokens, reusable[int(r.request_id)])
        if r.ttft_s is not None:
            ttfts.append(r.ttft_s)
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
    )


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
