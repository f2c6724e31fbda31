"""Prefix scorers: how much of the request's prompt a worker already holds.

Both score ``weighted matched blocks / blocks of the request`` and both are prefix sources (the
first in a profile feeds the cost model). The block walk happens once per cycle for all
candidates: in the KV index for the precise scorer, in one pass over the request's checkpoints
for the approximate one; per candidate there is only a dict lookup.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from kvmesh.discovery.keys import WorkerId
from kvmesh.errors import InvalidArgument
from kvmesh.kv.events import BlockHash

from ..types import RouteDecision, RouteRequest
from ..workers import WorkerView
from .params import check
from .plugins import CycleContext, Matched, PluginEnv, PrefixIndex, PrefixMatchLike

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class TierWeights:
    gpu: float = 1.0  # a block in the engine's own cache
    cpu: float = 0.8  # a block a kvmanager holds in CPU memory (must be loaded first)
    disk: float = 0.5  # a block on a kvmanager's disk

    def __post_init__(self) -> None:
        for tier in ("gpu", "cpu", "disk"):
            v = getattr(self, tier)
            check(0.0 <= v <= 1.0, f"tier_weights.{tier} is {v}; use a weight in [0, 1]")


@dataclass(frozen=True, slots=True)
class PreciseParams:
    tier_weights: TierWeights = field(default_factory=TierWeights)
    # Multiplies the score of a worker whose view in the index is degraded (events lost).
    degraded_factor: float = 0.5
    # 0: the score is the matched share of the prompt. N > 0: a match of N blocks (or of the
    # whole prompt, if longer) scores 1, a shorter one proportionally less: short contexts are
    # cheap to move, so load scorers may place them, while long ones stay where they are cached.
    full_score_blocks: int = 0

    def __post_init__(self) -> None:
        check(
            0.0 <= self.degraded_factor <= 1.0,
            f"degraded_factor is {self.degraded_factor}; use a factor in [0, 1]",
        )
        check(
            self.full_score_blocks >= 0,
            f"full_score_blocks is {self.full_score_blocks}; use 0 (share of the prompt) or more",
        )


class PrecisePrefixScorer:
    """Matched prefix per the KV block index the workers' events feed."""

    def __init__(self, name: str, params: PreciseParams, index: PrefixIndex) -> None:
        self.name = name
        self._p = params
        self._index = index

    @classmethod
    def build(cls, name: str, params: PreciseParams, env: PluginEnv) -> PrecisePrefixScorer:
        if env.index is None:
            raise InvalidArgument(
                f"scorer {name!r} (precise-prefix) needs the KV block index, and this router "
                "has none; enable KV events on the workers or use approximate-prefix"
            )
        return cls(name, params, env.index)

    def prefix_match(self, ctx: CycleContext) -> Mapping[WorkerId, PrefixMatchLike]:
        try:
            return self._index.match(
                ctx.request.block_hashes, [v.record.worker_id for v in ctx.candidates]
            )
        except Exception:  # cache trouble degrades to recompute: score every worker 0
            log.warning("KV index match failed; scoring no prefix hits", exc_info=True)
            return {}

    def score(self, ctx: CycleContext, candidates: Sequence[WorkerView]) -> Sequence[float]:
        total = len(ctx.request.block_hashes)
        if not total:
            return [0.0] * len(candidates)
        matches = ctx.prefix() if ctx.prefix_source is self else self.prefix_match(ctx)
        tw = self._p.tier_weights
        total = max(total, self._p.full_score_blocks)
        wg, wc, wd = tw.gpu / total, tw.cpu / total, tw.disk / total
        degraded = self._p.degraded_factor
        out = []
        for v in candidates:
            m = matches.get(v.record.worker_id)
            if m is None or m.blocks <= 0:
                out.append(0.0)
                continue
            s = m.gpu_blocks * wg + m.cpu_blocks * wc + m.disk_blocks * wd
            if not m.exact:
                s *= degraded
            out.append(1.0 if s > 1.0 else s)
        return out


@dataclass(frozen=True, slots=True)
class ApproxParams:
    # Record every stride-th block hash of a prompt (a block's hash covers its whole prefix, so
    # a checkpoint stands for the blocks before it): matches are exact to within stride-1 blocks
    # and recording/matching cost blocks/stride dict operations.
    stride_blocks: int = 4
    # How many blocks a worker is assumed to keep (its KV cache capacity); older prefixes sent
    # to it are forgotten first (LRU per worker).
    blocks_per_worker: int = 65536

    def __post_init__(self) -> None:
        check(self.stride_blocks >= 1, f"stride_blocks is {self.stride_blocks}; use 1 or more")
        check(
            self.blocks_per_worker >= self.stride_blocks,
            f"blocks_per_worker is {self.blocks_per_worker}; use at least stride_blocks "
            f"({self.stride_blocks})",
        )


class ApproxPrefixScorer:
    """The router's own record of which prompts it sent where, for engines that publish no KV
    events. Learns in ``on_routed``; assumes a worker keeps what it was sent, LRU-bounded."""

    def __init__(self, name: str, params: ApproxParams) -> None:
        self.name = name
        self._stride = params.stride_blocks
        self._capacity = params.blocks_per_worker // params.stride_blocks  # checkpoints
        self._where: dict[BlockHash, int] = {}  # checkpoint hash -> bitmask of workers
        self._lru: dict[WorkerId, OrderedDict[BlockHash, None]] = {}
        self._bit: dict[WorkerId, int] = {}  # worker -> its bit in the masks
        self._by_bit: list[WorkerId] = []

    @classmethod
    def build(cls, name: str, params: ApproxParams, env: PluginEnv) -> ApproxPrefixScorer:
        return cls(name, params)

    # ---- learning ----------------------------------------------------------------------------
    def record(self, hashes: Sequence[BlockHash], worker_id: WorkerId) -> None:
        bit = self._bit.get(worker_id)
        if bit is None:
            bit = self._bit[worker_id] = 1 << len(self._by_bit)
            self._by_bit.append(worker_id)
        lru = self._lru.get(worker_id)
        if lru is None:
            lru = self._lru[worker_id] = OrderedDict()
        where = self._where
        for h in hashes[self._stride - 1 :: self._stride]:
            if h in lru:
                lru.move_to_end(h)
            else:
                lru[h] = None
                where[h] = where.get(h, 0) | bit
        while len(lru) > self._capacity:
            old, _ = lru.popitem(last=False)
            mask = where[old] & ~bit
            if mask:
                where[old] = mask
            else:
                del where[old]

    def on_routed(self, request: RouteRequest, decision: RouteDecision) -> None:
        if request.block_hashes:
            self.record(request.block_hashes, decision.worker_id)

    def __len__(self) -> int:
        """Checkpoints held (for tests and a gauge)."""
        return len(self._where)

    # ---- matching ----------------------------------------------------------------------------
    def match(
        self, hashes: Sequence[BlockHash], workers: Sequence[WorkerId]
    ) -> dict[WorkerId, Matched]:
        alive = 0
        for w in workers:
            alive |= self._bit.get(w, 0)
        out: dict[WorkerId, Matched] = {}
        stride = self._stride
        where = self._where
        j = 0
        for h in hashes[stride - 1 :: stride]:
            if not alive:
                break
            nxt = alive & where.get(h, 0)
            if nxt != alive:
                self._settle(alive & ~nxt, j * stride, out)
                alive = nxt
            j += 1
        if alive:
            self._settle(alive, j * stride, out)
        return out

    def _settle(self, mask: int, blocks: int, out: dict[WorkerId, Matched]) -> None:
        if blocks <= 0:
            return
        m = Matched(blocks=blocks, gpu_blocks=blocks)
        while mask:
            low = mask & -mask
            out[self._by_bit[low.bit_length() - 1]] = m
            mask ^= low

    def prefix_match(self, ctx: CycleContext) -> Mapping[WorkerId, PrefixMatchLike]:
        return self.match(ctx.request.block_hashes, [v.record.worker_id for v in ctx.candidates])

    def score(self, ctx: CycleContext, candidates: Sequence[WorkerView]) -> Sequence[float]:
        total = len(ctx.request.block_hashes)
        if not total:
            return [0.0] * len(candidates)
        matches = ctx.prefix() if ctx.prefix_source is self else self.prefix_match(ctx)
        out = []
        for v in candidates:
            m = matches.get(v.record.worker_id)
            out.append(0.0 if m is None else min(m.blocks / total, 1.0))
        return out
