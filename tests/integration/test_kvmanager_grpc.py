"""The kvmanager daemon over real gRPC on loopback with a real etcd: store, look up and read
blocks; refuse bad layouts and sizes with the right status; stream per-layout tier events with
snapshot and resume; keep the disk tier across a restart; register in and leave etcd; its
``*_total`` metrics are Prometheus counters on its /metrics."""

from __future__ import annotations

import asyncio
import os
import urllib.request
from pathlib import Path

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvmesh.discovery.keys import KvManagerRecord, kvmanager_key
from kvmesh.kv.events import BlockRemoved, BlockStored, Tier
from kvmesh.kv_wire import KV_EPOCH_KEY, kv_batch_from_pb, layout_from_pb
from kvmesh.v1 import kvmanager_pb2, kvmanager_pb2_grpc, worker_pb2
from services.kvmanager.config import KvManagerConfig
from services.kvmanager.core.config import StoreConfig
from services.kvmanager.main import parse_args, start_kvmanager

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

LAYOUT = kvmanager_pb2.KvLayout(
    model="tiny", block_size=32, num_layers=2, num_kv_heads=2, head_size=32, dtype="float32"
)
BLOCK_BYTES = 2 * 2 * 32 * 2 * 32 * 4  # 32 KiB


def block(i: int) -> bytes:
    return (i.to_bytes(8, "little") * (BLOCK_BYTES // 8 + 1))[:BLOCK_BYTES]


def blocks(hashes: list[int], parent: int | None = None) -> list[kvmanager_pb2.KvBlock]:
    out = []
    for h in hashes:
        b = kvmanager_pb2.KvBlock(block_hash=h, data=block(h))
        if parent is not None:
            b.parent_hash = parent
        out.append(b)
        parent = h
    return out


async def put(stub, hashes: list[int], layout=LAYOUT, chunk: int = 2) -> int:
    async def gen():
        for i in range(0, len(hashes), chunk):
            part = hashes[i : i + chunk]
            msg = kvmanager_pb2.PutBlocksRequest(blocks=blocks(part, hashes[i - 1] if i else None))
            if i == 0:
                msg.layout.CopyFrom(layout)
            yield msg

    resp = await stub.PutBlocks(gen(), timeout=10)
    return resp.stored


async def get(stub, hashes: list[int]) -> list[kvmanager_pb2.GetBlocksResponse]:
    call = stub.GetBlocks(
        kvmanager_pb2.GetBlocksRequest(layout=LAYOUT, block_hashes=hashes), timeout=10
    )
    return [m async for m in call]


@pytest.fixture
async def kvm(etcd, tmp_path: Path, request):
    cluster = f"kvm{abs(hash(request.node.name)) % 10**6}"
    config = KvManagerConfig(
        kvmanager_id="node-a",
        node="node-a",
        cluster=cluster,
        etcd_endpoints=tuple(etcd.endpoints),
        store=StoreConfig(
            cpu_bytes=4 * BLOCK_BYTES, disk_bytes=64 * BLOCK_BYTES, disk_dir=tmp_path
        ),
        drain_grace_s=1.0,
    )
    running = await start_kvmanager(config)
    channel = grpc.aio.insecure_channel(running.address)
    try:
        yield running, kvmanager_pb2_grpc.KvManagerStub(channel), config
    finally:
        await channel.close()
        await running.stop()


async def test_put_lookup_get_round_trip_with_demotion_to_disk(kvm):
    _, stub, _ = kvm
    hashes = [101, 102, 103, 104, 105, 106]  # 6 blocks, room for 4 in RAM: 2 go to disk
    assert await put(stub, hashes) == 6
    for _ in range(100):  # write-back of the demoted blocks lands on disk shortly
        info = await stub.GetInfo(kvmanager_pb2.KvManagerInfoRequest(), timeout=5)
        usage = {t.tier: t for t in info.tiers}
        if usage[worker_pb2.KV_TIER_DISK].blocks >= 2:
            break
        await asyncio.sleep(0.05)
    cpu, disk = usage[worker_pb2.KV_TIER_CPU], usage[worker_pb2.KV_TIER_DISK]
    assert cpu.used_bytes <= cpu.capacity_bytes == 4 * BLOCK_BYTES
    assert disk.blocks >= 2
    look = await stub.Lookup(
        kvmanager_pb2.LookupRequest(layout=LAYOUT, block_hashes=[*hashes, 999, 101]), timeout=5
    )
    assert len(look.tiers) == 6  # stops at the first miss
    assert worker_pb2.KV_TIER_DISK in look.tiers and worker_pb2.KV_TIER_CPU in look.tiers
    got = await get(stub, hashes)
    assert [m.block.block_hash for m in got] == hashes
    assert all(m.block.data == block(m.block.block_hash) for m in got)
    partial = await get(stub, [101, 555, 102])
    assert [m.block.block_hash for m in partial[:-1]] == [101]
    assert partial[-1].HasField("missing") and partial[-1].missing == 555


@pytest.mark.parametrize(
    ("layout", "data_bytes", "match"),
    [
        pytest.param(LAYOUT, BLOCK_BYTES - 1, "needs 32768", id="short-block"),
        pytest.param(
            kvmanager_pb2.KvLayout(model="tiny", block_size=32, num_layers=2, num_kv_heads=2,
                                   head_size=32, dtype="float31"),
            BLOCK_BYTES, "dtype", id="unknown-dtype",
        ),
        pytest.param(
            kvmanager_pb2.KvLayout(block_size=32, num_layers=2, num_kv_heads=2, head_size=32,
                                   dtype="float32"),
            BLOCK_BYTES, "model", id="no-model",
        ),
    ],
)  # fmt: skip
async def test_bad_blocks_are_invalid_argument(kvm, layout, data_bytes, match):
    _, stub, _ = kvm

    async def gen():
        yield kvmanager_pb2.PutBlocksRequest(
            layout=layout, blocks=[kvmanager_pb2.KvBlock(block_hash=7, data=b"\0" * data_bytes)]
        )

    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.PutBlocks(gen(), timeout=5)
    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert match in err.value.details()
    look = await stub.Lookup(kvmanager_pb2.LookupRequest(layout=LAYOUT, block_hashes=[7]))
    assert list(look.tiers) == []


async def test_first_put_message_must_name_the_layout(kvm):
    _, stub, _ = kvm

    async def gen():
        yield kvmanager_pb2.PutBlocksRequest(blocks=blocks([1]))

    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.PutBlocks(gen(), timeout=5)
    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "layout" in err.value.details()


async def test_put_block_batch_is_put_blocks_in_one_unary_call(kvm):
    _, stub, _ = kvm
    first = kvmanager_pb2.PutBlocksRequest(layout=LAYOUT, blocks=blocks([11, 12, 13]))
    resp = await stub.PutBlockBatch(first, timeout=5)
    assert (resp.stored, resp.already_held) == (3, 0)
    again = kvmanager_pb2.PutBlocksRequest(layout=LAYOUT, blocks=blocks([11, 12, 13, 14]))
    resp = await stub.PutBlockBatch(again, timeout=5)
    assert (resp.stored, resp.already_held) == (4, 3)
    got = await get(stub, [11, 12, 13, 14])
    assert [m.block.data for m in got] == [block(h) for h in (11, 12, 13, 14)]
    with pytest.raises(grpc.aio.AioRpcError) as err:  # a batch is a first message: no layout
        await stub.PutBlockBatch(kvmanager_pb2.PutBlocksRequest(blocks=blocks([15])), timeout=5)
    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "layout" in err.value.details()
    short = kvmanager_pb2.PutBlocksRequest(
        layout=LAYOUT, blocks=[kvmanager_pb2.KvBlock(block_hash=16, data=b"\0" * 8)]
    )
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.PutBlockBatch(short, timeout=5)
    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    look = await stub.Lookup(kvmanager_pb2.LookupRequest(layout=LAYOUT, block_hashes=[15, 16]))
    assert list(look.tiers) == []


async def test_tier_events_snapshot_then_live_then_resume(kvm):
    _, stub, _ = kvm
    await put(stub, [1, 2])
    call = stub.WatchKvEvents(
        kvmanager_pb2.KvManagerWatchKvEventsRequest(layout=LAYOUT), timeout=30
    )
    md = {k: v for k, v in await call.initial_metadata()}
    epoch = md[KV_EPOCH_KEY]
    stream = aiter(call)
    snap = kv_batch_from_pb(await anext(stream))
    assert snap.snapshot and snap.worker_id == "node-a"
    held = [h for e in snap.events if isinstance(e, BlockStored) for h in e.block_hashes]
    assert held == [1, 2]
    assert all(e.tier is Tier.CPU for e in snap.events)
    await put(stub, [3, 4, 5, 6, 7])  # the fifth block pushes the oldest to disk
    seen: list = []

    def cpu(kind):
        return [h for e in seen if isinstance(e, kind) and e.tier is Tier.CPU
                for h in e.block_hashes]  # fmt: skip

    while not (set(cpu(BlockStored)) >= {3, 4, 5, 6, 7} and cpu(BlockRemoved)):
        b = kv_batch_from_pb(await asyncio.wait_for(anext(stream), 5))
        seen.extend(b.events)
        last_seq = b.seq
    assert cpu(BlockStored) == [3, 4, 5, 6, 7]
    assert set(cpu(BlockRemoved)) <= {1, 2, 3} and cpu(BlockRemoved)[0] == 1  # LRU order
    call.cancel()
    # Resume from the next seq: no snapshot, nothing missed.
    again = stub.WatchKvEvents(
        kvmanager_pb2.KvManagerWatchKvEventsRequest(
            layout=LAYOUT, epoch=epoch, from_seq=last_seq + 1
        ),
        timeout=30,
    )
    md = {k: v for k, v in await again.initial_metadata()}
    assert md["kvmesh-kv-resumed"] == "1"
    again.cancel()


async def test_disk_tier_survives_a_restart_and_corrupt_files_are_dropped(kvm, tmp_path):
    running, stub, config = kvm
    hashes = list(range(200, 210))
    await put(stub, hashes)
    await running.stop()  # RAM is lost; what was written back to disk stays
    files = sorted(tmp_path.rglob("*.kvb"))
    assert files, "write-back left block files"
    victim = files[0]
    data = bytearray(victim.read_bytes())
    data[-1] ^= 0xFF  # flip a payload byte: its checksum no longer matches
    victim.write_bytes(bytes(data))
    again = await start_kvmanager(config)
    try:
        async with grpc.aio.insecure_channel(again.address) as ch:
            stub2 = kvmanager_pb2_grpc.KvManagerStub(ch)
            info = await stub2.GetInfo(kvmanager_pb2.KvManagerInfoRequest(), timeout=5)
            disk = next(t for t in info.tiers if t.tier == worker_pb2.KV_TIER_DISK)
            # The start-up scan may already catch the bad checksum; a read does at the latest.
            assert disk.blocks in (len(files) - 1, len(files))
            served = 0
            for h in hashes:
                got = await get(stub2, [h])
                if got and got[0].HasField("block"):
                    assert got[0].block.data == block(h)  # never the corrupt bytes
                    served += 1
            assert served == len(files) - 1, (served, [f.name for f in files], disk.blocks)
    finally:
        await again.stop()
    assert not victim.exists(), "the corrupt file was deleted"


async def test_registers_in_etcd_and_leaves_on_stop(kvm, etcd_client):
    running, _, config = kvm
    key = kvmanager_key(config.cluster, "node-a")
    stored = await etcd_client.get(key.encode())
    assert stored is not None
    rec = KvManagerRecord.from_json(stored.value)
    assert (rec.kvmanager_id, rec.node, rec.address) == ("node-a", "node-a", running.address)
    # The etcd session on /metrics, once the first refresh ran (at start, then every 2 s).
    sample = running.metrics.registry.get_sample_value
    for _ in range(150):
        if sample("kvmesh_kvmanager_etcd_registered") == 1:
            break
        await asyncio.sleep(0.02)
    assert sample("kvmesh_kvmanager_etcd_connected") == 1
    assert sample("kvmesh_kvmanager_etcd_registered") == 1
    await running.stop()
    assert await etcd_client.get(key.encode()) is None


def families(url: str) -> dict[str, tuple[str, dict[str, float]]]:
    """name -> (type, {sample name with its labels: value}) from a /metrics scrape."""
    with urllib.request.urlopen(url, timeout=5) as resp:
        text = resp.read().decode()
    return {
        f.name: (
            f.type,
            {s.name + str(sorted(s.labels.items())): s.value for s in f.samples},
        )
        for f in text_string_to_metric_families(text)
    }


async def test_totals_are_counters_on_metrics(kvm):
    running, stub, _ = kvm
    assert running.metrics_server is not None
    hashes = [201, 202, 203, 204, 205, 206]  # room for 4 in RAM: evictions or demotions
    assert await put(stub, hashes) == 6
    await get(stub, [201, 999])
    running.metrics.refresh(running.store, running.peers)  # as the 2 s refresh task does
    got = await asyncio.to_thread(families, running.metrics_server.url)
    totals = {
        name: kind for name, (kind, samples) in got.items() if any("_total" in k for k in samples)
    }
    # Every family with *_total samples is a counter, the names those of before.
    assert totals and set(totals.values()) == {"counter"}, totals
    for name in (
        "kvmesh_kvmanager_tier_hits",
        "kvmesh_kvmanager_tier_misses",
        "kvmesh_kvmanager_evictions",
        "kvmesh_kvmanager_evicted_bytes",
        "kvmesh_kvmanager_hits_cpu",
        "kvmesh_kvmanager_misses",
        "kvmesh_kvmanager_disk_writes",
        "kvmesh_kvmanager_peer_fetches",
        "kvmesh_kvmanager_arena_allocations",
        "kvmesh_kvmanager_arena_fallbacks",
    ):
        assert totals.get(name) == "counter", name
    stats = running.store.stats
    assert got["kvmesh_kvmanager_misses"][1]["kvmesh_kvmanager_misses_total[]"] == stats.misses
    assert stats.misses == 1
    hits = got["kvmesh_kvmanager_tier_hits"][1]
    assert hits["kvmesh_kvmanager_tier_hits_total[('tier', 'cpu')]"] == stats.hits_cpu
    assert got["kvmesh_kvmanager_tier_used_bytes"][0] == "gauge"  # levels stay gauges


def test_flags():
    cfg = parse_args(["--cpu-bytes", "2GiB", "--disk-dir", "/tmp/x", "--disk-bytes", "10GiB",
                      "--etcd", "", "--write-through"])  # fmt: skip
    assert cfg.store.cpu_bytes == 2 << 30 and cfg.store.disk_bytes == 10 << 30
    assert cfg.store.has_disk and cfg.store.write_through and cfg.etcd_endpoints == ()
    assert os.fspath(cfg.store.disk_dir) == "/tmp/x"


async def test_publishes_its_measured_tier_speed_on_its_record(etcd, etcd_client, request):
    # 130 blocks of 32 tokens read back from its CPU tier: one sample (>= 4,096 tokens) of
    # seconds per token, published on its etcd record at the next refresh for routers to use.
    cluster = f"kvr{abs(hash(request.node.name)) % 10**6}"
    config = KvManagerConfig(
        kvmanager_id="node-r",
        node="node-r",
        cluster=cluster,
        etcd_endpoints=tuple(etcd.endpoints),
        store=StoreConfig(cpu_bytes=256 * BLOCK_BYTES),
        metrics_refresh_s=0.05,
        drain_grace_s=1.0,
    )
    running = await start_kvmanager(config)
    channel = grpc.aio.insecure_channel(running.address)
    try:
        stub = kvmanager_pb2_grpc.KvManagerStub(channel)
        hashes = list(range(1000, 1130))
        assert await put(stub, hashes, chunk=16) == 130
        got = await get(stub, hashes)
        assert [m.block.block_hash for m in got] == hashes
        key = kvmanager_key(cluster, "node-r").encode()
        layout_key = layout_from_pb(LAYOUT).key
        rates: dict = {}
        for _ in range(200):
            stored = await etcd_client.get(key)
            rates = KvManagerRecord.from_json(stored.value).transfer_s_per_token if stored else {}
            if rates:
                break
            await asyncio.sleep(0.02)
        assert set(rates) == {layout_key} and set(rates[layout_key]) == {"cpu"}
        assert 0.0 < rates[layout_key]["cpu"] < 1e-3  # seconds per token, loopback
        assert running.servicer.rates.snapshot() == rates
    finally:
        await channel.close()
        await running.stop()
