"""Generated coding-agent sessions, as a replay request stream (seeded, deterministic).

Shaped after what published studies of production coding agents report (docs/simulator.md): each
session's context (a system prompt shared by every session, then the session's own history)
grows turn by turn; every turn resends the whole context plus what was added since (the previous
answer, ~300 tokens, and 1-5K tokens of tool results or user text); think time separates turns.
Most sessions run until the context nears the model's window, some end earlier. Now and then a
turn starts a burst of sub-agents: each continues from the session's whole context (its shared
prefix) with its own task, runs a few turns, and the session resumes when the last one is done,
with their results appended.

Arrival times are open-loop: think times stand for the model's answer plus tool and user time, and
do not depend on how fast a replay serves. Requests are yielded lazily in arrival order (contexts
of 200K tokens are ~6,000 block hashes each; a list of thousands of them is large).

Block hashes: content is a sequence of segments (system prompt, first prompt, each answer, each
tool result), each with its own id; a block's hash chains its parent's hash with the
(segment, offset, length) pieces it holds, so equal prefixes give equal blocks.
"""

from __future__ import annotations

import heapq
import math
import random
from collections.abc import Iterator
from dataclasses import dataclass

from kvmesh.kv.events import BlockHash

from .traces import ReplayRequest, mix64


@dataclass(frozen=True, slots=True)
class AgenticConfig:
    seed: int = 0
    sessions: int = 32  # main sessions
    start_window_s: float = 600.0  # sessions start uniformly at random in [0, this)
    block_size: int = 32  # engine block size of the hashes, tokens
    system_prompt_tokens: int = 12_000  # shared by every session (instructions, tool schemas)
    first_prompt_tokens: tuple[int, int] = (10_000, 30_000)  # the session's own first context
    window_tokens: int = 200_000  # the model's context; no request exceeds it
    early_end_fraction: float = 0.2  # sessions that end before the window ...
    early_end_tokens: tuple[int, int] = (100_000, 200_000)  # ... at a context drawn from this
    output_reserve_tokens: int = 1_000  # a session ends when the next turn leaves less room
    new_tokens: tuple[int, int] = (1_000, 5_000)  # added per turn besides the answer
    output_median: int = 300  # answer tokens: log-normal with this median ...
    output_sigma: float = 0.5  # ... and this sigma, clipped to [20, 4000]
    think_s: tuple[float, float] = (5.0, 60.0)  # between a session's turns, seconds
    burst_probability: float = 0.08  # per turn (after the first): a burst of sub-agents starts
    burst_size: tuple[int, int] = (2, 5)  # sub-agents per burst
    subagent_turns: tuple[int, int] = (2, 6)
    subagent_task_tokens: tuple[int, int] = (1_000, 3_000)  # each sub-agent's own task
    subagent_think_s: tuple[float, float] = (2.0, 15.0)
    subagent_result_tokens: tuple[int, int] = (500, 2_000)  # appended to the session per agent

    def __post_init__(self) -> None:
        if self.sessions <= 0 or self.block_size <= 0:
            raise ValueError("sessions and block_size must be > 0")
        if self.system_prompt_tokens + self.first_prompt_tokens[1] >= self.window_tokens:
            raise ValueError("the first prompt must fit the window")


class _Context:
    """A growing token sequence as block hashes (full blocks) plus the pieces of its tail."""

    __slots__ = ("bs", "hashes", "tail", "tail_len", "tokens")

    def __init__(self, block_size: int) -> None:
        self.bs = block_size
        self.hashes: list[BlockHash] = []
        self.tail: list[int] = []  # piece keys of the partial last block
        self.tail_len = 0
        self.tokens = 0

    def copy(self) -> _Context:
        c = _Context(self.bs)
        c.hashes = self.hashes.copy()
        c.tail = self.tail.copy()
        c.tail_len = self.tail_len
        c.tokens = self.tokens
        return c

    def append(self, segment: int, n: int) -> None:
        bs = self.bs
        hashes = self.hashes
        off = 0
        self.tokens += n
        while n > 0:
            take = min(bs - self.tail_len, n)
            self.tail.append(mix64((segment << 40) | (off << 20) | take))
            self.tail_len += take
            off += take
            n -= take
            if self.tail_len == bs:
                h = hashes[-1] if hashes else 0
                for piece in self.tail:
                    h = mix64(h ^ piece)
                hashes.append(BlockHash(h))
                self.tail = []
                self.tail_len = 0


class _Agent:
    """A session's main agent, or one of its sub-agents (``plan`` holds its pre-drawn turns)."""

    __slots__ = ("ctx", "final_tokens", "plan", "session", "session_id", "subagents", "turns")

    def __init__(self, session: int, session_id: str, ctx: _Context, final_tokens: int) -> None:
        self.session = session
        self.session_id = session_id
        self.ctx = ctx
        self.final_tokens = final_tokens
        self.plan: list[tuple[float, int, int]] = []  # sub-agent: (arrival, output, new tokens)
        self.subagents = 0
        self.turns = 0


class _Generator:
    def __init__(self, cfg: AgenticConfig) -> None:
        self.cfg = cfg
        self.rng = random.Random(cfg.seed)
        self.segments = 1  # segment 0: the shared system prompt
        self.heap: list[tuple[float, int, _Agent]] = []
        self.seq = 0

    def segment(self) -> int:
        self.segments += 1
        return self.segments

    def push(self, t: float, agent: _Agent) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (t, self.seq, agent))

    def output_tokens(self) -> int:
        cfg = self.cfg
        x = cfg.output_median * math.exp(self.rng.gauss(0.0, cfg.output_sigma))
        return max(20, min(4_000, round(x)))

    def between(self, bounds: tuple[int, int]) -> int:
        return self.rng.randint(bounds[0], bounds[1])

    def run(self) -> Iterator[ReplayRequest]:
        cfg = self.cfg
        rng = self.rng
        for s in range(cfg.sessions):
            ctx = _Context(cfg.block_size)
            ctx.append(0, cfg.system_prompt_tokens)
            ctx.append(self.segment(), self.between(cfg.first_prompt_tokens))
            final = cfg.window_tokens
            if rng.random() < cfg.early_end_fraction:
                final = min(final, self.between(cfg.early_end_tokens))
            self.push(rng.uniform(0.0, cfg.start_window_s), _Agent(s, f"s{s}", ctx, final))
        while self.heap:
            t, _seq, agent = heapq.heappop(self.heap)
            if agent.plan:
                yield from self.subagent_turn(t, agent)
            else:
                yield from self.main_turn(t, agent)

    def main_turn(self, t: float, agent: _Agent) -> Iterator[ReplayRequest]:
        cfg = self.cfg
        rng = self.rng
        ctx = agent.ctx
        out = self.output_tokens()
        yield ReplayRequest(t, agent.session_id, tuple(ctx.hashes), ctx.tokens, out)
        ctx.append(self.segment(), out)
        agent.turns += 1
        if agent.turns > 1 and rng.random() < cfg.burst_probability:
            done = self.burst(t, agent)
            if done is not None:
                added = sum(self.between(cfg.subagent_result_tokens) for _ in range(done[1]))
                ctx.append(self.segment(), added)
                if ctx.tokens + cfg.output_reserve_tokens <= agent.final_tokens:
                    self.push(done[0] + rng.uniform(*cfg.think_s), agent)
                return
        ctx.append(self.segment(), self.between(cfg.new_tokens))
        if ctx.tokens + cfg.output_reserve_tokens <= agent.final_tokens:
            self.push(t + rng.uniform(*cfg.think_s), agent)

    def burst(self, t: float, main: _Agent) -> tuple[float, int] | None:
        """Starts sub-agents from ``main``'s context; (when the last is done, how many) or None
        if none fits the window."""
        cfg = self.cfg
        rng = self.rng
        end = t
        started = 0
        for _ in range(self.between(cfg.burst_size)):
            ctx = main.ctx.copy()
            ctx.append(self.segment(), self.between(cfg.subagent_task_tokens))
            tokens = ctx.tokens
            at = t + rng.uniform(1.0, 5.0)  # the session's answer asks for the sub-agents
            plan: list[tuple[float, int, int]] = []
            for _turn in range(self.between(cfg.subagent_turns)):
                out, new = self.output_tokens(), self.between(cfg.new_tokens)
                if tokens + out + cfg.output_reserve_tokens > cfg.window_tokens:
                    break
                plan.append((at, out, new))
                tokens += out + new
                at += rng.uniform(*cfg.subagent_think_s)
            if not plan:
                continue
            main.subagents += 1
            sub = _Agent(main.session, f"{main.session_id}/a{main.subagents}", ctx, 0)
            sub.plan = plan
            self.push(plan[0][0], sub)
            end = max(end, at)  # its last answer, plus its own wrap-up time
            started += 1
        return (end, started) if started else None

    def subagent_turn(self, t: float, agent: _Agent) -> Iterator[ReplayRequest]:
        ctx = agent.ctx
        _at, out, new = agent.plan.pop(0)
        yield ReplayRequest(t, agent.session_id, tuple(ctx.hashes), ctx.tokens, out)
        if agent.plan:
            ctx.append(self.segment(), out)
            ctx.append(self.segment(), new)
            self.push(agent.plan[0][0], agent)


def agentic_sessions(config: AgenticConfig | None = None) -> Iterator[ReplayRequest]:
    """The requests of ``config``'s sessions, lazily, in arrival order."""
    return _Generator(config or AgenticConfig()).run()
