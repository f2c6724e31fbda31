"""KV layouts: block sizes, stable keys, field checks, mismatch messages; block hash checks."""

from __future__ import annotations

import dataclasses

import pytest

from kvmesh.errors import InvalidArgument
from kvmesh.kv.layout import BadBlock, BadLayout, KvLayout, LayoutMismatch, check_block_hash
from services.kvmanager.core.config import StoreConfig

LLAMA_8B = KvLayout("llama-3-8b", 16, 32, 8, 128, "bfloat16")


@pytest.mark.parametrize(
    ("layout", "block_bytes"),
    [
        pytest.param(LLAMA_8B, 2 * 32 * 16 * 8 * 128 * 2, id="llama8b-bf16-2MiB"),
        pytest.param(KvLayout("tiny", 32, 2, 2, 16, "float32"), 2 * 2 * 32 * 2 * 16 * 4, id="f32"),
        pytest.param(KvLayout("m", 16, 4, 1, 64, "fp8_e4m3"), 2 * 4 * 16 * 1 * 64, id="fp8"),
        pytest.param(KvLayout("m", 1, 1, 1, 1, "float16", 1, 2), 4, id="smallest-f16-rank1"),
    ],
)
def test_block_bytes(layout: KvLayout, block_bytes: int) -> None:
    assert layout.block_bytes == block_bytes
    layout.check_payload(block_bytes)
    with pytest.raises(BadBlock, match=f"needs {block_bytes}"):
        layout.check_payload(block_bytes - 1)


def test_key_is_stable_and_short() -> None:
    # Pinned: the key names directories on disk and travels on the wire, so it must not drift.
    assert LLAMA_8B.key == "b0e50319eae7501b"
    assert KvLayout("llama-3-8b", 16, 32, 8, 128, "bfloat16").key == LLAMA_8B.key
    assert len(LLAMA_8B.key) == 16 and int(LLAMA_8B.key, 16) >= 0


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("model", "llama-3-70b"),
        ("block_size", 32),
        ("num_layers", 80),
        ("num_kv_heads", 4),
        ("head_size", 64),
        ("dtype", "float16"),
        ("tp_rank", 1),
        ("tp_size", 8),
    ],
    ids=lambda v: str(v),
)
def test_every_field_changes_the_key_and_is_named_on_mismatch(field: str, value: object) -> None:
    base = dataclasses.replace(LLAMA_8B, tp_size=4)
    other = dataclasses.replace(base, **{field: value})
    assert other.key != base.key and other != base
    with pytest.raises(LayoutMismatch, match=rf"{field} {value!r} != "):
        base.require_same(other)
    base.require_same(dataclasses.replace(base))


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        pytest.param({"model": ""}, "layout.model", id="empty-model"),
        pytest.param({"block_size": 0}, "layout.block_size must be an int >= 1", id="block-size"),
        pytest.param({"num_layers": -1}, "layout.num_layers", id="layers"),
        pytest.param({"num_kv_heads": 0}, "layout.num_kv_heads", id="heads"),
        pytest.param({"head_size": 1.5}, "layout.head_size", id="float-head-size"),
        pytest.param({"dtype": "auto"}, "layout.dtype must be one of", id="dtype-auto"),
        pytest.param(
            {"tp_rank": 2, "tp_size": 2}, r"tp_rank must be in \[0, tp_size=2\)", id="rank"
        ),
        pytest.param({"tp_size": 0}, "layout.tp_size", id="tp-size"),
    ],
)
def test_bad_layouts_are_refused(changes: dict[str, object], message: str) -> None:
    with pytest.raises(BadLayout, match=message) as caught:
        dataclasses.replace(LLAMA_8B, **changes)
    assert isinstance(caught.value, InvalidArgument)  # INVALID_ARGUMENT on the wire


@pytest.mark.parametrize(
    ("value", "ok"),
    [
        pytest.param(0, True, id="zero"),
        pytest.param(2**64 - 1, True, id="max-u64"),
        pytest.param(2**64, False, id="too-big"),
        pytest.param(-1, False, id="negative"),
        pytest.param(True, False, id="bool"),
        pytest.param("12", False, id="str"),
    ],
)
def test_block_hash_must_be_u64(value: object, ok: bool) -> None:
    if ok:
        assert check_block_hash(value) == value  # type: ignore[arg-type]
    else:
        with pytest.raises(BadBlock):
            check_block_hash(value)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        pytest.param({"cpu_bytes": 0}, "cpu_bytes", id="cpu"),
        pytest.param({"disk_bytes": -1}, "disk_bytes", id="disk"),
        pytest.param({"io_threads": 0}, "io_threads", id="threads"),
    ],
)
def test_bad_store_configs_are_refused(changes: dict[str, int], message: str) -> None:
    with pytest.raises(InvalidArgument, match=message):
        StoreConfig(**changes)  # type: ignore[arg-type]


def test_store_config_defaults() -> None:
    config = StoreConfig()
    assert config.disk_dir is None and not config.has_disk
    assert not config.write_through and not config.fsync
