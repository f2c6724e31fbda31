"""Bulk KV transfer on loopback: raw TCP (the wire), gRPC streaming, and the kvmanager data plane.

    .venv/bin/python benchmarks/kv_transfer_bench.py [--total-mib 256] [--repeats 3]

Each sender is a separate child process (as a peer kvmanager would be); this process receives.
Every cell moves ``--total-mib`` of payload; the cells run round-robin ``--repeats`` times, so
each ratio compares cells measured side by side on the same (shared, noisy) machine. Rows:

* raw TCP: ``sendall`` of one chunk in a loop / ``recv_into`` one reused buffer. No framing,
  no checksum, no allocation: the wire's ceiling on this machine. Two more raw rows receive
  each chunk into a fresh ``bytearray`` and crc32 it: the floor for any verified receiver.
* gRPC: a grpc.aio server-streaming method of raw ``bytes`` messages (identity serializers, no
  protobuf: gRPC's best case), one message per chunk, consumed with ``async for``.
* data plane: ``fetch_blocks`` from a ``DataPlaneServer``, one block per frame, every block
  received into a fresh ``bytearray`` and verified (crc32, or BLAKE3 when installed) before
  ``on_block`` gets it. The source holds each block's checksum (as the store will: it verified
  one when the block arrived); one row makes the server compute it on send instead, and the
  next rows receive each block into a new ``bytes`` (``allocate=None``, what the kvmanager's
  peer fetch did before the arena), and the last ones into slots of an ``Arena`` (what it does
  now: the store keeps the slot, no copy; dropped blocks' slots are reused, no page faults).

GB/s is payload bytes / wall time of the transfer (1 GB = 1e9 bytes), median over the repeats;
"CPU s/GB" is this (receiving) process's CPU time per GB, all threads. Prints markdown tables.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import socket
import statistics
import struct
import sys
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import grpc

from kvmesh.kv.events import BlockHash
from services.kvmanager.arena import Arena
from services.kvmanager.peer.client import FetchedBlock, fetch_blocks
from services.kvmanager.peer.core import Ticket
from services.kvmanager.peer.server import DataPlaneConfig, DataPlaneServer, PinnedBlock
from services.kvmanager.peer.wire import (
    Checksum,
    ChecksumAlgo,
    ChecksumSet,
    algo_bit,
    available_algos,
    checksum,
    preferred_algo,
)

KiB = 1 << 10
MiB = 1 << 20
_REQ = struct.Struct("<QQ")  # chunk bytes, total bytes
_GRPC_METHOD = "/kvmesh.bench.Bulk/Pull"
_GRPC_OPTIONS = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]


# ---------------------------------------------------------------------------------------------
# Senders (child processes)


def _raw_sender(ready: Connection) -> None:
    lsock = socket.create_server(("127.0.0.1", 0))
    ready.send(lsock.getsockname()[1])
    chunks: dict[int, memoryview] = {}
    while True:
        conn, _ = lsock.accept()
        chunk, total = _REQ.unpack(_recv_exact(conn, _REQ.size))
        data = chunks.setdefault(chunk, memoryview(os.urandom(chunk)))
        for _ in range(total // chunk):
            conn.sendall(data)
        conn.close()


def _recv_exact(sock: socket.socket, size: int) -> bytes:
    buf = b""
    while len(buf) < size:
        part = sock.recv(size - len(buf))
        if not part:
            raise EOFError
        buf += part
    return buf


def _grpc_sender(ready: Connection) -> None:
    async def serve() -> None:
        chunks: dict[int, bytes] = {}

        async def pull(request: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
            chunk, total = _REQ.unpack(request)
            data = chunks.setdefault(chunk, os.urandom(chunk))
            for _ in range(total // chunk):
                yield data

        handler = grpc.method_handlers_generic_handler(
            "kvmesh.bench.Bulk",
            {"Pull": grpc.unary_stream_rpc_method_handler(pull)},  # identity (de)serializers
        )
        server = grpc.aio.server(options=_GRPC_OPTIONS)
        server.add_generic_rpc_handlers((handler,))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        ready.send(port)
        await server.wait_for_termination()

    asyncio.run(serve())


class _BenchSource:
    """Block hash -> one shared random buffer of that cell's size, with stored checksums."""

    def __init__(self) -> None:
        self.sizes: dict[int, int] = {}  # hash -> block size
        self.data: dict[int, memoryview] = {}  # block size -> payload
        self.sums: dict[tuple[int, ChecksumAlgo], int] = {}

    def add(self, first_hash: int, count: int, size: int) -> list[int]:
        if size not in self.data:
            self.data[size] = memoryview(os.urandom(size))
            for algo in ChecksumAlgo:
                if algo_bit(algo) & available_algos():
                    self.sums[size, algo] = checksum(algo, self.data[size])
        hashes = list(range(first_hash, first_hash + count))
        for h in hashes:
            self.sizes[h] = size
        return hashes

    def for_algo(self, algo: ChecksumAlgo, store_checksums: bool) -> _AlgoView:
        return _AlgoView(self, algo, store_checksums)


@dataclass
class _AlgoView:
    src: _BenchSource
    algo: ChecksumAlgo
    store_checksums: bool

    async def pin(self, layout_key: str, block_hash: BlockHash) -> PinnedBlock | None:
        size = self.src.sizes.get(block_hash)
        if size is None:
            return None
        known = (
            Checksum(self.algo, self.src.sums[size, self.algo]) if self.store_checksums else None
        )
        return PinnedBlock(self.src.data[size], known)


def _dataplane_sender(ctl: Connection) -> None:
    """One server per (checksum, stored-or-computed); the parent asks for tickets over ``ctl``
    (standing in for the gRPC control plane)."""

    async def serve() -> None:
        loop = asyncio.get_running_loop()
        src = _BenchSource()
        servers: dict[tuple[ChecksumAlgo, bool], DataPlaneServer] = {}
        for algo in ChecksumAlgo:
            if algo_bit(algo) & available_algos():
                for stored in (True, False):
                    server = DataPlaneServer(
                        src.for_algo(algo, stored), DataPlaneConfig(checksum=algo)
                    )
                    await server.start()
                    servers[algo, stored] = server
        next_hash = 1
        done = loop.create_future()

        def on_request() -> None:
            nonlocal next_hash
            msg = ctl.recv()
            if msg is None:
                done.set_result(None)
                return
            algo, stored, size, count = msg
            hashes = src.add(next_hash, count, size)
            next_hash += count
            server = servers[algo, stored]
            ctl.send((server.port, server.issue_ticket("bench", hashes, ttl_s=60)))

        loop.add_reader(ctl.fileno(), on_request)
        ctl.send("ready")
        await done
        for server in servers.values():
            await server.close()

    asyncio.run(serve())


# ---------------------------------------------------------------------------------------------
# Receivers (this process)


def _raw_recv(port: int, chunk: int, total: int) -> int:
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(_REQ.pack(chunk, total))
    buf = memoryview(bytearray(chunk))
    got = 0
    while n := sock.recv_into(buf):
        got += n
    sock.close()
    return got


def _raw_recv_verified(port: int, chunk: int, total: int) -> int:
    """What any verified receiver pays before framing: each chunk into fresh memory (as a
    store keeps its blocks) with ``MSG_WAITALL``, then crc32 over it."""
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(_REQ.pack(chunk, total))
    got = 0
    for _ in range(total // chunk):
        view = memoryview(bytearray(chunk))
        n = 0
        while n < chunk:
            n += sock.recv_into(view[n:], chunk - n, socket.MSG_WAITALL) or 0
        checksum(ChecksumAlgo.CRC32, view)
        got += n
    sock.close()
    return got


async def _grpc_recv(channel: grpc.aio.Channel, chunk: int, total: int) -> int:
    call = channel.unary_stream(_GRPC_METHOD)(_REQ.pack(chunk, total), timeout=60)
    got = 0
    async for msg in call:
        got += len(msg)
    return got


async def _dataplane_recv(
    port: int, ticket: Ticket, accept: ChecksumSet, into: str = "bytearray"
) -> int:
    got = 0

    def on_block(block: FetchedBlock) -> None:
        nonlocal got
        got += block.data.nbytes

    result = await fetch_blocks(
        "127.0.0.1",
        port,
        ticket,
        on_block=on_block,
        deadline_s=60,
        accept=accept,
        allocate={"bytes": None, "bytearray": bytearray, "arena": _arena_allocate}[into],
    )
    assert result.delivered == len(ticket.hashes) and not result.missing
    return got


_ARENA: Arena | None = None


def _arena_allocate(size: int) -> memoryview | bytearray:
    """A slot of the CPU tier's arena (pre-faulted, reused once a block is dropped), as the
    kvmanager's store hands its peer fetches; a heap buffer if none is free."""
    slot = _ARENA.allocate(size) if _ARENA is not None else None
    return bytearray(size) if slot is None else memoryview(slot).cast("B")


@dataclass
class Cell:
    transport: str
    size: int
    note: str
    run: Callable[[], Awaitable[int]]
    gbps: list[float] = field(default_factory=list)
    cpu: list[float] = field(default_factory=list)


def _fmt_size(n: int) -> str:
    return f"{n // MiB} MiB" if n >= MiB else f"{n // KiB} KiB"


async def _main(args: argparse.Namespace) -> None:
    total = args.total_mib * MiB
    ctx = mp.get_context("spawn")
    procs = []

    def spawn(target: Callable[[Connection], None]) -> Connection:
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=target, args=(child,), daemon=True)
        proc.start()
        procs.append(proc)
        return parent

    raw_port = spawn(_raw_sender).recv()
    grpc_port = spawn(_grpc_sender).recv()
    ctl = spawn(_dataplane_sender)
    assert ctl.recv() == "ready"
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{grpc_port}", options=_GRPC_OPTIONS)
    await channel.channel_ready()

    def raw_cell(size: int, verified: bool = False) -> Cell:
        recv = _raw_recv_verified if verified else _raw_recv

        async def run() -> int:
            return await asyncio.to_thread(recv, raw_port, size, total)

        if verified:
            return Cell("raw TCP", size, "fresh buffer per chunk + crc32, no framing", run)
        return Cell("raw TCP", size, "no framing, no checksum", run)

    def grpc_cell(size: int) -> Cell:
        return Cell("gRPC stream", size, "bytes messages", lambda: _grpc_recv(channel, size, total))

    def dp_cell(
        size: int, algo: ChecksumAlgo, stored: bool = True, into: str = "bytearray"
    ) -> Cell:
        async def run() -> int:
            # The ticket round trip is timed too: a real fetch asks the control plane first.
            ctl.send((algo, stored, size, total // size))
            port, ticket = ctl.recv()
            return await _dataplane_recv(port, ticket, algo_bit(algo), into)

        note = f"{algo.name.lower()}" + ("" if stored else ", computed on send")
        note += {
            "bytearray": "",
            "bytes": ", received into bytes (allocate=None)",
            "arena": ", received into arena slots (the store's)",
        }[into]
        return Cell("data plane", size, note, run)

    sizes = [int(x) * KiB for x in args.sizes_kib.split(",")]
    cells = [raw_cell(s) for s in sizes]
    cells += [raw_cell(256 * KiB, verified=True), raw_cell(4 * MiB, verified=True)]
    cells += [grpc_cell(s) for s in (1 * MiB, 4 * MiB, 16 * MiB)]
    algos = [a for a in ChecksumAlgo if algo_bit(a) & available_algos()]
    for algo in algos:
        cells += [dp_cell(s, algo) for s in sizes]
    cells.append(dp_cell(4 * MiB, ChecksumAlgo.CRC32, stored=False))
    cells += [dp_cell(s, algos[-1], into="bytes") for s in (256 * KiB, 4 * MiB)]
    global _ARENA
    _ARENA = Arena(256 * MiB, populate=True)  # several windows of blocks in flight
    _ARENA.wait_populated()
    cells += [dp_cell(s, preferred_algo(), into="arena") for s in sizes]

    for cell in cells:  # warm-up: connections, allocator, page cache of the buffers
        await cell.run()
    for _ in range(args.repeats):
        for cell in cells:
            cpu0, t0 = time.process_time(), time.perf_counter()
            got = await cell.run()
            wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
            assert got == total // cell.size * cell.size, (cell.transport, got)
            cell.gbps.append(got / wall / 1e9)
            cell.cpu.append(cpu / (got / 1e9))

    ceiling = max(statistics.median(c.gbps) for c in cells if c.note.startswith("no framing"))
    print(
        f"\n{args.total_mib} MiB per cell, median of {args.repeats} round-robin repeats; "
        f"{os.cpu_count()} CPUs, Python {sys.version.split()[0]}, grpcio {grpc.__version__}\n"
    )
    print(
        "| transport | chunk/block | checksum / notes | GB/s (median) | GB/s (max) | x raw TCP | receiver CPU s/GB |"
    )
    print("|---|---|---|---|---|---|---|")
    for c in cells:
        med = statistics.median(c.gbps)
        print(
            f"| {c.transport} | {_fmt_size(c.size)} | {c.note} | {med:.2f} | {max(c.gbps):.2f} "
            f"| {med / ceiling:.2f} | {statistics.median(c.cpu):.2f} |"
        )
    print(f"\nx raw TCP: median GB/s over the best raw TCP row's median ({ceiling:.2f} GB/s).")

    await channel.close()
    ctl.send(None)
    for proc in procs:
        proc.terminate()
        proc.join(5)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--total-mib", type=int, default=256, help="payload per cell (MiB)")
    parser.add_argument("--repeats", type=int, default=3, help="round-robin repeats")
    parser.add_argument(
        "--sizes-kib", default="256,1024,4096", help="block sizes of the per-size rows, KiB"
    )
    args = parser.parse_args()
    threading.current_thread().name = "bench"
    asyncio.run(_main(args))


if __name__ == "__main__":
    main()
