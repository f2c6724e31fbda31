"""The decode side of a prefill/decode hand-off against a real kvmanager: the connector's fetcher
(``peer_prefetch.KvManagerFetcher``) reads a hint naming its own node's kvmanager as "these
blocks are about to land" and waits, bounded, for the prefill worker's late saves."""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import asdict

import grpc
import pytest

from kvmesh.v1 import kvmanager_pb2, kvmanager_pb2_grpc
from services.kvmanager.config import KvManagerConfig
from services.kvmanager.main import start_kvmanager
from services.kvmanager.servicer import layout_from_pb
from services.worker.connector.layout import parse_layout_key
from services.worker.connector.peer_prefetch import KvManagerFetcher
from services.worker.connector.plan import PeerSource

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

KEY = (
    "kvmesh-kv1;model=tiny;block_size=32;num_layers=2;num_kv_heads=2;head_size=32;"
    "dtype=float32;tp_rank=0;tp_size=1;device=cpu"
)
LAYOUT = kvmanager_pb2.KvLayout(**asdict(parse_layout_key(KEY)))
HASHES = [1000 + i for i in range(8)]


def put_later(address: str, delay_s: float) -> threading.Thread:
    def run() -> None:
        time.sleep(delay_s)
        with grpc.insecure_channel(address) as channel:
            stub = kvmanager_pb2_grpc.KvManagerStub(channel)
            size = layout_from_pb(LAYOUT).block_bytes
            blocks = [kvmanager_pb2.KvBlock(block_hash=h, data=bytes(size)) for h in HASHES]
            stub.PutBlocks(iter([kvmanager_pb2.PutBlocksRequest(layout=LAYOUT, blocks=blocks)]))

    t = threading.Thread(target=run)
    t.start()
    return t


@pytest.mark.parametrize(
    ("wait_s", "hint_wait_s", "lands"),
    [(2.0, 0.0, True), (0.0, 0.0, False), (0.0, 2.0, True)],
    ids=["waits", "off", "the-hint-says-how-long"],
)
async def test_local_handoff_waits_for_late_saves(
    etcd, wait_s: float, hint_wait_s: float, lands: bool
):
    """The connector's default wait (``handoff_wait_s``), or the router's per-request one in
    the hint (an overlapped hand-off: the prefill still runs while the decode request waits)."""
    kvm = await start_kvmanager(
        KvManagerConfig(
            kvmanager_id="kvm-h",
            cluster=f"handoff{int(wait_s)}{int(hint_wait_s)}",
            etcd_endpoints=tuple(etcd.endpoints),
            drain_grace_s=1.0,
            metrics_port=-1,
        )
    )
    fetcher = KvManagerFetcher(kvm.address, handoff_wait_s=wait_s)
    try:
        saver = put_later(kvm.address, 0.3)
        started = time.monotonic()
        outcome = await asyncio.to_thread(
            fetcher, KEY, HASHES, PeerSource("kvm-h", len(HASHES), hint_wait_s), 3.0
        )
        took = time.monotonic() - started
        await asyncio.to_thread(saver.join)
        assert outcome.error == ""  # nothing fetched from a peer: the blocks are local
        if lands:
            assert 0.25 < took < 2.0  # returned once the late saves landed
        else:
            assert took < 0.25  # no waiting: the request recomputes what is missing
    finally:
        fetcher.close()
        await kvm.stop()
