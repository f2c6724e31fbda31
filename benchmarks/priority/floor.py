"""``kvmesh bench priority --floor``: how low the interactive tenant's TTFT can go under a
saturating low band, on one simulated engine in virtual time (no processes, no router), for a
few ways of keeping the engine's work short. Pure and deterministic.

The engine (services/worker/sim/model.py, vLLM's priority scheduling) is fed as the router's
flow control would feed it at best: low-band requests (batch and flood alternately, the
``cli.py`` shapes) are topped up after every engine step so that their prompt tokens not yet
prefilled stay at ``backlog_tokens`` and at most ``max_waiting`` of them wait in the engine's
queue (the router knows both first-hand); interactive requests arrive on their own clock, at
phases spread over the step cycle, and go straight to the engine (a reserve: never queued in
front of it). What is left is the engine's own time: the step in progress when an interactive
request arrives (a GPU step is not pre-emptible, neither in vLLM nor here), and its own step,
shared with every running request's decode and the prefill chunks already running. Reported per
setting: the interactive TTFT p50 / p99 alone and under the load, their ratio, the share of time
the engine was busy, and the low band's throughput in uncached prompt tokens per second.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvmesh.kv.events import BlockHash
from services.worker.sim.model import SimRequest, SimulatedWorker, SimWorkerConfig

from .workload import percentile

BLOCK = 32


@dataclass(frozen=True, slots=True)
class Setting:
    name: str
    max_running: int = 64  # the engine's max_num_seqs
    long_prefill_tokens: int = 0  # vLLM's long_prefill_token_threshold; 0: none
    backlog_tokens: int = 2048  # low-band prompt tokens not yet prefilled, kept at most
    max_waiting: int = 1  # low-band requests in the engine's queue, at most


@dataclass(frozen=True, slots=True)
class FloorRow:
    setting: Setting
    alone_p50_s: float
    alone_p99_s: float
    loaded_p50_s: float
    loaded_p99_s: float
    busy: float
    low_tokens_per_s: float

    @property
    def ratio(self) -> float:
        return self.loaded_p99_s / self.alone_p99_s


SETTINGS = (
    Setting("as benchmarked (64 running, no chunk cap, 2K backlog)"),
    Setting("backlog 512", backlog_tokens=512),
    Setting("backlog 512, chunks <= 256", backlog_tokens=512, long_prefill_tokens=256),
    Setting("backlog 256, chunks <= 128", backlog_tokens=256, long_prefill_tokens=128),
    Setting("backlog 128, chunks <= 64", backlog_tokens=128, long_prefill_tokens=64),
    Setting("backlog 64, chunks <= 32", backlog_tokens=64, long_prefill_tokens=32),
    Setting(
        "4 running, backlog 128, chunks <= 64",
        max_running=4,
        backlog_tokens=128,
        long_prefill_tokens=64,
    ),
)


def _hashes(tag: str, n: int) -> tuple[BlockHash, ...]:
    return tuple(BlockHash(hash((tag, i)) & ((1 << 63) - 1)) for i in range(n))


def _request(rid: str, shared: str, shared_tokens: int, new_tokens: int, out: int, prio: int):  # type: ignore[no-untyped-def]
    n = shared_tokens + new_tokens
    blocks = _hashes(shared, shared_tokens // BLOCK) + _hashes(rid, new_tokens // BLOCK)
    return SimRequest(rid, blocks, n, out, priority=prio)


def run_setting(s: Setting, seconds: float = 60.0, interactive_every_s: float = 0.0617) -> FloorRow:
    """Virtual ``seconds`` of interactive arrivals every ``interactive_every_s`` (not a multiple
    of the step length: the arrivals fall at every phase of the step cycle), alone, then with
    the low band kept at its limits."""
    alone = _run(s, seconds, interactive_every_s, low=False)
    loaded = _run(s, seconds, interactive_every_s, low=True)
    return FloorRow(
        s,
        percentile(alone[0], 50),
        percentile(alone[0], 99),
        percentile(loaded[0], 50),
        percentile(loaded[0], 99),
        loaded[1],
        loaded[2],
    )


def _run(s: Setting, seconds: float, every_s: float, low: bool) -> tuple[list[float], float, float]:
    first: dict[str, float] = {}

    def sink(rid: str, _n: int, t: float) -> None:
        first.setdefault(rid, t)

    cfg = SimWorkerConfig(
        max_running=s.max_running,
        priority_scheduling=True,
        long_prefill_tokens=s.long_prefill_tokens,
    )
    w = SimulatedWorker(cfg, token_sink=sink)
    # Shared prefixes cached, as in the bench's warm-up.
    for r in (
        _request("warm-i", "interactive", 512, 64, 1, 10),
        _request("warm-b", "batch", 1024, 512, 1, 0),
    ):
        w.submit(r)
    w.drain()
    start = w.now
    first.clear()
    arrivals = [start + 0.01 + i * every_s for i in range(int(seconds / every_s))]
    sent: dict[str, float] = {}
    low_sent: dict[str, int] = {}  # low-band request -> its uncached prompt tokens
    n_low = 0
    busy = 0.0
    end = start + seconds
    i = 0
    while True:
        nxt_arrival = arrivals[i] if i < len(arrivals) else math.inf
        t = min(nxt_arrival, w.next_event_time())
        if t == math.inf or t > end + 5.0:
            break
        was_busy = not w.idle
        before = w.now
        w.advance_to(t)
        if was_busy:
            busy += t - before
        if t == nxt_arrival:
            rid = f"i{i}"
            w.submit(_request(rid, "interactive", 512, 64, 16, 10))
            sent[rid] = t
            i += 1
        if low and w.now < end:
            while True:
                ld = w.load()
                if ld.waiting >= s.max_waiting:
                    break
                if ld.pending_prefill_tokens >= s.backlog_tokens:
                    break
                n_low += 1
                rid = f"l{n_low}"
                if n_low % 2:
                    w.submit(_request(rid, "batch", 1024, 512, 16, 0))
                    low_sent[rid] = 512
                else:
                    w.submit(_request(rid, "flood-" + rid, 1024, 0, 16, 0))
                    low_sent[rid] = 1024
    ttft = [first[r] - t0 for r, t0 in sent.items() if r in first and t0 < end]
    low_tokens = sum(n for r, n in low_sent.items() if first.get(r, math.inf) < end)
    return ttft, busy / max(min(w.now, end) - start, 1e-9), low_tokens / seconds


def floor_table(rows: list[FloorRow]) -> str:
    lines = [
        "| engine and low-band limits | alone p50 | alone p99 | loaded p50 | loaded p99 "
        "| p99 ratio | engine busy | low band uncached tokens/s |",
        "|" + "---|" * 8,
    ]
    for r in rows:
        lines.append(
            f"| {r.setting.name} | {r.alone_p50_s * 1e3:.1f} ms | {r.alone_p99_s * 1e3:.1f} ms "
            f"| {r.loaded_p50_s * 1e3:.1f} ms | {r.loaded_p99_s * 1e3:.1f} ms "
            f"| {r.ratio:.2f}x | {r.busy:.0%} | {r.low_tokens_per_s:,.0f} |"
        )
    return "\n".join(lines)


def main() -> str:
    rows = [run_setting(s) for s in SETTINGS]
    return floor_table(rows)


if __name__ == "__main__":
    print(main())
