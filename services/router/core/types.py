"""Values the router core works with (protobuf stays at the edge)."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvmesh.discovery.keys import Role, WorkerId
from kvmesh.kv.events import BlockHash


@dataclass(frozen=True, slots=True)
class ChatMessage:
    role: str
    content: str
    name: str = ""
    tool_call_id: str = ""


@dataclass(frozen=True, slots=True)
class LoadSnapshot:
    """A worker's own report of its load (WatchLoad)."""

    running_requests: int = 0
    waiting_requests: int = 0
    in_flight_requests: int = 0
    kv_cache_usage: float = 0.0
    prefix_cache_queried_tokens: int = 0
    prefix_cache_hit_tokens: int = 0
    # Cumulative prefill work the engine measured (WorkerLoad fields 8-9): prompt tokens it
    # computed and the seconds their prefills took; 0: not reported (an older worker).
    prefill_computed_tokens: int = 0
    prefill_s: float = 0.0
    # Cumulative decode output (WorkerLoad fields 16-19): tokens the engine emitted, and with
    # speculative decoding the draft tokens it proposed and accepted. Emitted tokens, not
    # engine steps: a speculating worker emits several tokens a step. 0: not reported.
    generation_tokens: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    # Cumulative decode timing the engine measured (WorkerLoad fields 21-22): finished
    # requests' tokens after their first and the seconds from first to last token; 0: not
    # reported. The step-rate fit (scheduler/steps.py) reads one over the other.
    decode_tokens: int = 0
    decode_s: float = 0.0
    # When the router received this report (its monotonic clock, or a replay's virtual one), s;
    # 0: unknown. Rates learned from cumulative counters divide by the time between reports.
    reported_s: float = 0.0


@dataclass(frozen=True, slots=True)
class RouteRequest:
    """What a routing policy sees of a request."""

    request_id: str
    model: str
    prompt_token_ids: tuple[int, ...] = field(default=(), repr=False)
    session_id: str = ""
    tenant: str = ""
    priority: int = 0
    # The prompt's full blocks, hashed as vLLM hashes them (chained: block i's hash covers
    # blocks 0..i). Empty: prefix-aware scorers score every worker 0.
    block_hashes: tuple[BlockHash, ...] = field(default=(), repr=False)
    # Prompt length in tokens; 0: len(prompt_token_ids). A simulator may set it and send no ids.
    prompt_tokens: int = 0
    # The stage this request needs: BOTH (prefill and decode on one worker), PREFILL or DECODE.
    role: Role = Role.BOTH
    # vLLM's cache_salt for its blocks (its tenant's; ``block_hashes`` are salted with it), sent
    # to the worker with the prompt. "": unsalted.
    cache_salt: str = field(default="", repr=False)

    def __post_init__(self) -> None:
        if not self.prompt_tokens:
            object.__setattr__(self, "prompt_tokens", len(self.prompt_token_ids))


@dataclass(frozen=True, slots=True)
class Explanation:
    """Why a scheduler profile chose a worker. Built on the hot path from references and floats
    only; ``details()`` formats it when someone asks (a debug log, a test, an admin endpoint).

    Scores are weighted (score in [0, 1] times the scorer's weight), in ``scorers`` order; a
    worker's total is their sum."""

    profile: str
    # The scorer whose weighted margin over the runner-up was largest; "tie-break" when every
    # candidate tied, "only-candidate", or the picker's name when it ignores scores.
    deciding: str
    candidates: int  # workers offered to the profile
    eligible: int  # workers left after the filters
    scorers: tuple[str, ...]
    winner_scores: tuple[float, ...]
    runner_up: WorkerId | None = None  # the best worker not tied with the winner
    runner_up_scores: tuple[float, ...] = ()
    tied: int = 1  # workers sharing the best total (the picker chose among them at random)
    cached_blocks: int = -1  # winner's matched prefix in blocks per the profile's prefix source
    cached_tokens: int = -1  # the same in tokens; -1: the profile has no prefix source
    cached_gpu_blocks: int = -1  # of cached_blocks, those in the engine's own memory
    total_blocks: int = 0  # blocks of the request
    stages: tuple[str, ...] = ()  # filters, scorers, picker, in the order they ran
    stage_ns: tuple[int, ...] = ()  # time each stage took
    # Every eligible worker's id and every scorer's weighted column, for ``details(full=True)``.
    worker_ids: tuple[WorkerId, ...] = field(default=(), repr=False)
    columns: tuple[tuple[float, ...] | list[float], ...] = field(default=(), repr=False)

    @property
    def winner_total(self) -> float:
        return sum(self.winner_scores)

    @property
    def runner_up_total(self) -> float:
        return sum(self.runner_up_scores)

    @property
    def margin(self) -> float:
        return self.winner_total - self.runner_up_total if self.runner_up is not None else 0.0

    def details(self, full: bool = False) -> str:
        def fmt(scores: tuple[float, ...] | list[float]) -> str:
            parts = (f"{n}={s:.3f}" for n, s in zip(self.scorers, scores, strict=True))
            return f"total={sum(scores):.3f} [{' '.join(parts)}]"

        lines = [
            f"profile={self.profile} deciding={self.deciding} candidates={self.candidates} "
            f"eligible={self.eligible} tied={self.tied} cached_blocks={self.cached_blocks}/"
            f"{self.total_blocks}",
            f"  winner: {fmt(self.winner_scores)}",
        ]
        if self.runner_up is not None:
            lines.append(f"  runner-up {self.runner_up}: {fmt(self.runner_up_scores)}")
        if self.stages:
            timing = " ".join(
                f"{n}={ns / 1000:.1f}us" for n, ns in zip(self.stages, self.stage_ns, strict=True)
            )
            lines.append(f"  time: {timing}")
        if full and self.worker_ids:
            for i, wid in enumerate(self.worker_ids):
                lines.append(f"  {wid}: {fmt(tuple(col[i] for col in self.columns))}")
        return "\n".join(lines)


@dataclass(frozen=True, slots=True)
class PeerHint:
    """Another node's kvmanager holds a longer prefix of the request than the chosen worker
    (its engine and its node's kvmanager): the worker's connector may have its own kvmanager
    fetch the difference from that peer (KvManager.FetchFromPeer) instead of recomputing it."""

    kvmanager_id: str  # the peer kvmanager (its etcd id)
    blocks: int  # the contiguous prefix of the request the peer holds, in blocks
    local_blocks: int  # what the chosen worker holds (own gpu + its node store), in blocks
    exact: bool = True  # the index's view of the peer's store is EXACT (False: a hint)
    # Priced (core/peer_cost.py; 0 when not): the estimated fetch of the blocks gained over the
    # link's measured speed, and recomputing them (to the longest peer prefix) instead.
    fetch_s: float = 0.0
    recompute_s: float = 0.0
    # The longest the fetch is worth waiting for (KvSource.max_fetch_s); 0: the worker's default.
    max_fetch_s: float = 0.0
    probe: bool = False  # named although its link measured slow: to measure it again
    # How long the worker waits for blocks not there yet (KvSource.handoff_wait_s); 0: its
    # default. Set when the hint names the worker's own node store, which a sibling is saving to.
    wait_s: float = 0.0

    @property
    def gain_blocks(self) -> int:
        return self.blocks - self.local_blocks

    def skipped_text(self) -> str:
        """How a log line says this peer was left out, and why (its price)."""
        return (
            f"peer_skipped={self.kvmanager_id} peer_blocks={self.blocks}"
            f" fetch_s={self.fetch_s:.3f} recompute_s={self.recompute_s:.3f}"
        )


@dataclass(frozen=True, slots=True)
class RouteDecision:
    worker_id: WorkerId
    policy: str
    # Short and from a closed set (safe as a metric label): Explanation.deciding for scheduler
    # profiles; a short free text for the legacy policies.
    reason: str
    explanation: Explanation | None = field(default=None, repr=False, compare=False)
    # Set after the pick (core/peers.py) when a peer kvmanager can supply more of the prefix.
    peer: PeerHint | None = field(default=None, compare=False)
    # A peer that holds more but was not named: fetching from it priced slower (core/peers.py).
    peer_skipped: PeerHint | None = field(default=None, compare=False)
    # The leading blocks of the prompt the worker's node store holds, per an exact index view
    # (core/peers.py); None: unknown. Sent to the worker (store_prefix_blocks).
    store_prefix_blocks: int | None = field(default=None, compare=False)

    def details(self, full: bool = False) -> str:
        head = f"worker={self.worker_id} policy={self.policy} reason={self.reason}"
        if self.peer is not None:
            p = self.peer
            head += f" peer={p.kvmanager_id} peer_blocks={p.blocks} local_blocks={p.local_blocks}"
        if self.peer_skipped is not None:
            head += f" {self.peer_skipped.skipped_text()}"
        if self.explanation is None:
            return head
        return f"{head}\n{self.explanation.details(full)}"

    def attributes(self) -> dict[str, str | int | float]:
        """Span attributes: counts, ids and scores, never prompt text."""
        out: dict[str, str | int | float] = {
            "worker_id": self.worker_id,
            "policy": self.policy,
            "reason": self.reason,
        }
        e = self.explanation
        if e is not None:
            out["eligible"] = e.eligible
            out["tied"] = e.tied
            out["score"] = e.winner_total
            out["margin"] = e.margin
            if e.cached_blocks >= 0:
                out["cached_blocks"] = e.cached_blocks
                out["total_blocks"] = e.total_blocks
            if e.runner_up is not None:
                out["runner_up"] = e.runner_up
        if self.peer is not None:
            out["peer_kvmanager"] = self.peer.kvmanager_id
            out["peer_blocks"] = self.peer.blocks
        if self.peer_skipped is not None:
            out["peer_skipped"] = self.peer_skipped.kvmanager_id
        return out
