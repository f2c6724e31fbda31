"""Same-node shared memory between the connector's real ``KvManagerBlockClient`` and a real
kvmanager (gRPC on loopback): blocks saved and loaded through the segment come back
byte-identical (also when a save or a load is larger than its area), a segment the kvmanager
cannot attach leaves the client on inline bytes, bad names, sizes, tokens and regions are refused
with the right status, and the segment is detached (and its file gone) when the client closes,
when it is killed, and when the kvmanager detaches it (the client then attaches a new one)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from kvmesh.v1 import kvmanager_pb2, kvmanager_pb2_grpc
from services.kvmanager.config import KvManagerConfig, ShmConfig
from services.kvmanager.core.config import StoreConfig
from services.kvmanager.main import RunningKvManager, start_kvmanager
from services.worker.connector.client import SaveChain
from services.worker.connector.kvmanager_client import KvManagerBlockClient, kv_layout
from services.worker.connector.layout import BlockLayout
from services.worker.connector.shm import HEADER_BYTES, ShmSegment
from tests.support import eventually

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

KEY = BlockLayout(
    model="tiny", block_size=32, num_layers=2, num_kv_heads=2, head_size=32, dtype="float32",
    tp_rank=0, tp_size=1, device="cpu",
).key()  # fmt: skip
BLOCK_BYTES = kv_layout(KEY).block_bytes  # 32 KiB
LAYOUT = kvmanager_pb2.KvLayout(
    model="tiny", block_size=32, num_layers=2, num_kv_heads=2, head_size=32, dtype="float32",
    tp_size=1, device="cpu",
)  # fmt: skip
ROOT = Path(__file__).resolve().parents[2]


def blocks(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (n, BLOCK_BYTES), dtype=np.uint8)


async def start(shm_dir: Path | None) -> RunningKvManager:
    return await start_kvmanager(
        KvManagerConfig(
            kvmanager_id="node-shm",
            node="node-shm",
            etcd_endpoints=(),
            store=StoreConfig(cpu_bytes=64 << 20),
            shm=ShmConfig(dir=shm_dir, max_segments=4),
            metrics_port=-1,
            drain_grace_s=1.0,
        )
    )


@pytest.fixture
async def kvm(tmp_path: Path) -> AsyncIterator[RunningKvManager]:
    running = await start(tmp_path)
    yield running
    await running.stop()


@pytest.fixture
async def stub(kvm: RunningKvManager) -> AsyncIterator[kvmanager_pb2_grpc.KvManagerStub]:
    async with grpc.aio.insecure_channel(kvm.address) as channel:
        yield kvmanager_pb2_grpc.KvManagerStub(channel)


def client(kvm: RunningKvManager, shm_dir: Path, shm_bytes: int) -> KvManagerBlockClient:
    return KvManagerBlockClient(kvm.address, shm_bytes=shm_bytes, shm_dir=shm_dir)


async def test_save_and_load_through_shm_are_byte_identical(kvm, tmp_path):
    # Areas of 8 blocks each: a 20-block save takes three PutBlocks calls, and a 20-block load
    # gets 8 blocks in the segment and the rest inline.
    c = client(kvm, tmp_path, HEADER_BYTES + 2 * 8 * BLOCK_BYTES)
    try:
        assert await asyncio.to_thread(c.wait_shm, 10.0)
        assert kvm.shm.stats.attached == 1
        assert os.listdir(tmp_path) == [], "the kvmanager unlinks the name once mapped"
        data = blocks(20, seed=1)
        hashes = list(range(1000, 1020))
        rows = [memoryview(data[i]) for i in range(20)]
        await asyncio.to_thread(c.save, KEY, hashes[:12], None, rows[:12])
        await asyncio.to_thread(c.save, KEY, hashes[12:], hashes[11], rows[12:])
        assert kvm.shm.stats.bytes_in == 20 * BLOCK_BYTES, "every block came through shm"
        assert await asyncio.to_thread(c.lookup, KEY, hashes) == 20

        got = await asyncio.to_thread(c.load, KEY, hashes)
        assert [bytes(b) for b in got] == [data[i].tobytes() for i in range(20)]
        assert all(isinstance(b, memoryview) for b in got[:8]), "views of the segment"
        assert all(isinstance(b, bytes) for b in got[8:]), "past the load area: inline"
        assert kvm.shm.stats.bytes_out == 8 * BLOCK_BYTES
        del got

        # A miss ends the load after the blocks before it.
        got = await asyncio.to_thread(c.load, KEY, [*hashes[:3], 7, hashes[3]])
        assert [bytes(b) for b in got] == [data[i].tobytes() for i in range(3)]
        del got
    finally:
        await asyncio.to_thread(c.close)
    await eventually(lambda: kvm.shm.stats.attached == 0)


async def test_save_chains_sends_many_chains_in_one_call_and_counts_held(kvm, tmp_path):
    # Three chains (one continuing another) in one save_chains call: one PutBlocks through the
    # segment, every parent link kept; saved again, the kvmanager says it held them all.
    c = client(kvm, tmp_path, HEADER_BYTES + 2 * 16 * BLOCK_BYTES)
    try:
        assert await asyncio.to_thread(c.wait_shm, 10.0)
        data = blocks(10, seed=5)
        rows = [memoryview(data[i]) for i in range(10)]
        a, b = [2000, 2001, 2002], [3000, 3001, 3002, 3003]
        chains = [
            SaveChain(a, None, rows[0:3]),
            SaveChain(b, None, rows[3:7]),
            SaveChain([2003, 2004, 2005], 2002, rows[7:10]),
        ]
        calls = kvm.shm.stats.bytes_in
        assert await asyncio.to_thread(c.save_chains, KEY, chains) == 0
        assert kvm.shm.stats.bytes_in - calls == 10 * BLOCK_BYTES
        assert await asyncio.to_thread(c.lookup, KEY, [*a, 2003, 2004, 2005]) == 6
        assert await asyncio.to_thread(c.lookup, KEY, b) == 4
        got = await asyncio.to_thread(c.load, KEY, [*a, 2003, 2004, 2005])
        want = [data[i].tobytes() for i in (0, 1, 2, 7, 8, 9)]
        assert [bytes(x) for x in got] == want
        del got
        # Held already: counted, and nothing is stored twice. Past the save area (16 blocks
        # of 2 x 16): the rest goes inline, still counted.
        assert await asyncio.to_thread(c.save_chains, KEY, chains) == 10
        more = blocks(20, seed=6)
        big = [SaveChain(list(range(4000, 4020)), None, [memoryview(more[i]) for i in range(20)])]
        assert await asyncio.to_thread(c.save_chains, KEY, [*chains, *big]) == 10
        assert await asyncio.to_thread(c.lookup, KEY, list(range(4000, 4020))) == 20
    finally:
        await asyncio.to_thread(c.close)


async def test_client_close_detaches_and_removes_the_segment(kvm, tmp_path):
    c = client(kvm, tmp_path, 1 << 20)
    assert await asyncio.to_thread(c.wait_shm, 10.0)
    shm_id = c.shm_id
    assert shm_id is not None
    segment = kvm.shm.get(shm_id)
    await asyncio.to_thread(c.close)
    await eventually(lambda: kvm.shm.stats.attached == 0)
    assert segment.detached.is_set()
    with pytest.raises(Exception, match="detached"):
        segment.write(HEADER_BYTES, b"x")  # the stale mapping is closed: never written again
    assert os.listdir(tmp_path) == []


async def test_a_killed_client_is_detached(kvm, tmp_path):
    code = (
        "import sys, time\n"
        "from pathlib import Path\n"
        "from services.worker.connector.kvmanager_client import KvManagerBlockClient\n"
        f"c = KvManagerBlockClient({kvm.address!r}, shm_bytes=1 << 20, shm_dir=Path({str(tmp_path)!r}))\n"
        "assert c.wait_shm(30.0)\n"
        "print('attached', flush=True)\n"
        "time.sleep(600)\n"
    )  # fmt: skip
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", code, cwd=ROOT, stdout=subprocess.PIPE
    )
    try:
        assert proc.stdout is not None
        line = await asyncio.wait_for(proc.stdout.readline(), 60)
        assert line.strip() == b"attached"
        assert kvm.shm.stats.attached == 1
        proc.kill()
        await proc.wait()
        await eventually(lambda: kvm.shm.stats.attached == 0)
        assert os.listdir(tmp_path) == []
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def test_a_detached_client_goes_inline_then_attaches_a_new_segment(kvm, tmp_path, stub):
    c = client(kvm, tmp_path, 1 << 20)
    try:
        assert await asyncio.to_thread(c.wait_shm, 10.0)
        old = c.shm_id
        assert old is not None
        resp = await stub.DetachShm(kvmanager_pb2.DetachShmRequest(shm_id=old), timeout=5)
        assert resp.detached
        # A call naming the old id is refused: nothing is written through a detached mapping.
        region = kvmanager_pb2.ShmRegion(shm_id=old, offset=HEADER_BYTES, length=BLOCK_BYTES)
        req = kvmanager_pb2.GetBlocksRequest(layout=LAYOUT, block_hashes=[1], shm=region)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            _ = [m async for m in stub.GetBlocks(req, timeout=5)]
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
        data = blocks(3, seed=2)
        hashes = [2001, 2002, 2003]
        await eventually(lambda: c.shm_id != old)  # the lease ended; then a new segment
        await asyncio.to_thread(c.save, KEY, hashes, None, [data[i] for i in range(3)])
        got = await asyncio.to_thread(c.load, KEY, hashes)
        assert [bytes(b) for b in got] == [data[i].tobytes() for i in range(3)]
        del got
        await eventually(lambda: c.shm_id is not None)
        assert kvm.shm.stats.attaches == 2
    finally:
        await asyncio.to_thread(c.close)


@pytest.mark.parametrize("shm_dir", ["elsewhere", None], ids=["segment-not-found", "shm-off"])
async def test_a_segment_that_cannot_be_attached_leaves_bytes_inline(tmp_path, shm_dir):
    # "elsewhere": the kvmanager looks in another directory (another node's /dev/shm).
    kvm_dir = tmp_path / "elsewhere" if shm_dir else None
    if kvm_dir is not None:
        kvm_dir.mkdir()
    kvm = await start(kvm_dir)
    c = client(kvm, tmp_path, 1 << 20)
    try:
        assert not await asyncio.to_thread(c.wait_shm, 1.0)
        await eventually(lambda: kvm.shm.stats.refused == 1)
        assert c.shm_id is None
        # The refused segment is removed at once (the next try is 30 s later).
        await eventually(
            lambda: not [p for p in tmp_path.iterdir() if p.name.startswith("kvmesh-")]
        )
        data = blocks(4, seed=3)
        hashes = [3001, 3002, 3003, 3004]
        await asyncio.to_thread(c.save, KEY, hashes, None, [data[i] for i in range(4)])
        got = await asyncio.to_thread(c.load, KEY, hashes)
        assert got == [data[i].tobytes() for i in range(4)]
        assert kvm.shm.stats.bytes_in == kvm.shm.stats.bytes_out == 0
    finally:
        await asyncio.to_thread(c.close)
        await kvm.stop()


async def attach(stub, segment: ShmSegment, **override: Any):
    req = kvmanager_pb2.AttachShmRequest(
        name=segment.name, size_bytes=segment.size, token=segment.token
    )
    for field, value in override.items():
        setattr(req, field, value)
    call = stub.AttachShm(req)
    first = await call.read()
    return call, first


async def status_of(aw) -> grpc.StatusCode:
    try:
        await aw
    except grpc.aio.AioRpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


@pytest.mark.parametrize(
    ("override", "code"),
    [
        pytest.param({"name": "../../etc/passwd"}, "INVALID_ARGUMENT", id="path"),
        pytest.param({"name": "other-name"}, "INVALID_ARGUMENT", id="no-prefix"),
        pytest.param({"name": "kvmesh-a/b"}, "INVALID_ARGUMENT", id="slash"),
        pytest.param({"name": "kvmesh-nothere"}, "NOT_FOUND", id="missing"),
        pytest.param({"size_bytes": 2 << 20}, "INVALID_ARGUMENT", id="wrong-size"),
        pytest.param({"size_bytes": 100}, "INVALID_ARGUMENT", id="too-small"),
        pytest.param({"token": b"x" * 16}, "INVALID_ARGUMENT", id="wrong-token"),
        pytest.param({"token": b""}, "INVALID_ARGUMENT", id="no-token"),
    ],
)
async def test_bad_attach_requests_are_refused(kvm, stub, tmp_path, override, code):
    segment = ShmSegment(1 << 20, tmp_path)
    try:
        assert await status_of(attach(stub, segment, **override)) == grpc.StatusCode[code]
        assert kvm.shm.stats.attached == 0
        assert segment.path.exists(), "a refused attach leaves the file alone"
    finally:
        segment.close()


async def test_a_symlink_is_not_followed(kvm, stub, tmp_path):
    segment = ShmSegment(1 << 20, tmp_path)
    link = tmp_path / "kvmesh-link"
    link.symlink_to(segment.path)
    try:
        assert await status_of(attach(stub, segment, name=link.name)) == (
            grpc.StatusCode.INVALID_ARGUMENT
        )
    finally:
        segment.close()


async def test_out_of_range_regions_are_refused(kvm, stub, tmp_path):
    segment = ShmSegment(1 << 20, tmp_path)
    call, first = await attach(stub, segment)
    shm_id = first.shm_id
    end = segment.size

    def put(offset: int, length: int, shm: int = shm_id):
        async def gen():
            b = kvmanager_pb2.KvBlock(block_hash=5)
            b.shm.shm_id, b.shm.offset, b.shm.length = shm, offset, length
            yield kvmanager_pb2.PutBlocksRequest(layout=LAYOUT, blocks=[b])

        return stub.PutBlocks(gen(), timeout=5)

    async def get(offset: int, length: int, shm: int = shm_id):
        region = kvmanager_pb2.ShmRegion(shm_id=shm, offset=offset, length=length)
        req = kvmanager_pb2.GetBlocksRequest(layout=LAYOUT, block_hashes=[5], shm=region)
        return [m async for m in stub.GetBlocks(req, timeout=5)]

    try:
        bad = grpc.StatusCode.INVALID_ARGUMENT
        assert await status_of(put(end - BLOCK_BYTES + 1, BLOCK_BYTES)) == bad  # past the end
        assert await status_of(put(2**63, BLOCK_BYTES)) == bad  # far past the end
        assert await status_of(put(0, BLOCK_BYTES)) == bad  # the header
        assert await status_of(put(HEADER_BYTES, BLOCK_BYTES - 1)) == bad  # not one block
        assert await status_of(put(HEADER_BYTES, BLOCK_BYTES, shm=12345)) == (
            grpc.StatusCode.NOT_FOUND
        )
        assert await status_of(get(end - 10, 11)) == bad
        assert await status_of(get(0, BLOCK_BYTES)) == bad
        assert await status_of(get(HEADER_BYTES, 10, shm=12345)) == grpc.StatusCode.NOT_FOUND
        # In range: stored, then read back into the segment at the region's start.
        block = np.random.default_rng(4).integers(0, 256, BLOCK_BYTES, dtype=np.uint8)
        segment.buf[HEADER_BYTES : HEADER_BYTES + BLOCK_BYTES] = block
        assert (await put(HEADER_BYTES, BLOCK_BYTES)).stored == 1
        segment.buf[HEADER_BYTES : HEADER_BYTES + BLOCK_BYTES] = bytes(BLOCK_BYTES)
        out = HEADER_BYTES + 3 * BLOCK_BYTES + 1  # not aligned: the block goes to the next 64
        (msg,) = await get(out, 2 * BLOCK_BYTES)
        r = msg.blocks[0].shm
        assert (r.shm_id, r.offset % 64, r.length) == (shm_id, 0, BLOCK_BYTES)
        assert out <= r.offset < out + 64
        assert bytes(segment.buf[r.offset : r.offset + r.length]) == block.tobytes()
        # A region too small for the block: it comes inline.
        (msg,) = await get(HEADER_BYTES, BLOCK_BYTES - 1)
        assert msg.blocks[0].data == block.tobytes()
    finally:
        call.cancel()
        await eventually(lambda: kvm.shm.stats.attached == 0)
        segment.close()


async def test_too_many_segments_and_shutdown_detaches_all(tmp_path):
    kvm = await start(tmp_path)
    calls, segments = [], []
    stopped = False
    try:
        async with grpc.aio.insecure_channel(kvm.address) as channel:
            stub = kvmanager_pb2_grpc.KvManagerStub(channel)
            for _ in range(4):
                segments.append(ShmSegment(1 << 20, tmp_path))
                calls.append((await attach(stub, segments[-1]))[0])
            extra = ShmSegment(1 << 20, tmp_path)
            segments.append(extra)
            code = await status_of(attach(stub, extra))
            assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
            await kvm.stop()
            stopped = True
            assert kvm.shm.stats.attached == 0
            for call in calls:  # the leases end when the kvmanager stops
                assert await call.read() == grpc.aio.EOF
    finally:
        if not stopped:
            await kvm.stop()
        for s in segments:
            s.close()
