"""The load of ``kvmesh bench streams``: N concurrent token-id streams, straight to workers
(``--target direct``, round robin over ``--address a,b,...``) or through a router (``--target
router``), over several channels (as many clients would be). Writes TTFT / inter-token latency
percentiles, the peak number of streams in flight, and counts to ``--out`` (JSON)."""

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


async def run(a: argparse.Namespace) -> dict[str, object]:
    addresses = a.address.split(",")
    channels = [grpc.aio.insecure_channel(addresses[i % len(addresses)]) for i in range(CHANNELS)]
    sampling = common_pb2.SamplingParams(max_tokens=a.max_tokens, ignore_eos=True)
    ttfts: list[float] = []
    itls: list[float] = []
    failed: list[str] = []
    in_flight = peak = tokens = 0
    placed: dict[str, int] = {}  # router runs: streams per worker (from the final usage)

    async def one(i: int) -> None:
        nonlocal in_flight, peak, tokens
        await asyncio.sleep(RAMP_S * i / a.streams)
        prompt = [50 + (i * 7) % 900, 50 + (i * 13) % 900, *range(100, 100 + a.prompt_tokens - 2)]
        channel = channels[i % CHANNELS]
        if a.target == "router":
            call = router_pb2_grpc.RouterStub(channel).Generate(
                router_pb2.GenerateRequest(
                    request_id=f"s{i}", sampling=sampling, token_ids=router_pb2.TokenIds(ids=prompt)
                ),
                timeout=600,
            )
        else:
            call = worker_pb2_grpc.WorkerStub(channel).Generate(
                worker_pb2.WorkerGenerateRequest(
                    request_id=f"s{i}", prompt_token_ids=prompt, sampling=sampling
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
        except grpc.aio.AioRpcError as exc:
            failed.append(f"{exc.code().name}: {exc.details()}")
        finally:
            in_flight -= 1

    started = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(a.streams)))
    duration = time.perf_counter() - started
    for c in channels:
        await c.close()

    def ms(values: list[float], q: float) -> float:
        return 1000 * float(np.percentile(values, q)) if values else 0.0

    return {
        "requests": a.streams,
        "completed": a.streams - len(failed),
        "failed": len(failed),
        "errors": sorted(set(failed))[:5],
        "peak_concurrent": peak,
        "tokens": tokens,
        "duration_s": duration,
        "tokens_per_s": tokens / duration,
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
    p.add_argument("--out", type=Path, required=True)
    a = p.parse_args(argv)
    result = asyncio.run(run(a))
    a.out.write_text(json.dumps(result))
    if result["errors"]:
        print("errors:", result["errors"], file=sys.stderr)


if __name__ == "__main__":
    main(sys.argv[1:])
