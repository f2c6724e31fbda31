"""Prompts the workers computed moments ago, before the KV index hears of them. Pure.

A worker's KV events (vLLM's BlockStored, batched and streamed) and its node store's tier events
reach the router tens of milliseconds after the prefill, more on a busy host. A request sent in
that gap to another worker on the same node store (a fan-out's later choices, which start at the
first's first token; a request balanced off the busy worker) would see nothing cached anywhere
and recompute a prompt whose blocks are in the node store a moment later. The router knows
sooner: the worker's first token means the prompt's blocks are computed (and its save to the
node store under way). ``RecentPrefills`` keeps that for ``ttl_s``, as llm-d's speculative
index entries keep a routed prefix until the events arrive: ``peers.PeerHints`` reads it
beside the index to have such a request wait for the save instead of recomputing.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Container, Sequence
from dataclasses import dataclass
from itertools import repeat

from kvmesh.discovery.keys import WorkerId
from kvmesh.errors import InvalidArgument
from kvmesh.kv.events import BlockHash

STRIDE = 16  # blocks between two kept entries of a prompt


@dataclass(frozen=True, slots=True)
class RecentPrefillsConfig:
    ttl_s: float = 2.0  # how long an entry stands in for the events (they come much sooner)
    max_blocks: int = 131072  # entries kept (every 16th block), in two generations: ~100 B each

    def __post_init__(self) -> None:
        if not 0 <= self.ttl_s <= 60:
            raise InvalidArgument(f"recent prefills ttl_s is {self.ttl_s}; use 0-60 seconds")
        if self.max_blocks < 1:
            raise InvalidArgument(f"recent prefills max_blocks is {self.max_blocks}; use 1 or more")


class RecentPrefills:
    """Block hash -> the worker that last computed it and until when that counts.

    Cheap on the router's loop, whatever the prompt's length: a prompt goes in as every
    ``STRIDE``-th block hash and its last, with one C-level ``dict.update``, and ``held`` is a
    binary search over those (a block hash chains every token before it, so a worker that
    computed block i computed blocks 0..i) and at most ``STRIDE`` lookups for the last. Bounded: two generations of at
    most ``max_blocks / 2`` entries each; the older is dropped when the newer fills or turns
    ``ttl_s`` old."""

    def __init__(
        self,
        config: RecentPrefillsConfig | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._cfg = config or RecentPrefillsConfig()
        self._clock = clock
        self._new: dict[BlockHash, tuple[WorkerId, float]] = {}
        self._old: dict[BlockHash, tuple[WorkerId, float]] = {}
        self._new_since = clock()

    def __len__(self) -> int:
        return len(self._new) + len(self._old)

    def computed(self, hashes: Sequence[BlockHash], worker_id: WorkerId) -> None:
        """``worker_id`` has just computed the blocks ``hashes`` (its first token came)."""
        ttl_s = self._cfg.ttl_s
        if ttl_s <= 0 or not hashes:
            return
        now = self._clock()
        half = max(self._cfg.max_blocks // 2, 1)
        head = hashes[: half * STRIDE]
        # Every STRIDE-th block and the last: held() finds the last one it holds exactly.
        kept = [*head[::STRIDE], head[-1]][:half] if len(head) > 1 else head
        if len(self._new) + len(kept) > half or now - self._new_since > ttl_s:
            self._old, self._new, self._new_since = self._new, {}, now
        self._new.update(zip(kept, repeat((worker_id, now + ttl_s))))

    def _holder(self, h: BlockHash, now: float) -> WorkerId | None:
        entry = self._new.get(h) or self._old.get(h)
        if entry is None or entry[1] < now:
            return None
        return entry[0]

    def held(self, hashes: Sequence[BlockHash], workers: Container[WorkerId]) -> int:
        """How many leading blocks of ``hashes`` one of ``workers`` computed within ``ttl_s``
        (each block counted for whichever worker computed it last): exact when ``hashes``
        starts with a whole prompt noted; for a shorter prefix of one, a lower bound (its last
        kept point, up to ``STRIDE`` - 1 blocks short)."""
        if not (self._new or self._old) or not hashes:
            return 0
        now = self._clock()
        n = len(hashes)
        if self._holder(hashes[0], now) not in workers:
            return 0  # the common case, one lookup
        # The last kept stride point held (binary search over 0, STRIDE, 2*STRIDE, ...), then
        # the prompt's own last block, if it ends before the next stride point.
        lo, hi = 1, (n - 1) // STRIDE + 1  # points [0, lo) held; [hi, ...) not
        while lo < hi:
            mid = (lo + hi) // 2
            if self._holder(hashes[mid * STRIDE], now) in workers:
                lo = mid + 1
            else:
                hi = mid
        base = (lo - 1) * STRIDE
        for i in range(min(base + STRIDE, n) - 1, base, -1):
            if self._holder(hashes[i], now) in workers:
                return i + 1
        return base + 1
