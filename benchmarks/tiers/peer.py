"""Part 3: a kvmanager-to-kvmanager peer fetch, beside raw loopback TCP.

Two real kvmanager daemons in their own processes (A holds the blocks in its CPU tier, B starts
empty). This process calls B's ``KvManager.FetchFromPeer(peer_address=A)``: B asks A for a
ticket (OpenFetch), pulls the blocks over A's data plane (one TCP stream, per-block checksum
verified) and puts each one into its CPU tier. Timed from the call to its answer, as a caller
sees it. Every run uses a fresh layout, so B never holds the blocks yet.

The limit: raw loopback TCP between two processes (``net.Sender``: a child process sends, this
process receives into one reused buffer), the same bytes in block-sized chunks.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

from kvmesh.v1 import kvmanager_pb2, kvmanager_pb2_grpc

from .blocks import PEER_SPECS, BlockSpec, count_for, random_blocks
from .daemons import put_blocks, start_daemon
from .net import Sender
from .report import Figure, gbps, median

TARGET = 0.7  # the target: peer fetch >= 0.7x raw TCP


@dataclass(frozen=True, slots=True)
class PeerConfig:
    total_bytes: int = 128 << 20  # payload per cell
    repeats: int = 3


def has_fetch_from_peer() -> bool:
    return hasattr(kvmanager_pb2_grpc.KvManagerServicer, "FetchFromPeer")


def run(cfg: PeerConfig, log: Callable[[str], None] = print) -> list[Figure]:
    if not has_fetch_from_peer():
        return [
            Figure(
                title="kvmanager <- peer kvmanager fetch",
                name="peer_fetch",
                value=None,
                limit_name="tcp",
                limit=None,
                unit="gbps",
                notes="KvManager.FetchFromPeer does not exist in kvmesh/v1 yet: not measured",
            )
        ]
    runs = cfg.repeats + 1
    counts = {s: count_for(cfg.total_bytes, s.block_bytes) for s in PEER_SPECS}
    per_run = sum(n * s.block_bytes for s, n in counts.items())
    a = start_daemon("tiers-peer-a", cpu_bytes=runs * per_run + (64 << 20))
    b = start_daemon("tiers-peer-b", cpu_bytes=runs * per_run + (64 << 20))
    sender = Sender()
    results: dict[tuple[str, BlockSpec], list[float]] = defaultdict(list)
    seconds_b: dict[BlockSpec, list[float]] = defaultdict(list)
    try:
        filled: dict[tuple[int, BlockSpec], tuple[kvmanager_pb2.KvLayout, list[int]]] = {}
        for spec in PEER_SPECS:
            n = counts[spec]
            blocks = [row.tobytes() for row in random_blocks(n, spec.block_bytes, seed=7)]
            for r in range(runs):
                layout = spec.pb(f"peer-{r}")
                hashes = [(r << 40) + j + 1 for j in range(n)]
                if put_blocks(a, layout, hashes, blocks) != n:
                    raise RuntimeError(f"kvmanager A did not store all {n} blocks")
                filled[r, spec] = (layout, hashes)
        for r in range(runs):
            for spec in PEER_SPECS:
                layout, hashes = filled[r, spec]
                n = len(hashes)
                nbytes = n * spec.block_bytes

                def fetch(layout: kvmanager_pb2.KvLayout = layout, hashes: list[int] = hashes):
                    return b.stub.FetchFromPeer(
                        kvmanager_pb2.FetchFromPeerRequest(
                            layout=layout, block_hashes=hashes, peer_address=a.address
                        ),
                        timeout=300,
                    )

                order = ("tcp", "fetch") if r % 2 else ("fetch", "tcp")
                got: dict[str, float] = {}
                resp = None
                for what in order:
                    if what == "tcp":
                        got["tcp"] = gbps(nbytes, sender.receive(spec.block_bytes, nbytes))
                    else:
                        t = time.perf_counter()
                        resp = fetch()
                        got["fetch"] = gbps(nbytes, time.perf_counter() - t)
                assert resp is not None
                if resp.fetched != n:
                    raise RuntimeError(f"FetchFromPeer stored {resp.fetched} of {n} blocks: {resp}")
                log(
                    f"peer {spec.label} run {r}: FetchFromPeer {got['fetch']:.2f}"
                    f" raw TCP {got['tcp']:.2f} GB/s"
                )
                if r == 0:
                    continue  # warm-up
                results["fetch", spec].append(got["fetch"])
                results["tcp", spec].append(got["tcp"])
                seconds_b[spec].append(gbps(nbytes, resp.seconds))
    finally:
        sender.close()
        a.stop()
        b.stop()
    figures = []
    for spec in PEER_SPECS:
        value = median(results["fetch", spec])
        limit = median(results["tcp", spec])
        ratio = value / limit if value is not None and limit else None
        verdict = "" if ratio is None else ("meets" if ratio >= TARGET else "BELOW")
        figures.append(
            Figure(
                title="kvmanager <- peer kvmanager fetch",
                name="peer_fetch",
                value=value,
                limit_name="tcp",
                limit=limit,
                unit="gbps",
                block_bytes=spec.block_bytes,
                path="KvManager.FetchFromPeer end to end (B: OpenFetch on A, A's data plane,"
                " checksums, B's CPU tier)",
                limit_path="raw loopback TCP, block-sized sendall / recv_into, 2 processes",
                notes=f"{verdict} the {TARGET}x target; B's own timing:"
                f" {median(seconds_b[spec]) or 0:.2f} GB/s",
                extra={
                    "blocks": counts[spec],
                    "repeats": cfg.repeats,
                    "peer_fetch_path": "FetchFromPeer",
                    "target_over_tcp": TARGET,
                    "fetch_from_peer_reported_gbps": median(seconds_b[spec]),
                },
            )
        )
    return figures
