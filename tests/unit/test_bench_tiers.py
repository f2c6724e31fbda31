"""The pure parts of ``kvmesh bench tiers``: figures, ratios, JSON keys, the table, the options
(no timings, no daemons, no engine)."""

from __future__ import annotations

import argparse

import pytest

from benchmarks.tiers.blocks import LLAMA_8B, TINY, count_for
from benchmarks.tiers.cli import PARTS, parse_parts, register
from benchmarks.tiers.limits import Residency, resident_pages
from benchmarks.tiers.offload import batch_blocks
from benchmarks.tiers.report import Figure, fmt_size, format_table, gbps, median, ratio
from benchmarks.tiers.ttft import Sample, mismatches, prompt


def offload_figure(**kw: object) -> Figure:
    args: dict[str, object] = dict(
        title="worker -> kvmanager offload",
        name="offload",
        value=0.5,
        limit_name="memcpy",
        limit=5.0,
        unit="gbps",
        block_bytes=32 * 1024,
        path="KvManagerBlockClient.save",
        limit_path="np.copyto",
    )
    args.update(kw)
    return Figure(**args)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("value", "limit", "want"),
    [
        pytest.param(1.0, 4.0, 0.25, id="quarter"),
        pytest.param(3.0, 2.0, 1.5, id="above-limit"),
        pytest.param(None, 2.0, None, id="not-measured"),
        pytest.param(1.0, None, None, id="no-limit"),
        pytest.param(1.0, 0.0, None, id="zero-limit"),
    ],
)
def test_ratio(value, limit, want):
    assert ratio(value, limit) == want


def test_throughput_and_median():
    assert gbps(2_000_000_000, 2.0) == 1.0
    assert median([3.0, 1.0, 2.0]) == 2.0
    assert median([]) is None


@pytest.mark.parametrize(
    ("figure", "keys"),
    [
        pytest.param(
            offload_figure(),
            {"offload_gbps", "memcpy_gbps", "offload_over_memcpy"},
            id="offload",
        ),
        pytest.param(
            offload_figure(name="peer_fetch", limit_name="tcp"),
            {"peer_fetch_gbps", "tcp_gbps", "peer_fetch_over_tcp"},
            id="peer",
        ),
        pytest.param(
            offload_figure(
                name="ttft_cpu",
                limit_name="ttft_recompute",
                unit="ms",
                ratio_key="ttft_cpu_over_recompute",
            ),
            {"ttft_cpu_ms", "ttft_recompute_ms", "ttft_cpu_over_recompute"},
            id="ttft",
        ),
    ],
)
def test_json_keys(figure, keys):
    row = figure.to_json()
    assert keys <= row.keys()
    assert row["figure"] == figure.name
    assert row["block_bytes"] == 32 * 1024
    ratio_key = next(k for k in keys if "_over_" in k)
    assert row[ratio_key] == pytest.approx(figure.value / figure.limit)
    assert row[f"{figure.name}_{figure.unit}"] == figure.value
    assert row[f"{figure.limit_name}_{figure.unit}"] == figure.limit


def test_json_extra_fields_and_unknown_unit():
    row = offload_figure(extra={"blocks": 2048, "eviction_verified": True}).to_json()
    assert row["blocks"] == 2048 and row["eviction_verified"] is True
    with pytest.raises(ValueError, match="unit"):
        offload_figure(unit="MB/s")


def test_table():
    table = format_table(
        [offload_figure(), offload_figure(name="load", value=None, notes="not measured")]
    )
    lines = table.splitlines()
    assert lines[0].startswith("| figure | block | measured | limit (same run) | ratio |")
    assert lines[1].count("|") == lines[0].count("|")
    assert "| 32 KiB | 0.50 GB/s | memcpy 5.00 GB/s | 0.10x |" in lines[2]
    assert "| - | memcpy 5.00 GB/s | - |" in lines[3] and "not measured" in lines[3]
    assert all(line.count("|") == lines[0].count("|") for line in lines)


@pytest.mark.parametrize(
    ("nbytes", "text"),
    [(32 * 1024, "32 KiB"), (2 << 20, "2 MiB"), (1536 * 1024, "1.5 MiB"), (100, "100 B")],
)
def test_fmt_size(nbytes, text):
    assert fmt_size(nbytes) == text


def test_block_specs_are_the_documented_sizes():
    assert TINY.block_bytes == 32 * 1024
    assert LLAMA_8B.block_bytes == 2 * 1024 * 1024
    assert TINY.layout("a").key != TINY.layout("b").key  # every run stores fresh blocks
    assert count_for(64 << 20, 2 << 20) == 32 and count_for(1, 2 << 20) == 1
    assert batch_blocks(32 * 1024) == 64 and batch_blocks(2 << 20) == 8


def test_residency():
    assert resident_pages(bytes([1, 0, 3, 2])) == 2
    assert Residency(True, 4096, 16384).fraction == 0.25
    assert Residency(False).fraction is None
    assert "NOT verified" in Residency(False).describe()


def test_output_mismatches():
    same = {"recompute": [Sample(9.0, [1, 2], 0)], "cpu": [Sample(3.0, [1, 2], 96)]}
    assert mismatches(same) == []
    differ = {**same, "disk": [Sample(5.0, [1, 3], 96)]}
    assert mismatches(differ) == ["disk prompt 0: [1, 3] != recompute [1, 2]"]


def test_prompts_differ_from_the_first_block():
    a, b = prompt(64, 1), prompt(64, 2)
    assert len(a) == 64 and a[:32] != b[:32]
    assert all(10 <= t < 1024 for t in a)


def test_parts_and_registration():
    assert parse_parts("ttft,offload") == ["offload", "ttft"]
    with pytest.raises(SystemExit):
        parse_parts("offload,nope")
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers(dest="cmd"))
    a = parser.parse_args(["tiers", "--parts", "disk", "--json"])
    assert a.json and a.parts == "disk" and a.repeats == 3
    assert set(PARTS) == {"offload", "disk", "peer", "ttft"}


def test_bench_has_both_subcommands():
    from benchmarks.replay.cli import register as register_bench

    parser = argparse.ArgumentParser()
    register_bench(parser.add_subparsers(dest="cmd"))
    assert parser.parse_args(["bench", "tiers"]).bench_command == "tiers"
    assert parser.parse_args(["bench", "replay"]).bench_command == "replay"
