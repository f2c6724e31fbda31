"""Decoding vLLM's KV event payloads into our event values, endpoints and tiers (no vLLM
import here: payloads are built in vLLM's wire layout; tests/integration/test_kv_events_zmq.py
decodes what vLLM's own encoder produces)."""

from __future__ import annotations

import msgspec
import pytest

from kvmesh import errors
from kvmesh.kv.events import AllBlocksCleared, BlockHash, BlockRemoved, BlockStored, Tier
from services.worker.kv_events import (
    block_hash,
    decode_events,
    events_config,
    medium_tier,
    subscriber_address,
)


def payload(*events: dict) -> bytes:
    return msgspec.msgpack.encode([1234.5, list(events), 0])


def stored(hashes, parent=None, medium="GPU", block_size=32) -> dict:
    return {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": parent,
        "token_ids": [1] * block_size * len(hashes),
        "block_size": block_size,
        "lora_id": None,
        "medium": medium,
        "lora_name": None,
    }


def test_decodes_each_event_type_in_order():
    got = decode_events(
        payload(
            stored([1, 2], None),
            {"type": "BlockRemoved", "block_hashes": [1], "medium": "GPU"},
            stored([3], 2),
            {"type": "AllBlocksCleared"},
        )
    )
    assert got == [
        BlockStored((BlockHash(1), BlockHash(2)), None, Tier.GPU, 32),
        BlockRemoved((BlockHash(1),), Tier.GPU),
        BlockStored((BlockHash(3),), BlockHash(2), Tier.GPU, 32),
        AllBlocksCleared(Tier.GPU),
    ]


def test_hashes_keep_all_64_bits_and_bytes_hashes_become_their_low_64_bits():
    full = bytes(range(32))
    got = decode_events(payload(stored([2**64 - 1, full], parent=0)))
    assert got[0].block_hashes == (2**64 - 1, int.from_bytes(full, "big") & (2**64 - 1))
    assert got[0].parent_hash == 0  # zero is a hash, not "no parent"
    assert block_hash(full) == int.from_bytes(full[-8:], "big")


@pytest.mark.parametrize(
    ("medium", "engine_only", "tier"),
    [
        pytest.param("GPU", True, Tier.GPU, id="gpu"),
        pytest.param("CPU", True, Tier.GPU, id="cpu-engine-only"),
        pytest.param(None, False, Tier.GPU, id="none-with-connector"),
        pytest.param("GPU", False, Tier.GPU, id="gpu-with-connector"),
        pytest.param("cpu", False, Tier.CPU, id="cpu-with-connector"),
        pytest.param("STORAGE", False, Tier.DISK, id="storage-with-connector"),
        pytest.param("TAPE", False, None, id="unknown-with-connector"),
    ],
)
def test_medium_tiers(medium, engine_only, tier):
    assert medium_tier(medium, engine_only) is tier


def test_unknown_types_and_mediums_are_skipped():
    got = decode_events(
        payload({"type": "SomethingNew", "x": 1}, stored([5], medium="TAPE"), stored([6])),
        engine_only=False,
    )
    assert got == [BlockStored((BlockHash(6),), None, Tier.GPU, 32)]
    cleared = decode_events(payload({"type": "AllBlocksCleared"}), engine_only=False)
    assert cleared == [AllBlocksCleared(None)]  # a connector's tiers may be cleared too


@pytest.mark.parametrize(
    ("endpoint", "address", "bind"),
    [
        pytest.param("ipc:///tmp/x/kv", "ipc:///tmp/x/kv", False, id="ipc"),
        pytest.param("tcp://*:5557", "tcp://127.0.0.1:5557", False, id="tcp-wildcard"),
        pytest.param("tcp://[::]:5557", "tcp://[::1]:5557", False, id="tcp-ipv6-wildcard"),
        pytest.param("tcp://127.0.0.1:5557", "tcp://127.0.0.1:5557", True, id="tcp-connect"),
    ],
)
def test_subscriber_address(endpoint, address, bind):
    assert subscriber_address(endpoint) == (address, bind)


@pytest.mark.parametrize("endpoint", ["inproc://kv", "tcp://*:0"])
def test_unusable_endpoints(endpoint):
    with pytest.raises(errors.InvalidArgument, match=r"kv_events_config\.endpoint"):
        subscriber_address(endpoint)


def test_events_config_is_always_on_with_ipc_defaults():
    cfg = events_config({"topic": "kv", "buffer_steps": 10}, "/run/d")
    assert cfg == {
        "topic": "kv",
        "buffer_steps": 10,
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": "ipc:///run/d/kv-events",
        "replay_endpoint": "ipc:///run/d/kv-replay",
    }
    with pytest.raises(errors.InvalidArgument, match="needs vLLM's KV events"):
        events_config({"enable_kv_cache_events": False}, "/run/d")
