"""Sticky until saturated: a cost model of time to first token.

For each candidate ``w``::

    queue_s(w)  = max(waiting(w) * queued_request_s,  # its report, or what this router sent
                                                      # beyond its max running requests
                      prefill_tokens_in_flight(w) * prefill_s_per_token)  # this router's ledger
                  + running_requests(w) * running_request_s
    ttft_s(w)   = queue_s(w)
                  + uncached_tokens(w) * prefill_s_per_token        # recompute what it lacks
                  + cpu_tokens(w) * cpu_s_per_token                 # load what a kvmanager holds
                  + disk_tokens(w) * disk_s_per_token

and the score is ``(min_ttft + floor_s) / (ttft_s(w) + floor_s)``: 1 for the cheapest worker,
smaller as a worker costs more. The worker holding the prefix wins while its queue costs less
than recomputing the prompt elsewhere, and loses it once its queue costs more: prefix affinity
that sheds load from a hot worker. The matched prefix comes from the profile's prefix source.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..workers import WorkerView, waiting
from .params import check, relative_scores
from .plugins import CycleContext


@dataclass(frozen=True, slots=True)
class CostParams:
    prefill_s_per_token: float = 2.5e-5  # prefill time per uncached prompt token (s)
    queued_request_s: float = 0.5  # average prefill time of a request in a worker's queue (s)
    running_request_s: float = 0.0  # slow-down per running request (decode sharing steps) (s)
    cpu_s_per_token: float = 2.0e-6  # time to load a token's KV from a CPU tier (s)
    disk_s_per_token: float = 1.0e-5  # time to load a token's KV from a disk tier (s)
    floor_s: float = 0.05  # costs this close count as equal (keeps idle fleets from flapping)

    def __post_init__(self) -> None:
        for name in (
            "prefill_s_per_token",
            "queued_request_s",
            "running_request_s",
            "cpu_s_per_token",
            "disk_s_per_token",
        ):
            v = getattr(self, name)
            check(v >= 0.0, f"{name} is {v}; use seconds >= 0")
        check(self.floor_s > 0.0, f"floor_s is {self.floor_s}; use seconds > 0")


class CostModelScorer:
    """Favours the worker with the least estimated time to first token (see module doc)."""

    needs_prefix_source = True

    def __init__(self, name: str, params: CostParams) -> None:
        self.name = name
        self._p = params

    def estimate(self, ctx: CycleContext, candidates: Sequence[WorkerView]) -> list[float]:
        """Estimated time to first token on each candidate, in seconds."""
        p = self._p
        req = ctx.request
        prompt = req.prompt_tokens
        total_blocks = len(req.block_hashes)
        fallback_bs = prompt // total_blocks if total_blocks else 0
        matches = ctx.prefix()
        tally = ctx.ledger.tally
        per_tok = p.prefill_s_per_token
        out = []
        for v in candidates:
            load = v.load
            queue = max(
                waiting(v) * p.queued_request_s,
                tally(v.record.worker_id).prefill_tokens * per_tok,
            )
            if p.running_request_s:
                queue += max(load.running_requests, 0) * p.running_request_s
            m = matches.get(v.record.worker_id)
            if m is None or m.blocks <= 0:
                out.append(queue + prompt * per_tok)
                continue
            bs = v.record.block_size or fallback_bs
            uncached = prompt - m.blocks * bs
            out.append(
                queue
                + (uncached if uncached > 0 else 0) * per_tok
                + m.cpu_blocks * bs * p.cpu_s_per_token
                + m.disk_blocks * bs * p.disk_s_per_token
            )
        return out

    def score(self, ctx: CycleContext, candidates: Sequence[WorkerView]) -> Sequence[float]:
        return relative_scores(self.estimate(ctx, candidates), self._p.floor_s)
