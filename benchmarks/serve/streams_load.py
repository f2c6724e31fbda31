"""The load of ``kvmesh bench streams`` and ``kvmesh bench router-scale``: N concurrent token-id
streams, straight to workers (``--target direct``, round robin over ``--address a,b,...``) or
through a router (``--target router``), over several client connections (as many clients would
be: each channel has its own subchannel pool, so each is a TCP connection of its own and a
router running several processes on one port gets them spread by the kernel). With
``--duration-s`` each stream is a closed loop that sends its next request as soon as the last
ends, until the time is up (throughput); without, each stream sends one request. Writes TTFT /
inter-token latency percentiles, the peak number of streams in flight, and counts to ``--out``
(JSON)."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

import grpc
import numpy as np

from kvmesh.v1 import common_pb2, router_pb2, router_pb2_grpc, worker_pb2, worker_pb2_grpc

CHANNELS = 32  # client connections the streams are spread over
RAMP_S = 2.0  # streams start evenly over this long
# Without it gRPC shares one subchannel (one TCP connection) among channels to the same address.
CHANNEL_OPTIONS = (("grpc.use_local_subchannel_pool", 1),)


async def run(a: argparse.Namespace) -> dict[str, object]:
    addresses = a.address.split(",")
    channels = [
        grpc.aio.insecure_channel(addresses[i % len(addresses)], options=CHANNEL_OPTIONS)
        for i in range(CHANNELS)
    ]
    sampling = common_pb2.SamplingParams(max_tokens=a.max_tokens, ignore_eos=True)
    ttfts: list[float] = []
    itls: list[float] = []
    failed: list[str] = []
    in_flight = peak = tokens = 0
    placed: dict[str, int] = {}  # router runs: streams per worker (from the final usage)

    completed = 0
    done_at: list[float] = []  # when each request ended
    deadline = 0.0  # closed loop (--duration-s): no request starts after it

    async def one(i: int, n: int = 0) -> None:
        nonlocal in_flight, peak, tokens, completed
        # Request n of stream i: a prompt of its own (two leading ids vary with it).
        k = i + n * a.streams
        prompt = [50 + (k * 7) % 900, 50 + (k * 13) % 900, *range(100, 100 + a.prompt_tokens - 2)]
        channel = channels[i % CHANNELS]
        if a.target == "router":
            call = router_pb2_grpc.RouterStub(channel).Generate(
                router_pb2.GenerateRequest(
                    request_id=f"s{i}-{n}",
                    sampling=sampling,
                    token_ids=router_pb2.TokenIds(ids=prompt),
                ),
                timeout=600,
            )
        else:
            call = worker_pb2_grpc.WorkerStub(channel).Generate(
                worker_pb2.WorkerGenerateRequest(
                    request_id=f"s{i}-{n}", prompt_token_ids=prompt, sampling=sampling
                ),
                timeout=600,
            )
        in_flight += 1
        peak = max(peak, in_flight)
        start = last = time.perf_counter()
        got = 0
        try:
            async for msg in call:
                if a.target == "router" and msg.HasField("finished"):
                    wid = msg.finished.usage.worker_id
                    placed[wid] = placed.get(wid, 0) + 1
                if not msg.token_ids:
                    continue
                now = time.perf_counter()
                if got == 0:
                    ttfts.append(now - start)
                else:
                    itls.append((now - last) / len(msg.token_ids))
                last = now
                got += len(msg.token_ids)
            tokens += got
            completed += 1
            done_at.append(time.perf_counter())
        except grpc.aio.AioRpcError as exc:
            failed.append(f"{exc.code().name}: {exc.details()}")
        finally:
            in_flight -= 1

    async def stream(i: int) -> None:
        await asyncio.sleep(RAMP_S * i / a.streams)
        await one(i)
        n = 1
        while time.perf_counter() < deadline:
            await one(i, n)
            n += 1

    started = time.perf_counter()
    deadline = started + RAMP_S + a.duration_s if a.duration_s > 0 else 0.0
    await asyncio.gather(*(stream(i) for i in range(a.streams)))
    duration = time.perf_counter() - started
    for c in channels:
        await c.close()

    def ms(values: list[float], q: float) -> float:
        return 1000 * float(np.percentile(values, q)) if values else 0.0

    return {
        "requests": completed + len(failed),
        "completed": completed,
        "failed": len(failed),
        "errors": sorted(set(failed))[:5],
        "peak_concurrent": peak,
        "tokens": tokens,
        "duration_s": duration,
        "tokens_per_s": tokens / duration,
        "requests_per_s": completed / duration,
        # closed loop: requests ended between the ramp's end and the deadline, per second
        "steady_requests_per_s": (
            sum(started + RAMP_S <= t <= deadline for t in done_at) / a.duration_s
            if a.duration_s > 0
            else 0.0
        ),
        "ttft_p50_ms": ms(ttfts, 50),
        "ttft_p99_ms": ms(ttfts, 99),
        "itl_p50_ms": ms(itls, 50),
        "itl_p99_ms": ms(itls, 99),
        # direct: exactly round robin; router: what its placement did
        "per_worker_max": max(placed.values()) if placed else -(-a.streams // len(addresses)),
        "per_worker_min": min(placed.values()) if placed else a.streams // len(addresses),
    }


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(prog="streams_load")
    p.add_argument("--target", choices=["direct", "router"], required=True)
    p.add_argument("--address", required=True, help="host:port (direct: comma-separated workers)")
    p.add_argument("--streams", type=int, required=True)
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument(
        "--duration-s",
        type=float,
        default=0.0,
        help="closed loop: each stream sends requests back to back for this long after the "
        "ramp (0: one request per stream)",
    )
    p.add_argument("--out", type=Path, required=True)
    a = p.parse_args(argv)
    result = asyncio.run(run(a))
    a.out.write_text(json.dumps(result))
    if result["errors"]:
        print("errors:", result["errors"], file=sys.stderr)


if __name__ == "__main__":
    main(sys.argv[1:])
