"""vLLM's benchmark load, sent to kvmesh's gRPC API instead of an HTTP endpoint.

    python -m benchmarks.serve.grpc_load --router HOST:PORT [vllm bench serve flags ...]

Takes ``vllm bench serve``'s own flags (parsed by vLLM's parser) and draws the requests with
vLLM's own dataset code (``get_samples``, same seed), so the request mix is exactly the one the
HTTP runs get; arrivals follow vLLM's own ``get_request`` (Poisson at ``--request-rate``, capped
by ``--max-concurrency``). Each request is ``Router.Generate`` with the prompt text, ``max_tokens``
the expected output length and ``ignore_eos`` as asked. Writes the result JSON with the metric
names ``vllm bench serve --save-result`` uses (the subset this table reads).
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from kvmesh.client import make_request
from kvmesh.v1 import router_pb2_grpc


@dataclass(slots=True)
class Outcome:
    ok: bool = False
    ttft_s: float = 0.0
    latency_s: float = 0.0
    output_tokens: int = 0
    itl_s: list[float] = field(default_factory=list)
    error: str = ""


async def _one(
    stub: router_pb2_grpc.RouterStub,
    prompt: str,
    output_len: int,
    model: str,
    ignore_eos: bool,
    timeout_s: float,
) -> Outcome:
    out = Outcome()
    req = make_request(prompt, max_tokens=output_len, model=model, ignore_eos=ignore_eos)
    start = time.perf_counter()
    last = start
    try:
        async for msg in stub.Generate(req, timeout=timeout_s):
            if not msg.token_ids:
                continue
            now = time.perf_counter()
            if out.output_tokens == 0:
                out.ttft_s = now - start
            else:
                out.itl_s.append(now - last)
            last = now
            out.output_tokens += len(msg.token_ids)
        out.latency_s = time.perf_counter() - start
        out.ok = out.output_tokens > 0
    except grpc.aio.AioRpcError as exc:
        out.error = f"{exc.code().name}: {exc.details()}"
    return out


def _ms(values: list[float], q: float | None = None) -> float:
    if not values:
        return 0.0
    if q is None:
        return 1000 * statistics.fmean(values)
    return 1000 * float(np.percentile(values, q))


def metrics(outcomes: list[Outcome], duration_s: float) -> dict[str, Any]:
    """The ``vllm bench serve`` result keys this benchmark reads, computed the same way (TPOT
    per request: (latency - ttft) / (tokens - 1), then averaged)."""
    ok = [o for o in outcomes if o.ok]
    ttfts = [o.ttft_s for o in ok]
    tpots = [(o.latency_s - o.ttft_s) / (o.output_tokens - 1) for o in ok if o.output_tokens > 1]
    itls = [x for o in ok for x in o.itl_s]
    tokens = sum(o.output_tokens for o in ok)
    return {
        "completed": len(ok),
        "failed": len(outcomes) - len(ok),
        "duration": duration_s,
        "total_output_tokens": tokens,
        "request_throughput": len(ok) / duration_s,
        "output_throughput": tokens / duration_s,
        "mean_ttft_ms": _ms(ttfts),
        "median_ttft_ms": _ms(ttfts, 50),
        "p99_ttft_ms": _ms(ttfts, 99),
        "mean_tpot_ms": _ms(tpots),
        "median_tpot_ms": _ms(tpots, 50),
        "p99_tpot_ms": _ms(tpots, 99),
        "mean_itl_ms": _ms(itls),
        "p99_itl_ms": _ms(itls, 99),
        "errors": sorted({o.error for o in outcomes if o.error})[:5],
        "ttfts": [o.ttft_s for o in outcomes],  # per request, seconds (as --save-detailed)
    }


async def drive(args: Any, samples: list[Any]) -> dict[str, Any]:
    from vllm.benchmarks.serve import get_request

    model = args.served_model_name or args.model
    timeout_s = 600.0
    async with grpc.aio.insecure_channel(args.router) as channel:
        stub = router_pb2_grpc.RouterStub(channel)
        if args.ready_check_timeout_sec > 0:
            # vLLM's "initial single prompt test run" (off by default since its ready check
            # defaults to 0 s): the first sample, not counted. Sent where vLLM sends it only,
            # since it leaves that sample's prompt in the prefix cache for the measured run.
            first = samples[0]
            probe = await _one(
                stub, first.prompt, first.expected_output_len, model, True, timeout_s
            )
            if not probe.ok:
                raise SystemExit(f"the test request failed: {probe.error}")
        limit = asyncio.Semaphore(args.max_concurrency or len(samples))

        async def limited(s: Any) -> Outcome:
            async with limit:
                return await _one(
                    stub, s.prompt, s.expected_output_len, model, args.ignore_eos, timeout_s
                )

        tasks = []
        start = time.perf_counter()
        async for sample, _delay in get_request(samples, args.request_rate, args.burstiness):
            tasks.append(asyncio.create_task(limited(sample)))
        outcomes = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    result = metrics(list(outcomes), duration)
    result.update(
        {
            "backend": "kvmesh-grpc",
            "request_rate": args.request_rate,
            "max_concurrency": args.max_concurrency,
            "num_prompts": len(samples),
        }
    )
    return result


def main(argv: list[str]) -> None:
    from vllm.benchmarks.datasets import get_samples
    from vllm.benchmarks.serve import add_cli_args
    from vllm.tokenizers import get_tokenizer
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(prog="grpc_load", description=__doc__)
    add_cli_args(parser)
    parser.add_argument("--router", required=True, help="kvmesh router gRPC host:port")
    args = parser.parse_args(argv)
    random.seed(args.seed)
    np.random.seed(args.seed)
    tokenizer = get_tokenizer(args.tokenizer or args.model, tokenizer_mode=args.tokenizer_mode)
    if args.dataset_name == "random":  # as vllm bench serve: random runs to the full length
        args.ignore_eos = True
    samples = get_samples(args, tokenizer)
    result = asyncio.run(drive(args, samples))
    out = Path(args.result_dir or ".") / (args.result_filename or "grpc_load.json")
    out.write_text(json.dumps(result))
    print(json.dumps({k: v for k, v in result.items() if k not in ("errors", "ttfts")}))
    if result["errors"]:
        print("errors:", result["errors"], file=sys.stderr)


if __name__ == "__main__":
    main(sys.argv[1:])
