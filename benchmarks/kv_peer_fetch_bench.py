"""Peer fetch end to end between two kvmanager daemons on loopback, beside gRPC GetBlocks;
with ``--tls``, plaintext and mutual TLS side by side in the same run.

    .venv/bin/python benchmarks/kv_peer_fetch_bench.py [--total-mib 128] [--repeats 3] [--tls]
    sudo .venv/bin/python benchmarks/kv_peer_fetch_bench.py --netns [--total-mib 64]

Two real daemons run as child processes (``python -m services.kvmanager.main``, no etcd): A holds
the blocks, B fetches them. This process fills A over gRPC PutBlocks, then per block size
(256 KiB, 1 MiB, 4 MiB) and repeat, round-robin, times

* FetchFromPeer: this process calls B's ``FetchFromPeer``; B asks A for a ticket (OpenFetch),
  pulls the blocks over A's data plane, verifies each checksum and puts each block into its
  CPU tier. Timed from the call to its answer, as a caller sees it.
* gRPC GetBlocks: this process reads the same blocks from A with ``GetBlocks`` (one message per
  block) and drops them: the gRPC baseline, with no store at the receiving end.

Each repeat starts a block size's cells one further along the list than the last (rotated),
so that no transport always runs first or last. Every repeat uses a fresh layout (so B never holds the blocks yet); A and B are warmed up first.
GB/s is payload bytes / wall time (1 GB = 1e9 bytes), median over the repeats; "CPU s/GB" is
the CPU time (all threads) of the serving daemon A and of the receiving side (B for
FetchFromPeer, this process for GetBlocks) per GB moved. Prints a markdown table.

``--tls``: a second pair of daemons runs with mutual TLS on every plane (gRPC and the data
plane; certificates made by this script in a temporary directory, ``kvmesh/tlsgen.py``), this
process calling them over TLS too, a third pair with ``--data-plane-security auth`` (mutual TLS
on gRPC and for the data plane's handshake and ticket, then the blocks in plaintext on the same
connection; the fetcher keeps that authenticated connection for the next fetch), a fourth in
``auth`` with the fetcher keeping no connection (``--peer-pool-idle-per-peer 0``: a TLS
handshake every fetch, as before kept connections) and a fifth with ``--data-plane-security
plain`` (mutual TLS on gRPC, no TLS on the data plane); the last three FetchFromPeer only. Every repeat times every (path, transport)
cell of a block size back to back, so the transports see the same machine; a second table puts
them side by side (mTLS / plaintext).

``--netns``: A and B each in a network namespace of its own on a bridge (kvmesh/netns.py, needs
root), listening on their namespace's address, so FetchFromPeer's bytes cross two veth pairs and
the bridge, as between two nodes; GetBlocks reads A from the root namespace across A's link. A
third row is the link's raw TCP: one stream of the same bytes from a plain socket in A's
namespace to one in B's (``recv_into`` a reused buffer, no checksum, no store), timed at B.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import grpc

from kvmesh.netns import NetnsLab, Node
from kvmesh.tls import Tls, TlsConfig, open_channel
from kvmesh.v1 import kvmanager_pb2, kvmanager_pb2_grpc
from services.kvmanager.peer.wire import preferred_algo

ROOT = Path(__file__).resolve().parent.parent
KiB = 1 << 10
MiB = 1 << 20
SIZES = (256 * KiB, 1 * MiB, 4 * MiB)
_OPTIONS = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]
_TICK = os.sysconf("SC_CLK_TCK")


def layout(size: int, tag: str) -> kvmanager_pb2.KvLayout:
    """A float32 layout whose blocks are ``size`` bytes (2 * L * 16 * 4 * 128 * 4 = 64 KiB * L)."""
    return kvmanager_pb2.KvLayout(
        model=f"bench-{tag}",
        block_size=16,
        num_layers=size // (64 * KiB),
        num_kv_heads=4,
        head_size=128,
        dtype="float32",
    )


@dataclass
class Daemon:
    proc: asyncio.subprocess.Process
    address: str
    stub: kvmanager_pb2_grpc.KvManagerStub
    channel: grpc.aio.Channel

    def cpu_s(self) -> float:
        fields_ = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields_[11]) + int(fields_[12])) / _TICK  # utime + stime


async def start_daemon(
    name: str,
    cpu_bytes: int,
    tls: TlsConfig | None = None,
    data_plane_security: str = "tls",
    node: Node | None = None,
    extra: list[str] | None = None,
) -> Daemon:
    tls_args = []
    if tls is not None:
        tls_args = [
            "--tls-cert-file", str(tls.cert_file), "--tls-key-file", str(tls.key_file),
            "--tls-ca-file", str(tls.ca_file),
            "--data-plane-security", data_plane_security,
        ]  # fmt: skip
    netns = ["ip", "netns", "exec", node.name] if node else []
    host = ["--host", node.address] if node else []
    proc = await asyncio.create_subprocess_exec(
        *netns, sys.executable, "-m", "services.kvmanager.main", "--kvmanager-id", name, "--node", name, *host,
        "--etcd", "", "--metrics-port", "-1", "--cpu-bytes", str(cpu_bytes), "--cpu-populate", "start",
        "--log-level", "WARNING", *tls_args, *(extra or []), cwd=ROOT, stdout=asyncio.subprocess.PIPE,
    )  # fmt: skip
    assert proc.stdout is not None
    line = (await asyncio.wait_for(proc.stdout.readline(), 60)).decode()
    fields_ = dict(kv.split("=", 1) for kv in line.split()[1:])
    loaded: Tls | None = tls.load() if tls is not None else None
    channel = open_channel(fields_["address"], loaded, options=_OPTIONS)
    return Daemon(proc, fields_["address"], kvmanager_pb2_grpc.KvManagerStub(channel), channel)


async def fill(a: Daemon, lay: kvmanager_pb2.KvLayout, size: int, count: int) -> list[int]:
    base = os.urandom(size)
    hashes = list(range(1, count + 1))
    per_msg = max(1, (32 * MiB) // size)

    async def gen() -> AsyncIterator[kvmanager_pb2.PutBlocksRequest]:
        for i in range(0, count, per_msg):
            blocks = [
                kvmanager_pb2.KvBlock(block_hash=h, data=h.to_bytes(8, "little") + base[8:])
                for h in hashes[i : i + per_msg]
            ]
            yield kvmanager_pb2.PutBlocksRequest(layout=lay, blocks=blocks)

    stored = (await a.stub.PutBlocks(gen(), timeout=120)).stored
    assert stored == count, (stored, count)
    return hashes


@dataclass
class Cell:
    path: str
    size: int
    gbps: list[float] = field(default_factory=list)
    blocks_s: list[float] = field(default_factory=list)
    serve_cpu: list[float] = field(default_factory=list)
    recv_cpu: list[float] = field(default_factory=list)


async def fetch_from_peer(
    a: Daemon, b: Daemon, lay: kvmanager_pb2.KvLayout, hashes: list[int]
) -> None:
    resp = await b.stub.FetchFromPeer(
        kvmanager_pb2.FetchFromPeerRequest(layout=lay, block_hashes=hashes, peer_address=a.address),
        timeout=120,
    )
    assert resp.fetched == len(hashes), resp


async def get_blocks(a: Daemon, lay: kvmanager_pb2.KvLayout, hashes: list[int]) -> None:
    got = 0
    call = a.stub.GetBlocks(
        kvmanager_pb2.GetBlocksRequest(layout=lay, block_hashes=hashes), timeout=120
    )
    async for msg in call:
        assert msg.HasField("block"), msg
        got += 1
    assert got == len(hashes)


PATHS = ("FetchFromPeer (data plane)", "gRPC GetBlocks")
RAW = "raw TCP, one stream"

_RAW_SEND = """
import socket, sys
n = int(sys.argv[2]); buf = bytes(1 << 20)
s = socket.create_server((sys.argv[1], 0)); print(s.getsockname()[1], flush=True)
c, _ = s.accept()
while n > 0:
    c.sendall(buf[: min(n, len(buf))]); n -= len(buf)
c.close()
"""
_RAW_RECV = """
import socket, sys, time
n = int(sys.argv[3]); buf = bytearray(1 << 20); t = time.perf_counter()
c = socket.create_connection((sys.argv[1], int(sys.argv[2])))
while n > 0 and (k := c.recv_into(buf)):
    n -= k
print(time.perf_counter() - t)
"""


async def raw_tcp_s(a: Node, b: Node, nbytes: int) -> float:
    """Seconds one TCP stream takes to move ``nbytes`` from A's namespace to B's."""
    sender = await asyncio.create_subprocess_exec(
        "ip", "netns", "exec", a.name, sys.executable, "-c", _RAW_SEND, a.address, str(nbytes),
        stdout=asyncio.subprocess.PIPE,
    )  # fmt: skip
    assert sender.stdout is not None
    port = (await asyncio.wait_for(sender.stdout.readline(), 30)).decode().strip()
    recv = await asyncio.create_subprocess_exec(
        "ip", "netns", "exec", b.name, sys.executable, "-c", _RAW_RECV, a.address, port,
        str(nbytes), stdout=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, _ = await asyncio.wait_for(recv.communicate(), 120)
    await sender.wait()
    return float(out.decode().strip())


MTLS = "mTLS"
MTLS_AUTH = "mTLS control plane, data plane authenticated by mTLS then plaintext (auth)"
MTLS_CONTROL = "mTLS control plane, plaintext data plane"
MTLS_AUTH_EACH = "auth, a TLS handshake every fetch (no kept connections)"
SECURITY = {MTLS: "tls", MTLS_AUTH: "auth", MTLS_CONTROL: "plain", MTLS_AUTH_EACH: "auth"}
EXTRA = {MTLS_AUTH_EACH: ["--peer-pool-idle-per-peer", "0"]}  # more daemon flags, per mode


async def _main(args: argparse.Namespace) -> None:
    total = args.total_mib * MiB
    runs = args.repeats + 1  # + a warm-up per size
    a_bytes = len(SIZES) * runs * total + 64 * MiB
    b_bytes = 2 * total + 64 * MiB
    modes = ["plaintext", *([MTLS, MTLS_AUTH, MTLS_AUTH_EACH, MTLS_CONTROL] if args.tls else [])]
    tls_cfg: TlsConfig | None = None
    certs = tempfile.TemporaryDirectory(prefix="kvmesh-bench-tls-")
    if args.tls:
        from kvmesh.tlsgen import make_pki

        pki = make_pki(Path(certs.name))
        tls_cfg = TlsConfig(
            cert_file=pki.node.cert_file, key_file=pki.node.key_file, ca_file=pki.ca_file
        )
    lab = NetnsLab(2).up() if args.netns else None
    na, nb = lab.nodes if lab else (None, None)
    pairs: dict[str, tuple[Daemon, Daemon]] = {}
    for i, mode in enumerate(modes):
        cfg = tls_cfg if mode != "plaintext" else None
        security = SECURITY.get(mode, "tls")
        a, b = await asyncio.gather(
            start_daemon(f"bench-a-{i}", a_bytes, cfg, security, na),
            start_daemon(f"bench-b-{i}", b_bytes, cfg, security, nb, EXTRA.get(mode, [])),
        )
        pairs[mode] = (a, b)
    raw = Cell(RAW, 0)
    try:
        t0 = time.perf_counter()
        layouts: dict[tuple[str, int, int], tuple[kvmanager_pb2.KvLayout, list[int]]] = {}
        for mode, (a, _) in pairs.items():
            for r in range(runs):
                for size in SIZES:
                    lay = layout(size, f"{size}-{r}")
                    layouts[mode, size, r] = (lay, await fill(a, lay, size, total // size))
        fill_s = time.perf_counter() - t0
        cells = {
            (path, mode, size): Cell(path, size)
            for size in SIZES
            for path in PATHS
            for mode in modes
            if mode in ("plaintext", MTLS) or path == PATHS[0]  # GetBlocks: as with mTLS
        }
        for r in range(runs):
            for size in SIZES:
                # Each repeat starts the size's cells one further along, so no transport always
                # runs first (right after the previous size's cells) or last.
                group = [(key, cell) for key, cell in cells.items() if key[2] == size]
                shift = r % len(group)
                for (path, mode, _sz), cell in group[shift:] + group[:shift]:
                    a, b = pairs[mode]
                    lay, hashes = layouts[mode, size, r]
                    me = time.process_time()
                    a_cpu, b_cpu = a.cpu_s(), b.cpu_s()
                    t = time.perf_counter()
                    if path.startswith("FetchFromPeer"):
                        await fetch_from_peer(a, b, lay, hashes)
                    else:
                        await get_blocks(a, lay, hashes)
                    wall = time.perf_counter() - t
                    if r == 0:
                        continue  # warm-up
                    gb = len(hashes) * size / 1e9
                    recv = (
                        b.cpu_s() - b_cpu
                        if path.startswith("FetchFromPeer")
                        else time.process_time() - me
                    )
                    cell.gbps.append(gb / wall)
                    cell.blocks_s.append(len(hashes) / wall)
                    cell.serve_cpu.append((a.cpu_s() - a_cpu) / gb)
                    cell.recv_cpu.append(recv / gb)
            if na is not None and nb is not None:
                wall = await raw_tcp_s(na, nb, total)
                if r > 0:
                    raw.gbps.append(total / 1e9 / wall)
    finally:
        for a, b in pairs.values():
            for d in (a, b):
                await d.channel.close()
                d.proc.terminate()
            await asyncio.gather(a.proc.wait(), b.proc.wait())
        certs.cleanup()
        if lab is not None:
            lab.down()

    where = (
        f"; A and B in network namespaces {na.address} and {nb.address} on a bridge (veth)"
        if na and nb
        else "; loopback"
    )
    print(
        f"\n{args.total_mib} MiB per cell, median of {args.repeats} round-robin repeats{where}"
        f" (fill of A took {fill_s:.1f} s); {os.cpu_count()} CPUs, Python"
        f" {sys.version.split()[0]}, grpcio {grpc.__version__}, data plane checksum"
        f" {preferred_algo().name.lower()}\n"
    )
    print(
        "| path | block | blocks/s (median) | GB/s (median) | GB/s (max) | x GetBlocks"
        " | serving CPU s/GB | receiving CPU s/GB |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for size in SIZES:
        base = statistics.median(cells["gRPC GetBlocks", "plaintext", size].gbps)
        for mode in modes:
            for path in PATHS:
                if (path, mode, size) not in cells:
                    continue
                c = cells[path, mode, size]
                med = statistics.median(c.gbps)
                name = path if mode == "plaintext" else f"{path}, {mode}"
                print(
                    f"| {name} | {_size(size)} | {statistics.median(c.blocks_s):,.0f}"
                    f" | {med:.2f} | {max(c.gbps):.2f} | {med / base:.2f}"
                    f" | {statistics.median(c.serve_cpu):.2f}"
                    f" | {statistics.median(c.recv_cpu):.2f} |"
                )
    if raw.gbps:
        print(
            f"| {RAW}, A's namespace to B's | stream | - | {statistics.median(raw.gbps):.2f}"
            f" | {max(raw.gbps):.2f} | - | - | - |"
        )
    if not args.tls:
        return
    print(
        "\n| path | block | plaintext GB/s | mTLS GB/s | mTLS / plaintext (median)"
        " | per-repeat ratios | serving CPU s/GB plain / mTLS | receiving CPU s/GB plain / mTLS |"
    )
    print("|---|---|---|---|---|---|---|---|")
    rows = (
        (PATHS[0], MTLS),
        (PATHS[0], MTLS_AUTH),
        (PATHS[0], MTLS_AUTH_EACH),
        (PATHS[0], MTLS_CONTROL),
        (PATHS[1], MTLS),
    )
    for path, mode in rows:
        for size in SIZES:
            p, t = cells[path, "plaintext", size], cells[path, mode, size]
            ratios = [tt / pp for pp, tt in zip(p.gbps, t.gbps, strict=True)]
            name = path if mode == MTLS else f"{path}, {mode}"
            print(
                f"| {name} | {_size(size)} | {statistics.median(p.gbps):.2f}"
                f" | {statistics.median(t.gbps):.2f}"
                f" | {statistics.median(t.gbps) / statistics.median(p.gbps):.2f}"
                f" | {', '.join(f'{x:.2f}' for x in ratios)}"
                f" | {statistics.median(p.serve_cpu):.2f} / {statistics.median(t.serve_cpu):.2f}"
                f" | {statistics.median(p.recv_cpu):.2f} / {statistics.median(t.recv_cpu):.2f} |"
            )
    # The data plane's own cost in auth mode: against the pair whose control plane is the same
    # (mutual TLS) and whose data plane has no TLS at all.
    print(
        "\n| data plane | block | GB/s | plain data plane GB/s | / plain (median) | per-repeat ratios |"
    )
    print("|---|---|---|---|---|---|")
    for mode in (MTLS_AUTH, MTLS_AUTH_EACH, MTLS):
        for size in SIZES:
            p, t = cells[PATHS[0], MTLS_CONTROL, size], cells[PATHS[0], mode, size]
            ratios = [tt / pp for pp, tt in zip(p.gbps, t.gbps, strict=True)]
            print(
                f"| {mode} | {_size(size)} | {statistics.median(t.gbps):.2f}"
                f" | {statistics.median(p.gbps):.2f}"
                f" | {statistics.median(t.gbps) / statistics.median(p.gbps):.2f}"
                f" | {', '.join(f'{x:.2f}' for x in ratios)} |"
            )


def _size(size: int) -> str:
    return f"{size // KiB} KiB" if size < MiB else f"{size // MiB} MiB"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--total-mib", type=int, default=128, help="payload per cell (MiB)")
    parser.add_argument("--repeats", type=int, default=3, help="round-robin repeats")
    parser.add_argument(
        "--tls", action="store_true", help="also a pair of daemons on mutual TLS, side by side"
    )
    parser.add_argument(
        "--netns",
        action="store_true",
        help="A and B in network namespaces of their own, across veth links (root)",
    )
    asyncio.run(_main(parser.parse_args()))


if __name__ == "__main__":
    main()
