"""Shared fakes for the scheduler tests: workers, requests, a fake KV index, a fixed scorer."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from kvmesh.discovery.keys import Role, WorkerId, WorkerRecord, WorkerState
from kvmesh.kv.events import BlockHash
from services.router.core.scheduler import (
    CycleContext,
    InFlightLedger,
    Kind,
    Matched,
    PluginType,
    PrefixMatchLike,
    PrefixSource,
    Registry,
    default_registry,
)
from services.router.core.types import LoadSnapshot, RouteRequest
from services.router.core.workers import WorkerView

BLOCK = 16  # tokens per block in these tests


def view(
    wid: str,
    *,
    waiting: int = 0,
    running: int = 0,
    in_flight: int = 0,
    kv: float = 0.0,
    router_in_flight: int = 0,
    role: Role = Role.BOTH,
    model: str = "tiny",
    state: WorkerState = WorkerState.SERVING,
    block_size: int = BLOCK,
) -> WorkerView:
    rec = WorkerRecord(
        worker_id=WorkerId(wid),
        address="127.0.0.1:1",
        model=model,
        model_path="/m",
        role=role,
        state=state,
        block_size=block_size,
    )
    load = LoadSnapshot(
        running_requests=running,
        waiting_requests=waiting,
        in_flight_requests=in_flight,
        kv_cache_usage=kv,
    )
    return WorkerView(record=rec, load=load, router_in_flight=router_in_flight)


def views(n: int, **kw: object) -> list[WorkerView]:
    return [view(f"w{i:02d}", **kw) for i in range(n)]  # type: ignore[arg-type]


def chain(n: int, family: int = 0, diverge_at: int | None = None, branch: int = 1) -> tuple:
    """``n`` block hashes of one conversation ``family``; from block ``diverge_at`` on, a
    ``branch`` of it (hashes are chained, so everything after a divergence differs)."""
    out = []
    for i in range(n):
        if diverge_at is not None and i >= diverge_at:
            out.append(BlockHash((family << 40) | (branch << 24) | i))
        else:
            out.append(BlockHash((family << 40) | i))
    return tuple(out)


def request(
    blocks: int = 0,
    *,
    rid: str = "r",
    session: str = "",
    hashes: tuple | None = None,
    prompt_tokens: int | None = None,
    role: Role = Role.BOTH,
    model: str = "tiny",
) -> RouteRequest:
    hs = hashes if hashes is not None else chain(blocks)
    return RouteRequest(
        request_id=rid,
        model=model,
        session_id=session,
        block_hashes=hs,
        prompt_tokens=prompt_tokens if prompt_tokens is not None else len(hs) * BLOCK + 5,
        role=role,
    )


class FakeIndex:
    """Implements ``PrefixIndex`` from a fixed table; counts calls."""

    def __init__(self, matches: Mapping[str, Matched] | None = None) -> None:
        self.matches: dict[WorkerId, Matched] = {WorkerId(k): v for k, v in (matches or {}).items()}
        self.calls = 0
        self.fail = False

    def match(
        self, hashes: Sequence[BlockHash], workers: Iterable[WorkerId] | None = None
    ) -> Mapping[WorkerId, PrefixMatchLike]:
        self.calls += 1
        if self.fail:
            raise RuntimeError("index exploded")
        if workers is None:
            return dict(self.matches)
        ws = set(workers)
        return {w: m for w, m in self.matches.items() if w in ws}


def gpu(blocks: int, exact: bool = True) -> Matched:
    return Matched(blocks=blocks, gpu_blocks=blocks, exact=exact)


def ctx_for(
    req: RouteRequest,
    cands: Sequence[WorkerView],
    source: PrefixSource | None = None,
    ledger: InFlightLedger | None = None,
) -> CycleContext:
    return CycleContext(req, cands, ledger or InFlightLedger(), source)


@dataclass(frozen=True, slots=True)
class FixedParams:
    scores: tuple[float, ...] = ()  # per candidate, in order; missing: 0


class FixedScorer:
    """Returns the configured raw scores (even out of range): for framework tests."""

    def __init__(self, name: str, params: FixedParams) -> None:
        self.name = name
        self.scores = params.scores

    def score(self, ctx: CycleContext, candidates: Sequence[WorkerView]) -> Sequence[float]:
        return [self.scores[i] if i < len(self.scores) else 0.0 for i in range(len(candidates))]


def fixed_registry() -> Registry:
    reg = default_registry()
    reg.register(
        PluginType("fixed", Kind.SCORER, FixedParams, lambda n, p, e: FixedScorer(n, p), "test")
    )
    return reg
