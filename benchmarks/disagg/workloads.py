"""Request streams for the disaggregation benchmark: the agentic coding sessions of
``benchmarks.replay.agentic`` and a chat workload (short prompts, longer answers). Seeded, pure."""

from __future__ import annotations

import math
import random
from collections.abc import Iterator
from dataclasses import dataclass

from benchmarks.replay.agentic import AgenticConfig, agentic_sessions
from benchmarks.replay.traces import ReplayRequest, mix64
from kvmesh.kv.events import BlockHash

WORKLOADS = ("agentic", "chat")


@dataclass(frozen=True, slots=True)
class ChatConfig:
    seed: int = 0
    requests: int = 4_000
    rate_per_s: float = 40.0  # Poisson arrivals, requests per second
    block_size: int = 32
    system_prompt_tokens: int = 400  # shared by every request
    prompt_median: int = 600  # the user's part: log-normal with this median ...
    prompt_sigma: float = 1.0  # ... and sigma, clipped to prompt_range
    prompt_range: tuple[int, int] = (20, 12_000)
    output_median: int = 400  # answer tokens: log-normal, clipped to output_range
    output_sigma: float = 0.6
    output_range: tuple[int, int] = (20, 2_000)

    def __post_init__(self) -> None:
        if self.requests <= 0 or self.rate_per_s <= 0 or self.block_size <= 0:
            raise ValueError("requests, rate_per_s and block_size must be > 0")


def _lognormal(rng: random.Random, median: int, sigma: float, lo: int, hi: int) -> int:
    return max(lo, min(hi, round(median * math.exp(rng.gauss(0.0, sigma)))))


def block_hashes(
    shared_tokens: int, own_tokens: int, own_id: int, bs: int
) -> tuple[BlockHash, ...]:
    """Chained hashes of the full blocks of (shared prefix, then this request's own tokens):
    blocks wholly inside the shared prefix are equal across requests, the rest are not."""
    out: list[BlockHash] = []
    h = 0
    for i in range((shared_tokens + own_tokens) // bs):
        key = i if (i + 1) * bs <= shared_tokens else (own_id << 24) | i | (1 << 62)
        h = mix64(h ^ mix64(key))
        out.append(BlockHash(h))
    return tuple(out)


def chat_requests(config: ChatConfig | None = None) -> Iterator[ReplayRequest]:
    """Independent single-turn chats in arrival order (a shared system prompt, then the user's
    prompt; prompts median ~1K tokens with a long tail, answers median 400)."""
    cfg = config or ChatConfig()
    rng = random.Random(cfg.seed)
    t = 0.0
    for n in range(cfg.requests):
        t += rng.expovariate(cfg.rate_per_s)
        own = _lognormal(rng, cfg.prompt_median, cfg.prompt_sigma, *cfg.prompt_range)
        out = _lognormal(rng, cfg.output_median, cfg.output_sigma, *cfg.output_range)
        hashes = block_hashes(cfg.system_prompt_tokens, own, n, cfg.block_size)
        yield ReplayRequest(t, f"c{n}", hashes, cfg.system_prompt_tokens + own, out)


def requests_of(workload: str, *, seed: int, size: int, block_size: int) -> list[ReplayRequest]:
    """``size``: agentic sessions, or chat requests."""
    if workload == "agentic":
        return list(
            agentic_sessions(AgenticConfig(seed=seed, sessions=size, block_size=block_size))
        )
    if workload == "chat":
        return list(chat_requests(ChatConfig(seed=seed, requests=size, block_size=block_size)))
    raise ValueError(f"unknown workload {workload!r}; choose from {', '.join(WORKLOADS)}")
