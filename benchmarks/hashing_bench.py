"""What the router pays to compute vLLM's block hashes of a long prompt.

    .venv/bin/python benchmarks/hashing_bench.py [--tokens 195000] [--extend 2000] [--repeats 20]

Pure CPU, one thread, no vLLM. Token ids are drawn from a 150K vocabulary (ids past 65535 pickle
into longer opcodes, as with real vocabularies). Prints a markdown table of p50/p90 over
``--repeats`` runs of: hashing a whole prompt (sha256 at block 32 and 16, sha256_cbor at 32),
and SessionHasher turns on a session whose previous turn is the ``--tokens`` prompt: the next
turn extends it by ``--extend`` tokens, repeats it unchanged, or edits a token in its middle.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvmesh.kv.hashing import HashAlgo, HashConfig, SessionHasher, block_hashes

VOCAB = 150_000


def _time_ms(run: Callable[[], object]) -> float:
    started = time.perf_counter()
    run()
    return (time.perf_counter() - started) * 1e3


def _full(repeats: int, tokens: list[int], cfg: HashConfig) -> list[float]:
    return [_time_ms(partial(block_hashes, tokens, cfg)) for _ in range(repeats)]


def _turn(repeats: int, first: list[int], second: list[int], cfg: HashConfig) -> list[float]:
    """Milliseconds of hashing ``second`` in a session whose last turn was ``first``."""
    times = []
    for _ in range(repeats):
        hasher = SessionHasher(cfg, max_tokens=10 * len(first))
        hasher.hash("s", first)  # not timed
        times.append(_time_ms(partial(hasher.hash, "s", second)))
    return times


def _row(name: str, blocks: int, times: list[float]) -> str:
    q = statistics.quantiles(times, n=10, method="inclusive")
    return f"| {name} | {blocks} | {statistics.median(times):.2f} | {q[8]:.2f} |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=195_000, help="prompt length")
    parser.add_argument("--extend", type=int, default=2_000, help="tokens the next turn adds")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    rng = random.Random(0)
    prompt = [rng.randrange(VOCAB) for _ in range(args.tokens)]
    extended = prompt + [rng.randrange(VOCAB) for _ in range(args.extend)]
    edited = list(prompt)
    edited[len(prompt) // 2] = (edited[len(prompt) // 2] + 1) % VOCAB
    n = args.repeats

    rows = [f"Prompt {args.tokens} tokens, {n} repeats, Python {sys.version.split()[0]}", ""]
    rows += ["| case | blocks | p50 (ms) | p90 (ms) |", "|---|---|---|---|"]
    for algo, bs in ((HashAlgo.SHA256, 32), (HashAlgo.SHA256, 16), (HashAlgo.SHA256_CBOR, 32)):
        cfg = HashConfig(algo=algo, block_size=bs)
        times = _full(n, prompt, cfg)
        rows.append(_row(f"full prompt, {algo}, block {bs}", args.tokens // bs, times))

    cfg = HashConfig()
    turns = (
        (f"session turn: +{args.extend} tokens", extended),
        ("session turn: same prompt", prompt),
        ("session turn: edit in the middle", edited),
    )
    for name, tokens in turns:
        times = _turn(n, prompt, tokens, cfg)
        rows.append(_row(f"{name}, sha256, block 32", len(tokens) // 32, times))
    print("\n".join(rows))


if __name__ == "__main__":
    main()
