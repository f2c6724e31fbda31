"""The hand-off on real vLLM (CPU, the tiny model): a 1 prefill + 1 decode mesh
(``kvmesh.launcher.Mesh``, the node kvmanager between them, router ``--disagg-threshold-tokens``
small). For each of N long prompts, one at a time:

- TTFT through the router (client side, to the first chunk with tokens);
- the prefill call's duration: the router's ``kvmesh_router_prefill_seconds`` (its /metrics, the
  ``metrics=`` URL of its ready line), the histogram sum's increase over that request;
- the rest, TTFT minus prefill: the decode worker's wait for the saved blocks, their load from
  the kvmanager into its KV cache, its compute of the last token, and the router's two calls.
  The connector does not time the load separately, so this is the hand-off's upper bound;
- per block: the rest over the handed-over blocks (the decode worker's cached prompt tokens);
- the same, overlapped (the router's default: the decode request sent with the prefill, its
  worker fetching blocks as they are saved) and sequential (a second router on the same mesh
  with ``--no-disagg-overlap``: the decode request only after the prefill call returned). The
  prefill call and hand-off columns are the sequential case's (an overlapped prefill call is
  cancelled once the decode worker's first token comes, so it is often not timed);
- aggregated: as many other prompts of the same length through a third router on the same mesh
  with ``--no-disagg`` (served whole on the decode worker), alternating with the disaggregated
  ones. Distinct prompts, so no case hits another's cache.
"""

from __future__ import annotations

import asyncio
import random
import re
import statistics
import tempfile
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

BLOCK = 32


@dataclass(frozen=True, slots=True)
class HandoffConfig:
    prompts: int = 6  # per case
    prompt_tokens: int = 1800  # max_model_len is 2048
    max_tokens: int = 4
    threshold_tokens: int = 256


def prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(5, 1000) for _ in range(n)]


_SUM = re.compile(r"^kvmesh_router_prefill_seconds_sum\{[^}]*\}\s+(\S+)$", re.M)


def prefill_seconds_sum(metrics_text: str) -> float:
    """The sum of ``kvmesh_router_prefill_seconds`` over its label sets (0 when absent)."""
    return sum(float(x) for x in _SUM.findall(metrics_text))


def _scrape(url: str) -> float:
    with urllib.request.urlopen(url, timeout=5) as r:
        return prefill_seconds_sum(r.read().decode())


def summarize(rows: list[dict[str, float]]) -> dict[str, float]:
    """Medians of per-prompt figures."""
    return {k: statistics.median(r[k] for r in rows) for k in rows[0]}


def _metrics_url(ready: dict[str, str]) -> str:
    url = ready["metrics"]
    return url if url.endswith("/metrics") else url + "/metrics"


async def _disagg_one(client, metrics_url: str, seed: int, cfg: HandoffConfig) -> dict[str, float]:  # type: ignore[no-untyped-def]
    from kvmesh.client import make_request

    before = await asyncio.to_thread(_scrape, metrics_url)
    req = make_request(prompt(seed, cfg.prompt_tokens), max_tokens=cfg.max_tokens, temperature=0.0)
    c = await client.complete(req, 120)
    pre = await asyncio.to_thread(_scrape, metrics_url) - before
    ttft = c.first_chunk_s or 0.0
    blocks = (c.usage.cached_prompt_tokens if c.usage else 0) // BLOCK
    rest = ttft - pre
    return {
        "ttft_ms": ttft * 1e3,
        "prefill_ms": pre * 1e3,
        "rest_ms": rest * 1e3,
        "blocks": blocks,
        "rest_per_block_ms": rest * 1e3 / blocks if blocks else 0.0,
        "rest_share": rest / ttft if ttft else 0.0,
    }


async def _measure(cfg: HandoffConfig, routers: dict[str, dict[str, str]], log):  # type: ignore[no-untyped-def]
    """Per prompt index, round-robin: overlapped disagg, sequential disagg, aggregated, each
    with its own prompt (so none hits another's cache)."""
    from kvmesh.client import RouterClient, make_request

    rows: dict[str, list[dict[str, float]]] = {"overlapped": [], "sequential": [], "aggregated": []}
    clients = {name: RouterClient(r["address"]) for name, r in routers.items()}
    try:
        for c in clients.values():
            await c.__aenter__()
            await c.wait_for_models(60)
        for seed, c in enumerate(clients.values(), start=1):  # first-call costs out of the figures
            await c.complete(make_request(prompt(seed, cfg.prompt_tokens), max_tokens=2), 120)
        for i in range(cfg.prompts):
            for k, name in enumerate(("overlapped", "sequential")):
                got = await _disagg_one(
                    clients[name], _metrics_url(routers[name]), 100 * (k + 1) + i, cfg
                )
                rows[name].append(got)
                log(f"handoff {name} {i}: {got}")
            req = make_request(
                prompt(300 + i, cfg.prompt_tokens), max_tokens=cfg.max_tokens, temperature=0.0
            )
            a = await clients["aggregated"].complete(req, 120)
            rows["aggregated"].append({"ttft_ms": (a.first_chunk_s or 0.0) * 1e3})
            log(f"handoff aggregated {i}: {rows['aggregated'][-1]}")
    finally:
        for c in clients.values():
            await c.__aexit__(None, None, None)
    return rows


def run(cfg: HandoffConfig, log: Callable[[str], None]) -> list[dict[str, object]]:
    from kvmesh.launcher import Mesh, MeshSpec, stop_child
    from kvmesh.models import model_cache_root
    from kvmesh.models.tiny import ensure_tiny

    t0 = time.perf_counter()
    model = ensure_tiny(model_cache_root())
    threshold = ("--disagg-threshold-tokens", str(cfg.threshold_tokens))
    spec = MeshSpec(
        model_path=model,
        served_model_name="tiny",
        workers=0,
        prefill_workers=1,
        decode_workers=1,
        max_model_len=2048,
        kv_cache_bytes=64 << 20,
        log_dir=Path(tempfile.mkdtemp(prefix="kvmesh-bench-disagg-")),
        router_args=threshold,  # overlapped hand-off: the router's default
    )
    with Mesh(spec) as mesh:
        seq_router = mesh.start_router("router-seq", (*threshold, "--no-disagg-overlap"))
        agg_router = mesh.start_router("router-agg", ("--no-disagg",))
        try:
            mesh.wait_ready(seq_router, 60.0)
            mesh.wait_ready(agg_router, 60.0)
            assert mesh.router is not None  # Mesh.__enter__ started it
            log(f"handoff: mesh up in {time.perf_counter() - t0:.0f} s (logs {spec.log_dir})")
            rows = asyncio.run(
                _measure(
                    cfg,
                    {
                        "overlapped": mesh.router.ready,
                        "sequential": seq_router.ready,
                        "aggregated": agg_router.ready,
                    },
                    log,
                )
            )
        finally:
            stop_child(seq_router, grace_s=10.0)
            stop_child(agg_router, grace_s=10.0)
    ov, sq, ag = (summarize(rows[k]) for k in ("overlapped", "sequential", "aggregated"))
    return [
        {
            "part": "handoff",
            "prompt_tokens": cfg.prompt_tokens,
            "prompts": cfg.prompts,
            "blocks": sq["blocks"],
            "overlapped_blocks": ov["blocks"],
            "disagg_ttft_ms": sq["ttft_ms"],
            "prefill_ms": sq["prefill_ms"],
            "handoff_ms": sq["rest_ms"],
            "handoff_per_block_ms": sq["rest_per_block_ms"],
            "handoff_share_of_ttft": sq["rest_share"],
            "overlapped_ttft_ms": ov["ttft_ms"],
            "overlapped_over_sequential_ttft": ov["ttft_ms"] / sq["ttft_ms"]
            if sq["ttft_ms"]
            else None,
            "aggregated_ttft_ms": ag["ttft_ms"],
            "wall_s": time.perf_counter() - t0,
        }
    ]


def format_table(rows: list[dict[str, object]]) -> str:
    head = (
        "| prompt tokens | blocks handed over | sequential disagg TTFT ms | prefill call ms "
        "| hand-off + decode first token ms | per block ms | share of TTFT "
        "| overlapped disagg TTFT ms | overlapped / sequential | aggregated TTFT ms |\n"
        "|---|---|---|---|---|---|---|---|---|---|"
    )
    out = [head]
    for r in rows:
        ratio = r["overlapped_over_sequential_ttft"]
        out.append(
            f"| {r['prompt_tokens']} | {r['blocks']:.0f} | {r['disagg_ttft_ms']:.0f} "
            f"| {r['prefill_ms']:.0f} | {r['handoff_ms']:.0f} | {r['handoff_per_block_ms']:.2f} "
            f"| {r['handoff_share_of_ttft']:.0%} | {r['overlapped_ttft_ms']:.0f} "
            f"| {f'{ratio:.2f}x' if isinstance(ratio, float) else '-'} "
            f"| {r['aggregated_ttft_ms']:.0f} |"
        )
    return "\n".join(out)
