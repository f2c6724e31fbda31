"""Joint prefill/decode placement: the two workers of a disaggregated request chosen together,
by an explicit cost in seconds. Pure: no grpc, etcd or I/O (``DisaggHandler`` calls it).

Picked independently, the prefill worker is the best prefix score anywhere and the decode worker
the best by load and holdings, so a session's KV crosses nodes on nearly every turn. Yet the
hand-off is nearly free on one node (the two workers share the node's kvmanager: shared memory,
no network), and a decode worker whose node already holds most of the prefix (its GPU, or its
kvmanager's cpu/disk tiers, which the KV index counts as its own) needs only the rest::

    cost(P, D) = wait(P) + prefill(P) + network(P, D)
    wait(P)       = outstanding(P) * queued_request_s           # requests ahead of it on P
    prefill(P)    = uncached(P) * prefill_s_per_token          # the prompt P does not hold
    network(P, D) = 0                                          # P and D on one node
                  | handoff_tokens(D) * kv_bytes_per_token / (network_gbps * 1e9)
    handoff_tokens(D) = the prompt's full blocks D lacks, in tokens

``D`` ranges over the profile's decode pick and the decode-capable workers it scored within
``decode_slack`` of it (a fraction of its total) that would also disaggregate. ``P`` ranges
over the profile's own prefill pick (the best prefix score and load anywhere: the profile keeps
balancing the prefill pool) and the prefill candidates on those decode workers' nodes. Least
cost wins; ties go to the profile's order of ``D`` (its pick first), then to the profile's
prefill pick, then to the smaller worker id. The prefix matches come from the profile's own
prefix source (one more index match, over those few workers). A worker with no
``WorkerRecord.node`` is on a node of its own: never free. With no prefill worker on a decode
candidate's node, the prefill worker is the profile's pick.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from enum import StrEnum

from kvmesh.discovery.keys import WorkerId
from kvmesh.errors import InvalidArgument
from kvmesh.settings import setting

from .scheduler import CycleContext, InFlightLedger, PrefixMatchLike
from .types import Explanation, RouteDecision, RouteRequest
from .workers import WorkerView, outstanding

# Each candidate's contiguous matched prefix of the request (absent: none).
PrefixFn = Callable[[RouteRequest, Sequence[WorkerView]], Mapping[WorkerId, PrefixMatchLike]]

POLICY = "joint-placement"  # RouteDecision.policy of a jointly placed prefill worker


class Placement(StrEnum):
    INDEPENDENT = "independent"  # decode by the profile, then prefill by the profile
    JOINT = "joint"  # the (prefill, decode) pair of least cost (module doc)


@dataclass(frozen=True, slots=True)
class PlacementConfig:
    """How the two workers of a disaggregated request are chosen (docs/disaggregation.md)."""

    mode: Placement = setting(
        Placement.INDEPENDENT,
        "independent: the profile picks prefill and decode workers apart; joint: the pair of "
        "least estimated cost, keeping hand-offs on one node when cheap (opt-in, see docs)",
        flag="placement",
    )
    # Bandwidth of a hand-off between nodes (kvmanager peer fetch), 1e9 bytes/s. Within a node
    # the hand-off is free (shared memory).
    network_gbps: float = setting(
        10.0, "joint placement: hand-off bandwidth between nodes, 1e9 bytes/s"
    )
    # KV bytes per token of the served model: layers x KV heads x head dim x 2 (K, V) x dtype
    # bytes. Default: Llama-3-8B in bf16 (32 x 8 x 128 x 2 x 2).
    kv_bytes_per_token: int = setting(
        131_072, "joint placement: KV bytes of one token of the model (Llama-3-8B bf16)"
    )
    prefill_s_per_token: float = setting(
        2.5e-5, "joint placement: prefill time per uncached prompt token, seconds"
    )
    # Wait per request outstanding on a prefill worker, seconds. High on purpose: a count is a
    # coarse proxy of a prefill backlog (one cold long-context prompt is seconds of work), so a
    # pair moves to a busier prefill worker only to save a very long prefill or hand-off; lower
    # values let the same-node preference build prefill hot spots (docs/disaggregation.md).
    queued_request_s: float = setting(
        10.0, "joint placement: wait per request outstanding on a prefill worker, seconds"
    )
    # Also consider decode workers whose profile total is within this fraction of the decode
    # pick's (0: the decode pick only), so a pair on one node can win over a marginally better
    # decode worker elsewhere.
    decode_slack: float = setting(
        0.05, "joint placement: decode workers within this fraction of the pick's total too"
    )

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "mode", Placement(self.mode))
        except ValueError:
            raise InvalidArgument(
                f"disaggregation placement {self.mode!r}; use one of "
                f"{', '.join(p.value for p in Placement)}"
            ) from None
        if not self.network_gbps > 0:
            raise InvalidArgument(f"placement network_gbps is {self.network_gbps}; use > 0")
        if self.kv_bytes_per_token < 1:
            raise InvalidArgument(
                f"placement kv_bytes_per_token is {self.kv_bytes_per_token}; use 1 or more"
            )
        for name in ("prefill_s_per_token", "queued_request_s"):
            if not getattr(self, name) >= 0:
                raise InvalidArgument(f"placement {name} is {getattr(self, name)}; use >= 0 s")
        if not 0.0 <= self.decode_slack <= 1.0:
            raise InvalidArgument(
                f"placement decode_slack is {self.decode_slack}; use a fraction in [0, 1]"
            )


@dataclass(frozen=True, slots=True)
class PairCost:
    """The chosen pair and its estimated cost, term by term (logs, tests, the benchmark)."""

    prefill: WorkerId
    decode: WorkerId
    same_node: bool
    wait_s: float
    prefill_s: float
    network_s: float
    prefill_uncached_tokens: int  # prompt tokens the prefill worker computes
    handoff_tokens: int  # prompt tokens the decode worker lacks (via the network unless same_node)
    decode_uncached_tokens: int  # prompt tokens the decode worker would compute itself

    @property
    def total_s(self) -> float:
        return self.wait_s + self.prefill_s + self.network_s


def profile_prefix(policy: object) -> PrefixFn | None:
    """The prefix matches of a scheduler profile's own prefix source (the precise or approximate
    prefix scorer), or None when the policy has none (the legacy policies)."""
    source = getattr(policy, "prefix_source", None)
    ledger = getattr(policy, "ledger", None)
    if source is None or not isinstance(ledger, InFlightLedger):
        return None

    def match(
        request: RouteRequest, candidates: Sequence[WorkerView]
    ) -> Mapping[WorkerId, PrefixMatchLike]:
        if not request.block_hashes or not candidates:
            return {}
        return source.prefix_match(CycleContext(request, candidates, ledger, source))  # type: ignore[no-any-return]

    return match


def same_node(a: WorkerView, b: WorkerView) -> bool:
    """Both workers name the same node (an unnamed node is never shared)."""
    node = a.record.node
    return bool(node) and node == b.record.node


def layouts_match(a: WorkerView, b: WorkerView) -> bool:
    """One worker can load the blocks the other saves: the same KV layout key (a speculative
    drafter's KV layers, another dtype or block size change it), or either does not say."""
    la, lb = a.record.kv_layout, b.record.kv_layout
    return not la or not lb or la == lb


def decode_shortlist(
    decision: RouteDecision, views: Mapping[WorkerId, WorkerView], slack: float
) -> list[WorkerView]:
    """The decode pick, then the workers the profile scored within ``slack`` (a fraction of the
    pick's total) of it, best first (ties: the profile's candidate order)."""
    out = [views[decision.worker_id]]
    e = decision.explanation
    if e is None or slack <= 0.0 or not e.worker_ids:
        return out
    best = e.winner_total
    floor = best - slack * abs(best) - 1e-12
    n = len(e.worker_ids)
    totals = [sum(col[i] for col in e.columns) for i in range(n)]
    for i in sorted(range(n), key=lambda i: -totals[i]):
        wid = e.worker_ids[i]
        if totals[i] >= floor and wid != decision.worker_id and wid in views:
            out.append(views[wid])
    return out


class JointPlacer:
    """``place(...)``: the (prefill, decode) pair of least cost, or None when no pair is left."""

    def __init__(self, config: PlacementConfig, prefix: PrefixFn | None) -> None:
        self.config = config
        self._prefix = prefix
        self._s_per_token = config.kv_bytes_per_token / (config.network_gbps * 1e9)

    def place(
        self,
        request: RouteRequest,
        decode: RouteDecision,
        decode_cands: Sequence[WorkerView],
        prefill: RouteDecision,
        prefill_cands: Sequence[WorkerView],
        threshold_tokens: int,
    ) -> tuple[RouteDecision, RouteDecision, PairCost] | None:
        """``decode`` and ``prefill`` are the profile's picks among ``decode_cands`` and
        ``prefill_cands``; a pair's decode worker other than the pick must also need at least
        ``threshold_tokens`` prefilled. Each returned decision is the profile's own when its
        worker is the profile's pick."""
        cfg = self.config
        views = {v.record.worker_id: v for v in decode_cands}
        if decode.worker_id not in views:
            raise ValueError(f"decode pick {decode.worker_id} is not among the decode candidates")
        dlist = decode_shortlist(decode, views, cfg.decode_slack)
        nodes = {d.record.node for d in dlist if d.record.node}
        plist = sorted(
            (
                p
                for p in prefill_cands
                if p.record.worker_id == prefill.worker_id or p.record.node in nodes
            ),
            key=lambda p: (p.record.worker_id != prefill.worker_id, p.record.worker_id),
        )
        pool = {v.record.worker_id: v for v in (*dlist, *plist)}
        matches = self._prefix(request, list(pool.values())) if self._prefix else {}
        prompt = request.prompt_tokens
        total = len(request.block_hashes)
        fallback_bs = prompt // total if total else 0

        def held(v: WorkerView) -> tuple[int, int]:  # (matched blocks, block size)
            m = matches.get(v.record.worker_id)
            return (m.blocks if m is not None and m.blocks > 0 else 0), (
                v.record.block_size or fallback_bs
            )

        best: tuple[float, int, int] | None = None
        chosen: PairCost | None = None
        for rank, d in enumerate(dlist):
            d_blocks, d_bs = held(d)
            d_uncached = max(prompt - d_blocks * d_bs, 0)
            if rank and d_uncached < threshold_tokens:
                continue  # it would serve the request aggregated: not this decision's business
            handoff = max(total - d_blocks, 0) * d_bs
            network = handoff * self._s_per_token
            for order, p in enumerate(plist):
                pid = p.record.worker_id
                if pid == d.record.worker_id or not layouts_match(p, d):
                    continue
                p_blocks, p_bs = held(p)
                p_uncached = max(prompt - p_blocks * p_bs, 0)
                local = same_node(p, d)
                cost = PairCost(
                    prefill=pid,
                    decode=d.record.worker_id,
                    same_node=local,
                    wait_s=max(outstanding(p), 0) * cfg.queued_request_s,
                    prefill_s=p_uncached * cfg.prefill_s_per_token,
                    network_s=0.0 if local else network,
                    prefill_uncached_tokens=p_uncached,
                    handoff_tokens=handoff,
                    decode_uncached_tokens=d_uncached,
                )
                key = (cost.total_s, rank, order)
                if best is None or key < best:
                    best, chosen = key, cost
        if chosen is None:
            return None
        if chosen.prefill == prefill.worker_id:
            p_decision = prefill
        else:
            p_decision = self._prefill_decision(chosen, matches, total, prompt, pool, len(plist))
        return (
            self._decode_decision(decode, chosen, matches, total, prompt, views),
            p_decision,
            chosen,
        )

    @staticmethod
    def _decode_decision(
        decode: RouteDecision,
        cost: PairCost,
        matches: Mapping[WorkerId, PrefixMatchLike],
        total: int,
        prompt: int,
        views: Mapping[WorkerId, WorkerView],
    ) -> RouteDecision:
        """The profile's decision, or (another worker won) one that says so: the new winner's
        scores and cached prefix, the profile's pick as the runner-up."""
        if cost.decode == decode.worker_id:
            return decode
        e = decode.explanation
        if e is None:
            return replace(decode, worker_id=cost.decode, reason=POLICY)
        k = e.worker_ids.index(cost.decode)
        m = matches.get(cost.decode)
        blocks = m.blocks if m is not None and m.blocks > 0 else 0
        bs = views[cost.decode].record.block_size or (prompt // total if total else 0)
        explanation = replace(
            e,
            deciding=POLICY,
            winner_scores=tuple(col[k] for col in e.columns),
            runner_up=decode.worker_id,
            runner_up_scores=e.winner_scores,
            tied=1,
            cached_blocks=blocks,
            cached_tokens=min(blocks * bs, prompt),
            cached_gpu_blocks=m.gpu_blocks if m is not None else 0,
        )
        return replace(decode, worker_id=cost.decode, reason=POLICY, explanation=explanation)

    @staticmethod
    def _prefill_decision(
        cost: PairCost,  # a prefill worker other than the profile's pick: on the decode's node
        matches: Mapping[WorkerId, PrefixMatchLike],
        total: int,
        prompt: int,
        pool: Mapping[WorkerId, WorkerView],
        offered: int,
    ) -> RouteDecision:
        m = matches.get(cost.prefill)
        blocks = m.blocks if m is not None and m.blocks > 0 else 0
        reason = "same-node" if cost.same_node else "cross-node"
        bs = pool[cost.prefill].record.block_size or (prompt // total if total else 0)
        explanation = Explanation(
            profile=POLICY,
            deciding=reason,
            candidates=offered,
            eligible=offered,
            scorers=(),
            winner_scores=(),
            cached_blocks=blocks,
            cached_tokens=min(blocks * bs, prompt),
            cached_gpu_blocks=m.gpu_blocks if m is not None else 0,
            total_blocks=total,
        )
        return RouteDecision(cost.prefill, POLICY, reason, explanation)
