"""Router overhead and start-up time, measured side by side in one run.

    .venv/bin/python benchmarks/router_overhead.py [--model tiny|smollm2|DIR] [--requests 20]

Starts a real mesh (local etcd, one vLLM worker, one router; processes as in production), then
sends the same kind of request alternately straight to the worker (Worker.Generate with token
ids) and through the router (Router.Generate with the same token ids). Every request gets a
fresh prompt of the same length (a unique first token), so neither path profits from the other's
prefix cache. Prints a markdown table: TTFT and decode tokens/s per path (median and p90) and the
router/direct ratios, plus the time from `kvmesh up` to the first answer.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvmesh.client import RouterClient, make_request
from kvmesh.launcher import Mesh, MeshSpec
from kvmesh.models import resolve_model
from kvmesh.v1 import common_pb2, worker_pb2, worker_pb2_grpc


def prompt(i: int, length: int, vocab: int) -> list[int]:
    return [(i * 7919) % (vocab - 10) + 5] + [
        (j * 31 + 17) % (vocab - 10) + 5 for j in range(length - 1)
    ]


async def direct(
    stub: worker_pb2_grpc.WorkerStub, ids: list[int], max_tokens: int
) -> tuple[float, float]:
    req = worker_pb2.WorkerGenerateRequest(
        request_id=f"direct-{time.monotonic_ns()}",
        prompt_token_ids=ids,
        sampling=common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
    )
    start = time.monotonic()
    first = None
    n = 0
    async for msg in stub.Generate(req, timeout=300):
        if msg.token_ids and first is None:
            first = time.monotonic()
        n += len(msg.token_ids)
    end = time.monotonic()
    assert first is not None and n == max_tokens
    return first - start, (n - 1) / max(end - first, 1e-9)


async def routed(client: RouterClient, ids: list[int], max_tokens: int) -> tuple[float, float]:
    start = time.monotonic()
    c = await client.complete(
        make_request(ids, max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    )
    end = start + c.total_s
    assert c.first_chunk_s is not None and len(c.token_ids) == max_tokens
    first = start + c.first_chunk_s
    return first - start, (len(c.token_ids) - 1) / max(end - first, 1e-9)


def p(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


async def measure(
    mesh: Mesh, args: argparse.Namespace, vocab: int
) -> dict[str, list[tuple[float, float]]]:
    results: dict[str, list[tuple[float, float]]] = {"direct": [], "router": []}
    async with (
        RouterClient(mesh.router_address) as client,
        grpc.aio.insecure_channel(mesh.workers[0].ready["address"]) as ch,
    ):
        stub = worker_pb2_grpc.WorkerStub(ch)
        await routed(client, prompt(10_000, args.prompt_tokens, vocab), args.max_tokens)  # warm-up
        await direct(stub, prompt(10_001, args.prompt_tokens, vocab), args.max_tokens)
        for i in range(args.requests):
            order = ("direct", "router") if i % 2 == 0 else ("router", "direct")
            for j, path in enumerate(order):
                ids = prompt(2 * i + j, args.prompt_tokens, vocab)
                if path == "direct":
                    results[path].append(await direct(stub, ids, args.max_tokens))
                else:
                    results[path].append(await routed(client, ids, args.max_tokens))
    return results


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--requests", type=int, default=20, help="requests per path")
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--max-tokens", type=int, default=64)
    args = ap.parse_args()
    model = resolve_model(args.model)
    import json

    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    t0 = time.monotonic()
    with Mesh(
        MeshSpec(
            model_path=model, workers=1, log_dir=Path(tempfile.mkdtemp(prefix="kvmesh-bench-"))
        )
    ) as mesh:
        ready_s = time.monotonic() - t0

        async def first_answer() -> float:
            async with RouterClient(mesh.router_address) as client:
                await client.wait_for_models()
                await client.complete(make_request("Hello", chat=True, max_tokens=8))
            return time.monotonic() - t0

        startup_s = asyncio.run(first_answer())
        res = asyncio.run(measure(mesh, args, vocab))

    def row(name: str) -> tuple[float, float, float, float]:
        ttft = [r[0] * 1000 for r in res[name]]
        tps = [r[1] for r in res[name]]
        return statistics.median(ttft), p(ttft, 0.9), statistics.median(tps), p(tps, 0.1)

    d, r = row("direct"), row("router")
    print(
        f"model={model.name} prompt_tokens={args.prompt_tokens} max_tokens={args.max_tokens} requests/path={args.requests}, alternating, one worker, CPU"
    )
    print()
    print("| path | TTFT p50 (ms) | TTFT p90 (ms) | decode tok/s p50 | decode tok/s p10 |")
    print("|---|---|---|---|---|")
    print(f"| worker direct | {d[0]:.1f} | {d[1]:.1f} | {d[2]:.1f} | {d[3]:.1f} |")
    print(f"| through router | {r[0]:.1f} | {r[1]:.1f} | {r[2]:.1f} | {r[3]:.1f} |")
    print(
        f"| router / direct | {r[0] / d[0]:.3f} | {r[1] / d[1]:.3f} | {r[2] / d[2]:.3f} | {r[3] / d[3]:.3f} |"
    )
    print()
    print(
        f"start-up: mesh ready (etcd + worker + router) {ready_s:.1f} s; first answer {startup_s:.1f} s after start"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
