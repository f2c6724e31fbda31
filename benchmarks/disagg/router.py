"""The real router core over simulated workers with roles: the KV index fed by their KV
events, a scheduler profile (``make_policy``) and the real ``DisaggHandler`` deciding, per
request, aggregated or disaggregated and on which workers. Only the transport is missing (as in
``benchmarks.replay.router_policy``)."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from benchmarks.replay.traces import ReplayRequest
from kvmesh.discovery.keys import Role, WorkerId, WorkerRecord
from kvmesh.kv.events import KvEvent, KvEventBatch
from services.router.core.disagg import DisaggConfig, DisaggDecision, DisaggHandler
from services.router.core.index import KvIndex
from services.router.core.index_types import IndexConfig
from services.router.core.routing import make_policy
from services.router.core.types import LoadSnapshot, RouteDecision, RouteRequest
from services.router.core.workers import WorkerSet
from services.worker.sim.model import SimulatedWorker

EPOCH = "disagg"
MODEL = "sim"


@dataclass(frozen=True, slots=True)
class Route:
    """Where one request goes: ``prefill`` is None when it is served aggregated."""

    decode: int
    prefill: int | None
    reason: str
    uncached_tokens: int


class DisaggRouter:
    def __init__(
        self,
        roles: Sequence[Role],
        config: DisaggConfig,
        profile: str = "precise-prefix",
        seed: int = 0,
        *,
        nodes: Sequence[int] | None = None,
        block_size: int = 0,
    ) -> None:
        """``nodes``: each slot's node number (``WorkerRecord.node``; default: one per worker)."""
        self.index = KvIndex(IndexConfig(max_blocks=8_000_000))
        self.policy = make_policy(profile, index=self.index, rng=random.Random(seed))
        self.handler = DisaggHandler(config, self.policy)
        self.workers = WorkerSet()
        self.roles = tuple(roles)
        self.ids = [WorkerId(f"{r.value}-{i:02d}") for i, r in enumerate(roles)]
        self._slot = {wid: i for i, wid in enumerate(self.ids)}
        self._seq = [0] * len(roles)
        node_of = list(nodes) if nodes is not None else list(range(len(roles)))
        for wid, role, node in zip(self.ids, roles, node_of, strict=True):
            rec = WorkerRecord(
                worker_id=wid,
                address="sim",
                model=MODEL,
                model_path="",
                role=role,
                node=f"node-{node:02d}",
                block_size=block_size,
            )
            self.workers.apply_put(rec)
            self.index.apply(KvEventBatch(wid, EPOCH, 0, (), snapshot=True))
        self.reasons: dict[str, int] = {}
        self.pending_decode: set[str] = set()  # set by the simulation: hand-offs in transit
        # (request id, stage) -> (route request, slot); stage "p" (prefill) or "d"
        self._active: dict[tuple[str, str], tuple[RouteRequest, int]] = {}

    def on_kv_events(self, worker: int, events: Sequence[KvEvent]) -> None:
        self._seq[worker] += 1
        self.index.apply(KvEventBatch(self.ids[worker], EPOCH, self._seq[worker], tuple(events)))

    def route(self, rid: str, request: ReplayRequest, fleet: Sequence[SimulatedWorker]) -> Route:
        self._retire(fleet)
        for i, sim in enumerate(fleet):
            load = sim.load()
            self.workers.set_load(
                self.ids[i],
                LoadSnapshot(
                    running_requests=load.running,
                    waiting_requests=load.waiting,
                    in_flight_requests=load.running + load.waiting,
                    kv_cache_usage=load.kv_usage,
                ),
            )
        rr = RouteRequest(
            request_id=rid,
            model=MODEL,
            session_id=request.session_id,
            block_hashes=request.block_hashes,
            prompt_tokens=request.input_tokens,
        )
        dd: DisaggDecision = self.handler.decide(rr, self.workers.candidates(MODEL))
        self.reasons[dd.reason.value] = self.reasons.get(dd.reason.value, 0) + 1
        prefill = None
        if dd.prefill is not None:
            prefill = self._routed(rr, dd.prefill, "p")
        decode = self._routed(rr, dd.decode, "d")
        return Route(decode, prefill, dd.reason.value, dd.uncached_tokens)

    def _routed(self, rr: RouteRequest, decision: RouteDecision, stage: str) -> int:
        self.policy.on_routed(rr, decision)
        slot = self._slot[decision.worker_id]
        self._active[(rr.request_id, stage)] = (rr, slot)
        return slot

    def _retire(self, fleet: Sequence[SimulatedWorker]) -> None:
        """Feedback hooks for requests the workers no longer hold. A disaggregated request's
        decode stage is not on its worker until the hand-off lands: still active."""
        done = []
        for key, (_rr, slot) in self._active.items():
            rid, stage = key
            if stage == "d" and ((rid, "p") in self._active or rid in self.pending_decode):
                continue
            if not fleet[slot].is_active(rid):
                done.append(key)
        for key in done:
            rr, slot = self._active.pop(key)
            wid = self.ids[slot]
            if key[1] == "d":
                self.policy.on_first_token(rr, wid)
            self.policy.on_finished(rr, wid)
