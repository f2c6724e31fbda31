"""The ``KvBlockClient`` protocol's contract (``services/worker/connector/client.py``), one suite
run against every implementation: ``DirectoryBlockClient`` over a directory, and
``KvManagerBlockClient`` against a real kvmanager on loopback, with bytes inline and through a
shared-memory segment. What the connector relies on: a chain's leading blocks found and loaded
byte-identical in order, a miss ending a lookup or load there, layouts kept apart, saving twice
harmless, ``lookup_tiers`` agreeing with ``lookup``, two threads at once, and a store that is
down answering "nothing" instead of raising.

The kvmanager runs on this test's event loop, so every (blocking) client call goes to a thread.
"""

from __future__ import annotations

import asyncio
import itertools
import random
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import Any

import pytest

from kvmesh.kv.events import Tier
from services.kvmanager.config import KvManagerConfig, ShmConfig
from services.kvmanager.core.config import StoreConfig
from services.kvmanager.main import RunningKvManager, start_kvmanager
from services.worker.connector.client import BlockBytes, KvBlockClient, TieredLookup
from services.worker.connector.directory import DirectoryBlockClient
from services.worker.connector.kvmanager_client import KvManagerBlockClient, kv_layout
from services.worker.connector.layout import BlockLayout

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


def layout_key(model: str) -> str:
    return BlockLayout(
        model=model, block_size=32, num_layers=2, num_kv_heads=2, head_size=32, dtype="float32",
        tp_rank=0, tp_size=1, device="cpu",
    ).key()  # fmt: skip


KEY, OTHER_KEY = layout_key("tiny"), layout_key("tiny-other")
BLOCK_BYTES = kv_layout(KEY).block_bytes  # 32 KiB: what the kvmanager accepts for the layout
_hash_bases = itertools.count(1)


def chain(n: int) -> list[int]:
    """``n`` block hashes no other test of the module uses (the stores are shared)."""
    base = next(_hash_bases) * 10_000
    return list(range(base, base + n))


def payloads(n: int, seed: int) -> list[bytes]:
    rng = random.Random(seed)
    return [rng.randbytes(BLOCK_BYTES) for _ in range(n)]


def as_bytes(blocks: Sequence[BlockBytes] | None) -> list[bytes]:
    """What a load returned, copied (a shared-memory view is valid until the next load)."""
    return [bytes(b) for b in blocks or ()]


@pytest.fixture(scope="module")
def shm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("shm")


@pytest.fixture(scope="module")
async def kvmanager(shm_dir: Path) -> AsyncIterator[RunningKvManager]:
    running = await start_kvmanager(
        KvManagerConfig(
            kvmanager_id="node-conformance",
            node="node-conformance",
            etcd_endpoints=(),
            store=StoreConfig(cpu_bytes=64 << 20),
            shm=ShmConfig(dir=shm_dir, max_segments=4),
            metrics_port=-1,
            drain_grace_s=1.0,
        )
    )
    yield running
    await running.stop()


@pytest.fixture(scope="module")
def directory_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("blocks")


@pytest.fixture(params=["directory", "kvmanager-inline", "kvmanager-shm"])
async def client(
    request: pytest.FixtureRequest,
    kvmanager: RunningKvManager,
    directory_root: Path,
    shm_dir: Path,
) -> AsyncIterator[KvBlockClient]:
    kind: str = request.param
    c: KvBlockClient
    if kind == "directory":
        c = DirectoryBlockClient(directory_root)
    elif kind == "kvmanager-inline":
        c = KvManagerBlockClient(kvmanager.address, shm_bytes=0)
    else:
        kc = KvManagerBlockClient(kvmanager.address, shm_bytes=8 << 20, shm_dir=shm_dir)
        assert await asyncio.to_thread(kc.wait_shm, 10.0), "no segment attached"
        c = kc
    yield c
    await asyncio.to_thread(c.close)


async def call(fn: Callable[..., Any], *args: Any) -> Any:
    return await asyncio.to_thread(fn, *args)


async def test_it_is_a_block_client_with_tiers(client: KvBlockClient) -> None:
    assert isinstance(client, KvBlockClient) and isinstance(client, TieredLookup)


async def test_an_empty_store_has_nothing(client: KvBlockClient) -> None:
    hashes = chain(3)
    assert await call(client.lookup, KEY, hashes) == 0
    assert as_bytes(await call(client.load, KEY, hashes)) == []
    assert await call(client.lookup, KEY, []) == 0
    assert as_bytes(await call(client.load, KEY, [])) == []


async def test_saved_blocks_come_back_byte_identical_in_order(client: KvBlockClient) -> None:
    hashes, data = chain(6), payloads(6, seed=1)
    await call(client.save, KEY, hashes[:4], None, data[:4])
    await call(client.save, KEY, hashes[4:], hashes[3], data[4:])  # the chain continued
    assert await call(client.lookup, KEY, hashes) == 6
    assert as_bytes(await call(client.load, KEY, hashes)) == data
    assert as_bytes(await call(client.load, KEY, hashes[:2])) == data[:2]


async def test_a_miss_ends_the_lookup_and_the_load_there(client: KvBlockClient) -> None:
    hashes, data = chain(4), payloads(4, seed=2)
    await call(client.save, KEY, hashes, None, data)
    gap = [*hashes[:2], chain(1)[0], *hashes[2:]]
    assert await call(client.lookup, KEY, gap) == 2
    assert as_bytes(await call(client.load, KEY, gap)) == data[:2]


async def test_layouts_are_kept_apart(client: KvBlockClient) -> None:
    hashes, data = chain(2), payloads(2, seed=3)
    await call(client.save, KEY, hashes, None, data)
    assert await call(client.lookup, OTHER_KEY, hashes) == 0
    assert as_bytes(await call(client.load, OTHER_KEY, hashes)) == []


async def test_saving_again_is_harmless(client: KvBlockClient) -> None:
    hashes, data = chain(3), payloads(3, seed=4)
    await call(client.save, KEY, hashes, None, data)
    await call(client.save, KEY, hashes, None, data)
    await call(client.save, KEY, hashes[1:], hashes[0], data[1:])
    assert await call(client.lookup, KEY, hashes) == 3
    assert as_bytes(await call(client.load, KEY, hashes)) == data


async def test_lookup_tiers_agrees_with_lookup(client: KvBlockClient) -> None:
    assert isinstance(client, TieredLookup)
    hashes, data = chain(3), payloads(3, seed=5)
    await call(client.save, KEY, hashes[:2], None, data[:2])
    tiers = await call(client.lookup_tiers, KEY, hashes)
    assert len(tiers) == await call(client.lookup, KEY, hashes) == 2
    assert all(t in (Tier.CPU, Tier.DISK) for t in tiers)


async def test_discard_never_leaves_wrong_bytes(client: KvBlockClient) -> None:
    """A store may drop discarded blocks or keep them (the kvmanager checks sizes itself): what a
    load returns afterwards is a prefix of what was saved."""
    hashes, data = chain(3), payloads(3, seed=6)
    await call(client.save, KEY, hashes, None, data)
    await call(client.discard, KEY, hashes[1:2])
    got = as_bytes(await call(client.load, KEY, hashes))
    assert got == data[: len(got)] and len(got) >= 1
    assert await call(client.lookup, KEY, hashes) == len(got)


async def test_two_threads_at_once(client: KvBlockClient) -> None:
    """The engine thread looks up and loads while the saver thread saves."""
    saved, data = chain(8), payloads(8, seed=7)
    await call(client.save, KEY, saved[:4], None, data[:4])

    def saver() -> None:
        for i in range(4, 8):
            client.save(KEY, saved[i : i + 1], saved[i - 1], data[i : i + 1])

    def engine() -> list[list[bytes]]:
        return [as_bytes(client.load(KEY, saved[:4])) for _ in range(8)]

    _, loads = await asyncio.gather(asyncio.to_thread(saver), asyncio.to_thread(engine))
    assert all(got == data[:4] for got in loads)
    assert as_bytes(await call(client.load, KEY, saved)) == data


async def test_a_store_that_is_down_answers_nothing() -> None:
    """The kvmanager client of a kvmanager that is not there (a directory store has no such
    state): "nothing", never an exception."""
    client = KvManagerBlockClient("127.0.0.1:1", lookup_timeout_s=0.5, load_timeout_s=1.0,
                                  save_timeout_s=1.0, shm_bytes=0)  # fmt: skip
    try:
        hashes, data = chain(2), payloads(2, seed=8)
        assert await call(client.lookup, KEY, hashes) == 0
        assert as_bytes(await call(client.load, KEY, hashes)) == []
        await call(client.save, KEY, hashes, None, data)  # does not raise
    finally:
        await call(client.close)
