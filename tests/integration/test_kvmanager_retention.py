"""Session retention on a real kvmanager over gRPC: a session's pinned blocks survive pressure
that evicts unpinned ones (RAM only, and written back to disk with a disk tier), TTL expiry and
ReleaseSession give them back to the LRU, the budget releases the least recently active
session, bad calls get the right status, and /metrics counts it. PrefetchSession brings a
session's retained blocks, written back to disk under pressure, into RAM."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest

from kvmesh.kv_wire import layout_from_pb
from kvmesh.v1 import kvmanager_pb2, kvmanager_pb2_grpc, worker_pb2
from services.kvmanager.config import KvManagerConfig, RetentionConfig
from services.kvmanager.core.config import StoreConfig
from services.kvmanager.main import start_kvmanager
from tests.integration.test_kvmanager_grpc import BLOCK_BYTES, LAYOUT, put

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

KEY = layout_from_pb(LAYOUT).key


async def start(
    tmp_path: Path | None,
    cpu_blocks: int,
    disk_blocks: int,
    retained_blocks: int,
    refresh_s: float = 2.0,
):  # type: ignore[no-untyped-def]
    store = StoreConfig(
        cpu_bytes=cpu_blocks * BLOCK_BYTES,
        disk_bytes=disk_blocks * (BLOCK_BYTES + 8192),
        disk_dir=tmp_path,
    )
    config = KvManagerConfig(
        kvmanager_id="node-r",
        node="node-r",
        etcd_endpoints=(),
        store=store,
        retention=RetentionConfig(bytes=retained_blocks * BLOCK_BYTES),
        metrics_refresh_s=refresh_s,
        drain_grace_s=0.5,
    )
    running = await start_kvmanager(config)
    channel = grpc.aio.insecure_channel(running.address)
    return running, channel, kvmanager_pb2_grpc.KvManagerStub(channel)


async def held(stub, hashes: list[int]) -> list[int]:  # type: ignore[no-untyped-def]
    """The tiers of the hashes held, one Lookup per block (a chain's Lookup stops at a miss)."""
    out = []
    for h in hashes:
        look = await stub.Lookup(
            kvmanager_pb2.LookupRequest(layout=LAYOUT, block_hashes=[h]), timeout=5
        )
        out.append(look.tiers[0] if look.tiers else 0)
    return out


async def retain(stub, session: str, hashes: list[int], ttl_s: float = 60, tenant: str = ""):  # type: ignore[no-untyped-def]
    return await stub.RetainSession(
        kvmanager_pb2.RetainSessionRequest(
            layout_key=KEY, session_id=session, tenant=tenant, block_hashes=hashes, ttl_s=ttl_s
        ),
        timeout=5,
    )


async def pressure(stub, first: int, n: int) -> None:  # type: ignore[no-untyped-def]
    for i in range(first, first + n, 4):
        await put(stub, list(range(i, i + 4)))


async def test_ram_only_retained_session_survives_pressure_that_evicts_others():
    running, channel, stub = await start(None, cpu_blocks=8, disk_blocks=0, retained_blocks=4)
    try:
        await put(stub, [1, 2, 3])  # session s1's turn
        await put(stub, [11, 12, 13])  # s2's, not retained
        got = await retain(stub, "s1", [1, 2, 3])
        assert (got.retained_blocks, got.held_blocks, got.renewed) == (3, 3, False)
        await pressure(stub, 1000, 40)
        assert await held(stub, [1, 2, 3]) == [worker_pb2.KV_TIER_CPU] * 3
        assert await held(stub, [11, 12, 13]) == [0, 0, 0]
        # The next turn renews it: its previous blocks were all still held.
        got = await retain(stub, "s1", [1, 2, 3, 4])
        assert got.renewed and (got.previous_blocks, got.previous_held_blocks) == (3, 3)
        assert running.store.stats.retention_kept == 1
        # Released: ordinary LRU blocks again.
        released = await stub.ReleaseSession(
            kvmanager_pb2.ReleaseSessionRequest(session_id="s1"), timeout=5
        )
        assert released.released
        await pressure(stub, 2000, 40)
        assert await held(stub, [1, 2, 3]) == [0, 0, 0]
    finally:
        await channel.close()
        await running.stop()


async def test_retained_blocks_are_written_back_to_disk_not_dropped(tmp_path: Path):
    running, channel, stub = await start(tmp_path, cpu_blocks=4, disk_blocks=16, retained_blocks=6)
    try:
        await put(stub, [1, 2, 3, 4])
        await retain(stub, "s1", [1, 2, 3, 4])
        await put(stub, [11, 12, 13, 14])  # not retained
        await pressure(stub, 1000, 60)  # RAM and disk both turn over several times
        tiers = await held(stub, [1, 2, 3, 4])
        assert all(t in (worker_pb2.KV_TIER_CPU, worker_pb2.KV_TIER_DISK) for t in tiers), tiers
        assert worker_pb2.KV_TIER_DISK in tiers  # RAM kept turning over: they went to disk
        assert await held(stub, [11, 12, 13, 14]) == [0] * 4
        usage = running.store.retained_usage()
        assert sum(n for n, _ in usage.values()) >= 4
    finally:
        await channel.close()
        await running.stop()


async def test_ttl_expiry_releases_the_session():
    running, channel, stub = await start(
        None, cpu_blocks=8, disk_blocks=0, retained_blocks=4, refresh_s=0.1
    )
    try:
        await put(stub, [1, 2])
        await retain(stub, "s1", [1, 2], ttl_s=0.3)
        assert len(running.store.retention) == 1
        for _ in range(50):  # the daemon's refresh expires it
            if len(running.store.retention) == 0:
                break
            await asyncio.sleep(0.05)
        assert len(running.store.retention) == 0
        await pressure(stub, 1000, 40)
        assert await held(stub, [1, 2]) == [0, 0]
        assert running.store.retention.stats.expired == 1
    finally:
        await channel.close()
        await running.stop()


async def test_budget_releases_the_least_recently_active_session():
    running, channel, stub = await start(None, cpu_blocks=16, disk_blocks=0, retained_blocks=5)
    try:
        await put(stub, [1, 2, 3])
        await put(stub, [21, 22, 23])
        await retain(stub, "old", [1, 2, 3])
        got = await retain(stub, "new", [21, 22, 23])
        assert got.released_sessions == 1
        assert len(running.store.retention) == 1
        big = await retain(stub, "new", [21, 22, 23, 24, 25, 26, 27])  # over the budget alone
        assert big.truncated and big.retained_blocks == 5
        assert running.store.retention.bytes <= 5 * BLOCK_BYTES
    finally:
        await channel.close()
        await running.stop()


@pytest.mark.parametrize(
    ("session", "key", "ttl", "code"),
    [
        ("", KEY, 10.0, grpc.StatusCode.INVALID_ARGUMENT),
        ("s", KEY, 0.0, grpc.StatusCode.INVALID_ARGUMENT),
        ("s", "nothex", 10.0, grpc.StatusCode.INVALID_ARGUMENT),
        ("s", "0123456789abcdef", 10.0, grpc.StatusCode.NOT_FOUND),
    ],
    ids=["no-session", "zero-ttl", "bad-layout-key", "unknown-layout"],
)
async def test_bad_retain_calls(session: str, key: str, ttl: float, code: grpc.StatusCode):
    running, channel, stub = await start(None, cpu_blocks=8, disk_blocks=0, retained_blocks=4)
    try:
        await put(stub, [1])
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.RetainSession(
                kvmanager_pb2.RetainSessionRequest(
                    layout_key=key, session_id=session, block_hashes=[1], ttl_s=ttl
                ),
                timeout=5,
            )
        assert err.value.code() is code, err.value.details()
    finally:
        await channel.close()
        await running.stop()


async def test_retention_off_is_unavailable_and_metrics_count_sessions():
    running, channel, stub = await start(None, cpu_blocks=8, disk_blocks=0, retained_blocks=0)
    try:
        await put(stub, [1])
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await retain(stub, "s", [1])
        assert err.value.code() is grpc.StatusCode.UNAVAILABLE
    finally:
        await channel.close()
        await running.stop()
    running, channel, stub = await start(None, cpu_blocks=8, disk_blocks=0, retained_blocks=4)
    try:
        await put(stub, [1, 2])
        await retain(stub, "s", [1, 2])
        running.metrics.refresh(running.store)
        reg = running.metrics.registry
        assert reg.get_sample_value("kvmesh_kvmanager_retained_sessions") == 1
        assert reg.get_sample_value("kvmesh_kvmanager_retained_bytes", {"tier": "cpu"}) == (
            2 * BLOCK_BYTES
        )
        assert reg.get_sample_value("kvmesh_kvmanager_retention_pins_total") == 1
    finally:
        await channel.close()
        await running.stop()


async def prefetch(stub, session: str, tenant: str = ""):  # type: ignore[no-untyped-def]
    return await stub.PrefetchSession(
        kvmanager_pb2.PrefetchSessionRequest(session_id=session, tenant=tenant), timeout=5
    )


async def test_prefetch_brings_a_demoted_session_back_to_ram(tmp_path: Path):
    """Four retained 6-block sessions through a 12-block RAM tier: the two oldest were written
    back to disk to make room for the newer ones. The first one's next turn is coming: its
    prefetch brings its chain back into RAM (pushing the least recently used retained copies to
    disk), and /metrics counts it."""
    running, channel, stub = await start(
        tmp_path, cpu_blocks=12, disk_blocks=64, retained_blocks=24
    )
    disk, cpu = worker_pb2.KV_TIER_DISK, worker_pb2.KV_TIER_CPU
    try:
        chains = {f"s{n}": [10 * n + i for i in range(1, 7)] for n in range(1, 5)}
        for session, chain in chains.items():
            await put(stub, chain)
            got = await retain(stub, session, chain)
            assert got.retained_blocks == 6
        await running.store.wait_idle()
        before = await held(stub, chains["s1"])
        assert set(before) <= {cpu, disk} and before.count(disk) >= 2, before

        got = await prefetch(stub, "s1")
        assert (got.retained_blocks, got.promoted_blocks, got.in_cpu_blocks) == (
            6,
            before.count(disk),
            before.count(cpu),
        )
        assert (got.on_disk_blocks, got.missing_blocks) == (0, 0)
        assert await held(stub, chains["s1"]) == [cpu] * 6
        await running.store.wait_idle()
        # Room was made from the least recently used retained copies: written back, not lost.
        assert all(t in (cpu, disk) for t in await held(stub, chains["s3"] + chains["s4"]))

        # Again: nothing to do. A session with no retention here: an empty answer.
        got = await prefetch(stub, "s1")
        assert (got.retained_blocks, got.promoted_blocks, got.in_cpu_blocks) == (6, 0, 6)
        got = await prefetch(stub, "s1", tenant="another")
        assert (got.retained_blocks, got.promoted_blocks) == (0, 0)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await prefetch(stub, "")
        assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT

        running.metrics.refresh(running.store)
        reg = running.metrics.registry
        assert reg.get_sample_value("kvmesh_kvmanager_prefetch_requests_total") == 2
        assert reg.get_sample_value("kvmesh_kvmanager_prefetch_done_total") == 2
        promoted = reg.get_sample_value("kvmesh_kvmanager_prefetch_blocks_total")
        assert promoted == before.count(disk)
    finally:
        await channel.close()
        await running.stop()


async def test_prefetch_stops_at_the_chains_first_gap(tmp_path: Path):
    running, channel, stub = await start(tmp_path, cpu_blocks=8, disk_blocks=64, retained_blocks=24)
    try:
        first = list(range(1, 7))
        await put(stub, first)
        await retain(stub, "s1", [*first, 999, 7])  # 999 was never stored: a gap
        # Two more retained sessions push s1's copies to disk.
        for n, session in ((2, "s2"), (3, "s3")):
            chain = [100 * n + i for i in range(6)]
            await put(stub, chain)
            await retain(stub, session, chain)
        await running.store.wait_idle()
        before = await held(stub, first)
        assert worker_pb2.KV_TIER_DISK in before, before
        got = await prefetch(stub, "s1")
        # The chain ends at 999: its last 2 blocks are no prefix, and are not looked at. (The
        # cap, half the RAM tier, is test_kvmanager_prefetch.py's.)
        assert (got.retained_blocks, got.missing_blocks) == (8, 2)
        assert got.in_cpu_blocks + got.promoted_blocks + got.on_disk_blocks == 6
        after = await held(stub, first)
        assert after.count(worker_pb2.KV_TIER_CPU) == got.in_cpu_blocks + got.promoted_blocks
    finally:
        await channel.close()
        await running.stop()
