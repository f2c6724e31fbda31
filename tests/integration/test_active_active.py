"""Several routers at once (docs/failover.md, "Several routers at once (active-active)"): two
routers on one etcd and three simulated workers behind the real worker gRPC service, every call
real gRPC on loopback. The routers share nothing with each other: each keeps the same exact KV
index from the workers' KV event streams, and sees the other's requests in the workers' load
reports (WatchLoad). So

- a session whose turns alternate between the routers lands on the same worker every turn, the
  cache of its previous turns growing (the other router's index shows the previous turn's
  blocks within the KV event delay, measured and printed here);
- a router keeps new sessions off a worker busy with the other router's requests, which it
  knows only from that worker's load reports (the load staleness, measured and printed here).
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import os
import time
from collections.abc import AsyncIterator, Sequence

import pytest

from kvmesh.client import RouterClient, make_request
from kvmesh.discovery.keys import WorkerId
from kvmesh.kv.hashing import HashConfig, block_hashes
from kvmesh.v1 import router_pb2
from services.router.config import RouterConfig
from services.router.main import RunningRouter, start_router
from services.worker.config import WorkerConfig
from services.worker.server import start_worker
from services.worker.sim.engine import SimEngineConfig, SimulatedEngine
from services.worker.sim.model import SimWorkerConfig
from tests.support import eventually

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

BLOCK = 32
N_WORKERS = 3
HASHES = HashConfig(block_size=BLOCK)


def engine(speedup: float) -> SimulatedEngine:
    return SimulatedEngine(
        SimEngineConfig(
            worker=SimWorkerConfig(capacity_blocks=4096, block_size=BLOCK),
            model="sim",
            max_model_len=8192,
            vocab_size=1000,
            speedup=speedup,
        ),
        hasher=functools.partial(block_hashes, cfg=HASHES),
    )


async def mesh(etcd, tag: str, speedup: float) -> AsyncIterator[tuple[RunningRouter, ...]]:
    cluster = f"aa{tag}{os.getpid()}{abs(hash(time.monotonic())) % 10**5}"
    endpoints = tuple(etcd.endpoints)
    workers = [
        await start_worker(
            WorkerConfig(worker_id=f"w{i}", cluster=cluster, etcd_endpoints=endpoints),
            engine(speedup),
        )
        for i in range(N_WORKERS)
    ]
    routers: list[RunningRouter] = []
    try:
        for name in ("router-a", "router-b"):
            routers.append(
                await start_router(
                    RouterConfig(
                        cluster=cluster,
                        etcd_endpoints=endpoints,
                        router_id=name,
                        http_port=-1,
                        metrics_port=-1,
                        drain_grace_s=1.0,
                    )
                )
            )
        for r in routers:
            await eventually(lambda r=r: len(r.workers.candidates("sim")) == N_WORKERS, 15.0)
        yield tuple(routers)
    finally:
        for r in routers:
            await r.stop()
        for w in workers:
            await w.stop()


@pytest.fixture
async def fast_mesh(etcd):
    async for routers in mesh(etcd, "f", speedup=10.0):
        yield routers


@pytest.fixture
async def slow_mesh(etcd):
    async for routers in mesh(etcd, "s", speedup=1.0):
        yield routers


def full_blocks(tokens: Sequence[int]) -> list:
    return block_hashes(tokens, cfg=HASHES)


def holds(router: RunningRouter, worker: str, hashes: list) -> bool:
    m = router.index.match(hashes).get(WorkerId(worker))
    return m is not None and m.blocks == len(hashes)


def distinct(i: int, n: int) -> list[int]:
    """Token ids of a prompt no other prompt of these tests shares a block with."""
    return [1 + (i * 7919 + j * 13) % 997 for j in range(n)]


async def test_a_session_alternating_between_routers_stays_on_its_worker(fast_mesh, capsys):
    a, b = fast_mesh
    turns = 8
    prompt = distinct(1, 8 * BLOCK)
    seen: list[tuple[str, int, int]] = []  # (worker, prompt tokens, cached prompt tokens)
    delays_s: list[float] = []
    async with RouterClient(a.address) as via_a, RouterClient(b.address) as via_b:
        for turn in range(turns):
            client, other = (via_a, b) if turn % 2 == 0 else (via_b, a)
            first_token: list[float] = []

            def on_chunk(chunk: router_pb2.GenerateResponse, first: list[float] = first_token):
                if chunk.token_ids and not first:
                    first.append(time.monotonic())

            done = await client.complete(
                make_request(prompt, max_tokens=24, ignore_eos=True, session_id="s-1"),
                timeout_s=30,
                on_chunk=on_chunk,
            )
            assert done.usage is not None
            worker = done.usage.worker_id
            seen.append((worker, len(prompt), done.usage.cached_prompt_tokens))
            # The engine publishes the prompt's blocks after the step that computed them, the
            # step that also yields the first token: from then, how long until the router that
            # gets the next turn has them in its index.
            hashes = full_blocks(prompt)
            await eventually(
                functools.partial(holds, other, worker, hashes), 5.0, "the other index"
            )
            delays_s.append(max(0.0, time.monotonic() - first_token[0]))
            prompt = [*prompt, *done.token_ids, *distinct(100 + turn, 40)]

    workers = [w for w, _, _ in seen]
    assert workers[1:] == [workers[0]] * (turns - 1), seen
    assert seen[0][2] == 0, seen
    for (_, prev_len, prev_cached), (_, _, cached) in itertools.pairwise(seen):
        # Everything of the previous prompt but the last partial block is cached (the simulated
        # engine stores prompt blocks only, as vLLM without output caching would).
        assert cached >= (prev_len // BLOCK) * BLOCK > prev_cached, seen
    with capsys.disabled():
        print(
            f"\nactive-active session: {turns} turns alternating between 2 routers, all on "
            f"{workers[0]}; cached tokens {[c for _, _, c in seen]}; first token -> the other "
            f"router's index has the prompt's blocks (upper bound, includes the client's "
            f"stream): {', '.join(f'{d * 1000:.1f}' for d in delays_s)} ms"
        )


async def test_a_router_keeps_new_sessions_off_a_worker_busy_with_the_other_routers(
    slow_mesh, capsys
):
    """Router A puts K sessions sharing a long prefix on the worker that holds it (prefix
    affinity), decoding for seconds. Router B has sent that worker nothing: it knows the load
    only from the worker's reports. B's next K cold sessions, sent one after the other's
    first token, all go to the other workers. A router that ignored the reports (outstanding()
    from its own counts only) sends about a third of them to the busy worker."""
    a, b = slow_mesh
    k = 6
    shared = distinct(5000, 16 * BLOCK)
    async with RouterClient(a.address) as via_a, RouterClient(b.address) as via_b:
        warm = await via_a.complete(make_request(shared, max_tokens=1), timeout_s=30)
        assert warm.usage is not None
        busy = warm.usage.worker_id
        await eventually(lambda: holds(a, busy, full_blocks(shared)), 5.0, "A's index")
        sent = time.monotonic()
        long_ones = [
            asyncio.ensure_future(
                via_a.complete(
                    make_request(
                        [*shared, *distinct(6000 + i, BLOCK)], max_tokens=600, ignore_eos=True
                    ),
                    timeout_s=60,
                )
            )
            for i in range(k)
        ]
        try:
            b_view = b.workers.get(WorkerId(busy))
            assert b_view is not None and b_view.router_in_flight == 0
            await eventually(
                lambda: b_view.load.in_flight_requests >= k, 5.0, "B's view of the load"
            )
            staleness_s = time.monotonic() - sent
            assert a.workers.get(WorkerId(busy)).router_in_flight == k  # type: ignore[union-attr]

            placed: list[str] = []
            pending = []
            for i in range(k):
                first: asyncio.Event = asyncio.Event()
                task = asyncio.ensure_future(
                    via_b.complete(
                        make_request(
                            distinct(7000 + i, 8 * BLOCK),
                            max_tokens=300,
                            ignore_eos=True,
                            session_id=f"b-{i}",
                        ),
                        timeout_s=60,
                        on_chunk=lambda c, e=first: e.set() if c.token_ids else None,
                    )
                )
                pending.append(task)
                await asyncio.wait_for(first.wait(), 10)
            for task in pending:
                done = await task
                assert done.usage is not None
                placed.append(done.usage.worker_id)
        finally:
            for task in long_ones:
                task.cancel()
            await asyncio.gather(*long_ones, return_exceptions=True)

    assert long_ones and all(t.cancelled() or t.done() for t in long_ones)
    assert busy not in placed, (busy, placed)
    assert len(set(placed)) == N_WORKERS - 1, placed
    with capsys.disabled():
        print(
            f"\nactive-active load: {k} requests sent through router A -> router B's view of "
            f"the worker reports them {staleness_s * 1000:.0f} ms after the first was sent; "
            f"B placed {placed}, A's busy worker {busy}"
        )


async def test_simultaneous_cold_bursts_on_two_routers_spread_over_the_workers(slow_mesh, capsys):
    """Both routers get a burst of K cold sessions at the same moment: neither can see the
    other's sends in the workers' reports yet (they arrive within one report interval), but each
    counts its own sends since the last report (``outstanding()``), so each spreads its burst
    and the sum stays even instead of both piling onto the worker whose stale report was lowest."""
    a, b = slow_mesh
    k = 12
    async with RouterClient(a.address) as via_a, RouterClient(b.address) as via_b:

        async def one(client: RouterClient, i: int) -> str:
            done = await client.complete(
                make_request(
                    distinct(9000 + i, 8 * BLOCK),
                    max_tokens=200,
                    ignore_eos=True,
                    session_id=f"burst-{i}",
                ),
                timeout_s=60,
            )
            assert done.usage is not None
            return done.usage.worker_id

        placed = await asyncio.gather(
            *(one(via_a, i) for i in range(k)), *(one(via_b, k + i) for i in range(k))
        )
    per_worker = {w: placed.count(w) for w in sorted(set(placed))}
    with capsys.disabled():
        print(f"\nactive-active cold bursts: {k} + {k} sessions at once -> {per_worker}")
    assert len(per_worker) == N_WORKERS, per_worker
    assert max(per_worker.values()) <= 2 * k // N_WORKERS + 1, per_worker
