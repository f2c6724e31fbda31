"""The simulator's KV hand-off (services/worker/sim: a simulator, not an engine): a request
admitted with handed-over blocks counts them as cached, stores them, and reaches its first token
sooner than one that prefills everything."""

from __future__ import annotations

import pytest

from kvmesh.kv.events import BlockHash, BlockStored
from services.worker.sim.model import SimRequest, SimulatedWorker, SimWorkerConfig

BS = 32
HASHES = tuple(BlockHash(100 + i) for i in range(20))


@pytest.mark.parametrize(("external", "cached"), [(0, 0), (10, 320), (20, 19 * BS), (99, 19 * BS)])
def test_external_blocks_count_as_cached(external: int, cached: int):
    events: list = []
    w = SimulatedWorker(SimWorkerConfig(block_size=BS), kv_sink=events.extend)
    w.submit(SimRequest("r", HASHES, 20 * BS, 2, external_blocks=external))
    (res,) = w.drain()
    assert res.cached_tokens == cached
    stored = [h for e in events if isinstance(e, BlockStored) for h in e.block_hashes]
    assert stored == list(HASHES)  # loaded blocks enter the cache too, once each


def test_handed_over_prefill_is_faster():
    def ttft(external: int) -> float:
        w = SimulatedWorker(SimWorkerConfig(block_size=BS))
        w.submit(SimRequest("r", HASHES, 20 * BS + 5, 2, external_blocks=external))
        (res,) = w.drain()
        assert res.ttft_s is not None
        return res.ttft_s

    assert ttft(20) < ttft(0)
