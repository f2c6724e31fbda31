"""The scheduler side's per-request bookkeeping: which blocks to load, which to save. Pure.

Token counts are vLLM's: ``num_tokens`` (prompt + output so far), ``computed`` (tokens whose KV
is in the engine's cache). Blocks are full blocks of ``block_size`` tokens, numbered from the
start of the prompt; block ``i`` has key ``keys[i]`` (its 64-bit block hash).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

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

    def to_params(self) -> dict[str, Any]:
        """The request's ``kv_transfer_params`` carrying this hint (plain types: it is pickled
        to the engine core)."""
        raw: dict[str, Any] = {"kvmanager_id": self.kvmanager_id, "blocks": self.blocks}
        if self.wait_s > 0:
            raw["wait_s"] = self.wait_s
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
        wait_s = raw.get("wait_s", 0.0)
        if not isinstance(wait_s, int | float) or not 0 <= wait_s <= 600:  # NaN too
            wait_s = 0.0
        return cls(kid, blocks, float(wait_s))


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


def after_lookup(plan: RequestPlan, local_tokens: int, store_blocks: int) -> None:
    """Records a lookup's answer. Blocks the store has need no saving."""
    plan.local_tokens = local_tokens
    plan.store_blocks = store_blocks
    plan.saved_blocks = store_blocks


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
