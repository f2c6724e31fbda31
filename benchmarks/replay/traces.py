"""The request stream a replay consumes, the Mooncake trace as such a stream, and the properties
of a stream that do not depend on any cache (its ceiling, its reuse).

A Mooncake hash id names 512 tokens (equal id = equal content and equal prefix); an engine caches
in smaller blocks. ``expand_hash_ids`` maps each id to ``512 // block_size`` engine block hashes,
``mix64(id * per_id + i)`` for the id's ``i``-th engine block: equal ids give equal blocks, and
since ids are already prefix-chained so are the engine blocks. The prompt's last, partial engine
block gets no hash (an engine never caches it).
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from kvmesh.kv.events import BlockHash

MOONCAKE_BLOCK_TOKENS = 512
MOONCAKE_TRACE = Path("/work/shared/traces/mooncake/synthetic_trace.jsonl")
_MASK = (1 << 64) - 1


@dataclass(frozen=True, slots=True)
class ReplayRequest:
    arrival_s: float  # seconds from the start of the trace
    session_id: str  # "" when the trace has no sessions
    block_hashes: tuple[BlockHash, ...] = field(repr=False)  # full prompt blocks, chained
    input_tokens: int
    output_tokens: int


def mix64(x: int) -> int:
    """A bijection of 64-bit integers (splitmix64's finalizer): distinct keys, distinct hashes."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


class MooncakeExpander:
    """Expands Mooncake hash ids into engine block hashes; remembers each id's blocks."""

    def __init__(self, block_size: int = 32) -> None:
        if block_size <= 0 or MOONCAKE_BLOCK_TOKENS % block_size:
            raise ValueError(f"block_size must divide {MOONCAKE_BLOCK_TOKENS} (got {block_size})")
        self.block_size = block_size
        self.per_id = MOONCAKE_BLOCK_TOKENS // block_size
        self._memo: dict[int, tuple[BlockHash, ...]] = {}

    def blocks_of(self, hash_id: int) -> tuple[BlockHash, ...]:
        blocks = self._memo.get(hash_id)
        if blocks is None:
            base = hash_id * self.per_id
            blocks = tuple(BlockHash(mix64(base + i)) for i in range(self.per_id))
            self._memo[hash_id] = blocks
        return blocks

    def expand(self, hash_ids: Sequence[int], input_tokens: int) -> tuple[BlockHash, ...]:
        """The engine blocks of a prompt of ``input_tokens`` tokens: full blocks only."""
        n_full = input_tokens // self.block_size
        if n_full > len(hash_ids) * self.per_id:
            raise ValueError(
                f"{input_tokens} tokens need {n_full} blocks; {len(hash_ids)} hash ids give "
                f"{len(hash_ids) * self.per_id}"
            )
        out: list[BlockHash] = []
        for hid in hash_ids[: -(-n_full // self.per_id)]:
            out.extend(self.blocks_of(hid))
        del out[n_full:]
        return tuple(out)


def expand_hash_ids(
    hash_ids: Sequence[int], input_tokens: int, block_size: int = 32
) -> tuple[BlockHash, ...]:
    return MooncakeExpander(block_size).expand(hash_ids, input_tokens)


def load_mooncake(
    path: Path | str = MOONCAKE_TRACE, block_size: int = 32, limit: int | None = None
) -> list[ReplayRequest]:
    """The Mooncake trace (one JSON object a line: ``timestamp`` ms, ``input_length``,
    ``output_length``, ``hash_ids``) as replay requests, in arrival order."""
    expander = MooncakeExpander(block_size)
    out: list[ReplayRequest] = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if limit is not None and len(out) >= limit:
                break
            if not line.strip():
                continue
            rec = json.loads(line)
            n_in = int(rec["input_length"])
            out.append(
                ReplayRequest(
                    arrival_s=rec["timestamp"] / 1000.0,
                    session_id="",
                    block_hashes=expander.expand(rec["hash_ids"], n_in),
                    input_tokens=n_in,
                    output_tokens=max(1, int(rec["output_length"])),
                )
            )
    out.sort(key=lambda r: r.arrival_s)
    return out


def cacheable_blocks(request: ReplayRequest, block_size: int) -> int:
    """The most blocks any cache can serve for ``request``: its full blocks, less the last
    prompt token (an engine always computes it, as vLLM does)."""
    return min(len(request.block_hashes), (request.input_tokens - 1) // block_size)


def prefix_in(blocks: set[BlockHash], hashes: Sequence[BlockHash], limit: int) -> int:
    """Leading blocks of ``hashes`` (at most ``limit``) in ``blocks``, a prefix-closed set."""
    n = min(limit, len(hashes))
    if n <= 0 or hashes[0] not in blocks:
        return 0
    if hashes[n - 1] in blocks:
        return n
    lo, hi = 0, n - 1
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if hashes[mid] in blocks:
            lo = mid
        else:
            hi = mid
    return hi


class Ceiling:
    """An infinite cache shared by every worker, filled on arrival: how much of each request
    repeats an earlier one. Feed requests in arrival order."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._seen: set[BlockHash] = set()

    def observe(self, request: ReplayRequest) -> int:
        """Tokens of ``request``'s prefix seen before (at most its cacheable blocks)."""
        hit = prefix_in(
            self._seen, request.block_hashes, cacheable_blocks(request, self.block_size)
        )
        self._seen.update(request.block_hashes)
        return hit * self.block_size


@dataclass(frozen=True, slots=True)
class StreamStats:
    requests: int
    sessions: int
    duration_s: float
    input_tokens: int
    output_tokens: int
    ceiling_tokens: int  # tokens an infinite global cache would serve
    median_input: float
    p90_input: float
    median_input_late: float  # requests in the last quarter of their session (0: no sessions)
    median_output: float
    reuse90_fraction: float  # share of requests whose prefix repeats >= 90% of their input

    @property
    def ceiling(self) -> float:
        return self.ceiling_tokens / self.input_tokens if self.input_tokens else 0.0

    def summary(self) -> str:
        return (
            f"{self.requests} requests, {self.sessions} sessions over {self.duration_s:.0f} s; "
            f"input median {self.median_input:.0f} (p90 {self.p90_input:.0f}, late in sessions "
            f"{self.median_input_late:.0f}), output median {self.median_output:.0f}; ceiling "
            f"{self.ceiling:.1%}; {self.reuse90_fraction:.1%} reuse >= 90% of an earlier request"
        )


def stream_stats(requests: Iterable[ReplayRequest], block_size: int = 32) -> StreamStats:
    """Properties of a request stream (arrival order), independent of any cache. A request's
    session is ``session_id`` up to the first ``/`` (sub-agents count with their session)."""
    ceiling = Ceiling(block_size)
    inputs: list[int] = []
    outputs: list[int] = []
    by_session: dict[str, list[int]] = {}
    total_ceiling = reuse90 = 0
    first = last = 0.0
    for i, r in enumerate(requests):
        if i == 0:
            first = r.arrival_s
        last = r.arrival_s
        hit = ceiling.observe(r)
        total_ceiling += hit
        reuse90 += hit >= 0.9 * r.input_tokens
        inputs.append(r.input_tokens)
        outputs.append(r.output_tokens)
        if r.session_id:
            by_session.setdefault(r.session_id.split("/", 1)[0], []).append(r.input_tokens)
    late = [x for xs in by_session.values() for x in xs[len(xs) - max(1, len(xs) // 4) :]]
    n = len(inputs)
    return StreamStats(
        requests=n,
        sessions=len(by_session),
        duration_s=last - first,
        input_tokens=sum(inputs),
        output_tokens=sum(outputs),
        ceiling_tokens=total_ceiling,
        median_input=statistics.median(inputs) if inputs else 0.0,
        p90_input=quantile(inputs, 0.9),
        median_input_late=statistics.median(late) if late else 0.0,
        median_output=statistics.median(outputs) if outputs else 0.0,
        reuse90_fraction=reuse90 / n if n else 0.0,
    )


def quantile(xs: Sequence[float], q: float) -> float:
    """Nearest-rank quantile (0 for an empty sequence)."""
    if not xs:
        return 0.0
    s = sorted(xs)
    return float(s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))])


def iter_sorted(requests: Iterable[ReplayRequest]) -> Iterator[ReplayRequest]:
    """Passes requests through, raising ``ValueError`` if they go back in time."""
    last = float("-inf")
    for r in requests:
        if r.arrival_s < last:
            raise ValueError(f"requests must come in arrival order ({r.arrival_s} < {last})")
        last = r.arrival_s
        yield r
