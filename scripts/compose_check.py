"""The checks scripts/compose-test.sh runs against a mesh started from docker/docker-compose.yml.

  python scripts/compose_check.py requests --router 127.0.0.1:50051 --http 127.0.0.1:8000
      (on the host, kvmesh and the openai SDK importable): a streamed gRPC Generate through the
      router, then an OpenAI chat completion with the openai SDK, then the same again: the repeat
      must report cached prompt tokens. Prints one JSON line of figures.
  python3 - kv-info 127.0.0.1:50071 < scripts/compose_check.py
      (inside the kvmanager's container: its port is not published): GetInfo, one JSON line with
      each tier's blocks and bytes and the process epoch.

Exit status 0 when every check held; else 1 with the reason on stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from typing import Any

# A prompt of several whole KV blocks (32 tokens each on CPU), so that a repeat can hit them.
PROMPT = (
    "kvmesh compose check. The router keeps an index of which worker and which kvmanager holds "
    "each block of every prompt, so a request that repeats a long prefix lands where the prefix "
    "already is and skips its prefill. This paragraph is long on purpose: it spans several "
    "blocks of thirty-two tokens, which is the granularity at which the engine caches and "
    "the kvmanager stores the attention keys and values of a prompt. Question number "
)


def fail(message: str) -> None:
    print(f"compose_check: FAILED: {message}", file=sys.stderr)
    raise SystemExit(1)


async def grpc_stream(
    router: str, model: str, prompt: str | list[int], timeout_s: float
) -> dict[str, Any]:
    from kvmesh.client import RouterClient, make_request

    async with RouterClient(router) as client:
        models = await client.wait_for_models(timeout_s=timeout_s)
        names = [m.name for m in models.models]
        if model not in names:
            fail(f"router serves {names}, not {model!r}")
        c = await client.complete(
            make_request(prompt, chat=True, max_tokens=16, model=model, temperature=0.0),
            timeout_s=timeout_s,
        )
    if c.usage is None:
        fail("the gRPC stream ended without its final chunk")
    assert c.usage is not None
    if c.chunks < 2 or not c.token_ids:
        fail(f"the gRPC answer did not stream: {c.chunks} chunks, {len(c.token_ids)} tokens")
    return {
        "chunks": c.chunks,
        "tokens": len(c.token_ids),
        "prompt_tokens": c.usage.prompt_tokens,
        "cached_tokens": c.usage.cached_prompt_tokens,
        # where the cached tokens' KV came from: the engine's own cache, the node kvmanager's
        # CPU tier, its disk tier
        "cached_gpu_cpu_disk": [
            c.usage.cached_gpu_tokens,
            c.usage.cached_cpu_tokens,
            c.usage.cached_disk_tokens,
        ],
        "worker": c.usage.worker_id,
        "first_chunk_ms": round((c.first_chunk_s or 0.0) * 1000),
        "total_ms": round(c.total_s * 1000),
        "finish": c.finish_reason,
    }


def openai_chat(http: str, model: str, prompt: str, timeout_s: float) -> dict[str, Any]:
    import openai

    client = openai.OpenAI(base_url=f"http://{http}/v1", api_key="unused", timeout=timeout_s)
    start = time.monotonic()
    r = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": prompt}],
        max_tokens=8,
        temperature=0.0,
    )
    elapsed = time.monotonic() - start
    if not r.choices or r.usage is None:
        fail(f"OpenAI answer without choices or usage: {r}")
    assert r.usage is not None
    details = r.usage.prompt_tokens_details
    return {
        "prompt_tokens": r.usage.prompt_tokens,
        "completion_tokens": r.usage.completion_tokens,
        "cached_tokens": (details.cached_tokens or 0) if details is not None else 0,
        "finish": r.choices[0].finish_reason,
        "total_ms": round(elapsed * 1000),
    }


def cmd_requests(a: argparse.Namespace) -> None:
    prompt = PROMPT + a.tag
    out: dict[str, Any] = {}
    out["grpc"] = asyncio.run(grpc_stream(a.router, a.model, prompt + " (gRPC)", a.timeout_s))
    out["grpc_repeat"] = asyncio.run(
        grpc_stream(a.router, a.model, prompt + " (gRPC)", a.timeout_s)
    )
    out["openai"] = openai_chat(a.http, a.model, prompt + " (OpenAI)", a.timeout_s)
    out["openai_repeat"] = openai_chat(a.http, a.model, prompt + " (OpenAI)", a.timeout_s)
    if a.pd_tokens:
        # Long and uncached: the router prefills it on prefill-0, which saves its KV to the
        # kvmanager, and decode-0 loads it from there (docs/disaggregation.md).
        long = " ".join(f"{PROMPT}{a.tag}.{i}" for i in range(a.pd_tokens // 150 + 1))
        out["pd"] = asyncio.run(grpc_stream(a.router, a.model, long, a.timeout_s))
    print(json.dumps(out))
    if a.pd_tokens:
        _, cpu, disk = out["pd"]["cached_gpu_cpu_disk"]
        if out["pd"]["prompt_tokens"] < a.pd_tokens or cpu + disk < a.pd_tokens - 64:
            fail(f"pd: the long prompt's KV did not come through the kvmanager: {out['pd']}")
    if out["grpc"]["cached_gpu_cpu_disk"][2] < a.min_disk_first:
        fail(f"grpc: wanted >= {a.min_disk_first} tokens from the disk tier: {out['grpc']}")
    wanted = {"grpc": a.min_cached_first, "openai": a.min_cached_first}
    wanted |= {"grpc_repeat": a.min_cached, "openai_repeat": a.min_cached}
    for name, least in wanted.items():
        if out[name]["cached_tokens"] < least:
            fail(f"{name}: {out[name]['cached_tokens']} cached tokens, wanted >= {least}")


def cmd_kv_info(a: argparse.Namespace) -> None:
    import grpc

    from kvmesh.v1 import kvmanager_pb2, kvmanager_pb2_grpc, worker_pb2

    with grpc.insecure_channel(a.address) as channel:
        info = kvmanager_pb2_grpc.KvManagerStub(channel).GetInfo(
            kvmanager_pb2.KvManagerInfoRequest(), timeout=a.timeout_s
        )
    tiers = {
        worker_pb2.KvTier.Name(t.tier): {"blocks": t.blocks, "used_bytes": t.used_bytes}
        for t in info.tiers
    }
    print(json.dumps({"kvmanager": info.kvmanager_id, "epoch": info.epoch, "tiers": tiers}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    r = sub.add_parser("requests")
    r.add_argument("--router", default="127.0.0.1:50051")
    r.add_argument("--http", default="127.0.0.1:8000")
    r.add_argument("--model", default="tiny")
    r.add_argument("--tag", default="1", help="makes this round's prompts differ from others'")
    r.add_argument("--min-cached", type=int, default=32, help="cached tokens a repeat must report")
    r.add_argument("--min-cached-first", type=int, default=0, help="... and the first of each pair")
    r.add_argument(
        "--min-disk-first", type=int, default=0, help="tokens the first gRPC call loads from disk"
    )
    r.add_argument(
        "--pd-tokens", type=int, default=0, help="also a prompt this long, prefill/decode split"
    )
    r.add_argument("--timeout-s", type=float, default=300.0)
    r.set_defaults(func=cmd_requests)
    k = sub.add_parser("kv-info")
    k.add_argument("address")
    k.add_argument("--timeout-s", type=float, default=10.0)
    k.set_defaults(func=cmd_kv_info)
    a = parser.parse_args()
    a.func(a)


if __name__ == "__main__":
    main()
