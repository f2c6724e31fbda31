"""``kvmesh bench speculative``: speculative decoding on real vLLM, per method, against none.

    kvmesh bench speculative --methods none,ngram,draft_model,eagle,mtp

For each method, one vLLM engine (in this process, the worker's ``VllmEngine``, float32, the same
settings apart from ``speculative_config``) on a built-in tiny model: ``tiny`` for none, ngram
(prompt lookup), draft_model (the built-in ``tiny-draft``: the tiny model's first layer) and
eagle (the built-in ``tiny-eagle`` head); ``tiny-mtp`` (the tiny model's sizes with one
MiMo-style MTP layer) for mtp, measured against a plain run of ``tiny-mtp`` itself.

A fixed greedy workload: one warm-up request, then ``--repeats`` rounds of ``--sequential``
requests one after another and a batch of ``--concurrency`` at once (new prompts every round, so
no prefix cache hits); the prompts are code-like lines repeated three times (so prompt lookup
has n-grams to find). Prints one row per method: output tokens per second (one stream and the
batch; the median round), inter-token latency p50 / p99 over the streamed chunks (a step that
accepts drafts streams several tokens in one chunk) and per token (TPOT), the acceptance rate
(accepted / drafted tokens), the mean accepted tokens per draft, and the ratios to no
speculation on the same target model; on stderr, whether the greedy output equalled none's.

The models are tiny random-weight models: their drafts are seldom right (the MTP layer's never),
and a step of a model this small costs about what the drafting adds, so the figures say what
the machinery costs and that it works, not what speculation gains on a real model (see
BENCHMARKS.md for published figures).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

METHODS = ("none", "ngram", "draft_model", "eagle", "mtp")
TARGET = {
    "none": "tiny",
    "ngram": "tiny",
    "draft_model": "tiny",
    "eagle": "tiny",
    "mtp": "tiny-mtp",
}
DRAFT = {"draft_model": "tiny-draft", "eagle": "tiny-eagle"}
"""The built-in draft model or head of the methods that take one."""
"""The built-in target model each method runs on."""


@dataclass(frozen=True, slots=True)
class Row:
    method: str
    model: str
    requests: int
    output_tokens: int
    single_tok_s: float  # output tokens per second, one request at a time
    batch_tok_s: float  # output tokens per second, the concurrent batch
    itl_p50_ms: float  # gap between streamed chunks
    itl_p99_ms: float
    tpot_ms: float  # (last token - first token) / (tokens - 1), mean over requests
    drafted: int
    accepted: int
    drafts: int
    single_ratio: float = math.nan  # to "none" on the same model
    batch_ratio: float = math.nan
    itl_p50_ratio: float = math.nan

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else math.nan

    @property
    def accepted_per_draft(self) -> float:
        return self.accepted / self.drafts if self.drafts else math.nan


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "speculative",
        help="speculative decoding on real vLLM (tiny models): tok/s, ITL and acceptance per "
        "method against none",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(p)
    p.set_defaults(func=run)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--methods", default=",".join(METHODS), help="comma-separated, of " + ", ".join(METHODS)
    )
    p.add_argument("--num-tokens", type=int, default=3, help="tokens drafted per step (mtp: 1)")
    p.add_argument("--max-tokens", type=int, default=96, help="output tokens per request")
    p.add_argument("--sequential", type=int, default=4, help="requests one after another")
    p.add_argument("--concurrency", type=int, default=8, help="requests in the batch")
    p.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="rounds of the sequential requests and the batch per engine; tok/s is the median",
    )
    p.add_argument("--json", action="store_true", help="also print one JSON object per row")


def prompts(tokenizer_json: Path, n: int) -> list[list[int]]:
    """``n`` prompts of code-like lines, each block of lines repeated three times."""
    from tokenizers import Tokenizer

    from kvmesh.models.tiny import training_text

    tok = Tokenizer.from_file(str(tokenizer_json))
    lines = [
        line
        for line in training_text(lines=4000, seed=16)
        if line.lstrip()[:3] in ("def", "for", "if ", "ret", "x =", "y =", "n =", "i =")
    ]
    out = []
    for i in range(n):
        block = "\n".join(lines[i * 6 : i * 6 + 6]) + "\n"
        out.append(tok.encode(block * 3).ids)
    return out


def percentile(xs: Sequence[float], q: float) -> float:
    """The q-th percentile (nearest rank); NaN for none."""
    if not xs:
        return math.nan
    s = sorted(xs)
    return s[min(max(math.ceil(q / 100.0 * len(s)) - 1, 0), len(s) - 1)]


async def one(
    engine: Any, rid: str, prompt: list[int], max_tokens: int
) -> tuple[list[float], list[int], list[int]]:
    """(chunk arrival times, tokens per chunk, tokens) of one greedy request."""
    from services.worker.core import GenerateRequest, Sampling

    request = GenerateRequest(
        request_id=rid,
        prompt_token_ids=tuple(prompt),
        sampling=Sampling(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
    )
    times, sizes, tokens = [], [], []
    async for d in engine.generate(request):
        if d.token_ids:
            times.append(time.perf_counter())
            sizes.append(len(d.token_ids))
            tokens += d.token_ids
    return times, sizes, tokens


async def measure(
    method: str, target: str, model: Path, draft: Path | None, a: argparse.Namespace
) -> tuple[Row, list[list[int]]]:
    from services.worker.config import EngineConfig, SpeculativeConfig
    from services.worker.engine import VllmEngine

    spec = SpeculativeConfig()
    if method == "ngram":
        spec = SpeculativeConfig(
            method="ngram",
            num_speculative_tokens=a.num_tokens,
            prompt_lookup_min=2,
            prompt_lookup_max=4,
        )
    elif method in DRAFT:
        spec = SpeculativeConfig(
            method=method, num_speculative_tokens=a.num_tokens, draft_model=str(draft)
        )
    elif method == "mtp":
        spec = SpeculativeConfig(method="mtp", num_speculative_tokens=1)
    config = EngineConfig(
        model=str(model),
        served_model_name=model.name,
        dtype="float32",
        max_model_len=2048,
        block_size=32,
        kv_cache_bytes=64 << 20,
        speculative=spec,
    )
    per_round = a.sequential + a.concurrency
    work = prompts(model / "tokenizer.json", 1 + a.repeats * per_round)
    engine = await VllmEngine.start(config)
    try:
        await one(engine, "warm", work[0], 8)
        await asyncio.sleep(0.2)
        before = engine.load()
        gaps: list[float] = []
        tpots: list[float] = []
        outputs: list[list[int]] = []
        single_rates: list[float] = []
        batch_rates: list[float] = []

        def account(times: list[float], tokens: list[int]) -> None:
            gaps.extend(b - a_ for a_, b in itertools.pairwise(times))
            if len(tokens) > 1:
                tpots.append((times[-1] - times[0]) / (len(tokens) - 1))
            outputs.append(tokens)

        for r in range(a.repeats):  # new prompts each round: no prefix cache hits
            mine = work[1 + r * per_round : 1 + (r + 1) * per_round]
            t0, n = time.perf_counter(), 0
            for i, p in enumerate(mine[: a.sequential]):
                times, _, tokens = await one(engine, f"seq-{r}-{i}", p, a.max_tokens)
                account(times, tokens)
                n += len(tokens)
            single_rates.append(n / (time.perf_counter() - t0))
            t0 = time.perf_counter()
            batch = await asyncio.gather(
                *(
                    one(engine, f"batch-{r}-{i}", p, a.max_tokens)
                    for i, p in enumerate(mine[a.sequential :])
                )
            )
            batch_rates.append(sum(len(t) for _, _, t in batch) / (time.perf_counter() - t0))
            for times, _, tokens in batch:
                account(times, tokens)
        total = sum(len(o) for o in outputs)
        want = before.generation_tokens + total
        for _ in range(50):  # the last step's stats reach the front end after its output
            if engine.load().generation_tokens >= want:
                break
            await asyncio.sleep(0.1)
        after = engine.load()
    finally:
        await engine.close()
    row = Row(
        method=method,
        model=target,
        requests=len(outputs),
        output_tokens=total,
        single_tok_s=statistics.median(single_rates),
        batch_tok_s=statistics.median(batch_rates),
        itl_p50_ms=percentile(gaps, 50) * 1e3,
        itl_p99_ms=percentile(gaps, 99) * 1e3,
        tpot_ms=sum(tpots) / len(tpots) * 1e3 if tpots else math.nan,
        drafted=after.spec.draft_tokens - before.spec.draft_tokens,
        accepted=after.spec.accepted_tokens - before.spec.accepted_tokens,
        drafts=after.spec.drafts - before.spec.drafts,
    )
    return row, outputs


def with_ratios(rows: list[Row]) -> list[Row]:
    base = {r.model: r for r in rows if r.method == "none"}
    out = []
    for r in rows:
        b = base.get(r.model)
        if b is None:
            out.append(r)
            continue
        out.append(
            replace(
                r,
                single_ratio=r.single_tok_s / b.single_tok_s,
                batch_ratio=r.batch_tok_s / b.batch_tok_s,
                itl_p50_ratio=r.itl_p50_ms / b.itl_p50_ms,
            )
        )
    return out


def format_table(rows: list[Row]) -> str:
    head = (
        "| method | model | tok/s 1 stream | tok/s batch | ITL p50 / p99 ms (chunks) | TPOT ms | "
        "accepted / drafted | accepted per draft | x none: 1 stream / batch / ITL p50 |"
    )
    lines = [head, "|" + "---|" * 9]
    for r in rows:
        acc = f"{r.accepted}/{r.drafted} = {r.acceptance:.1%}" if r.drafted else "-"
        per = f"{r.accepted_per_draft:.2f}" if r.drafts else "-"
        ratio = (
            f"{r.single_ratio:.2f} / {r.batch_ratio:.2f} / {r.itl_p50_ratio:.2f}"
            if not math.isnan(r.single_ratio)
            else "-"
        )
        lines.append(
            f"| {r.method} | {r.model} | {r.single_tok_s:.0f} | {r.batch_tok_s:.0f} | "
            f"{r.itl_p50_ms:.1f} / {r.itl_p99_ms:.1f} | {r.tpot_ms:.1f} | {acc} | {per} | {ratio} |"
        )
    return "\n".join(lines)


async def bench(a: argparse.Namespace) -> int:
    from kvmesh.models import ensure_model, model_cache_root

    methods = [m.strip() for m in a.methods.split(",") if m.strip()]
    bad = [m for m in methods if m not in METHODS]
    if bad:
        print(
            f"kvmesh bench speculative: unknown method(s) {bad}; known: {METHODS}", file=sys.stderr
        )
        return 2
    root = model_cache_root()
    # A plain run on every target model, so that each method has its baseline.
    order = []
    for target in dict.fromkeys(TARGET[m] for m in methods):
        order.append(("none", target))
        order += [(m, target) for m in methods if m != "none" and TARGET[m] == target]
    rows, reference = [], {}
    for method, target in order:
        started = time.monotonic()
        draft = ensure_model(DRAFT[method], root) if method in DRAFT else None
        row, outputs = await measure(method, target, ensure_model(target, root), draft, a)
        if method == "none":
            reference[target] = outputs
        same = outputs == reference.get(target)
        print(
            f"# {method} on {target}: {time.monotonic() - started:.0f} s, greedy output "
            f"{'identical to' if same else 'DIFFERENT from'} none",
            file=sys.stderr,
        )
        rows.append(row)
    rows = with_ratios(rows)
    print(format_table(rows))
    if a.json:
        for r in rows:
            print(json.dumps(asdict(r) | {"acceptance": r.acceptance}))
    return 0


def run(a: argparse.Namespace) -> int:
    from services.worker.main import VLLM_ENVIRONMENT

    for key, value in VLLM_ENVIRONMENT.items():
        os.environ.setdefault(key, value)
    return asyncio.run(bench(a))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
