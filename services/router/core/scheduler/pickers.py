"""Built-in pickers: best total (random among ties), round-robin, random."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from ..workers import WorkerView
from .params import NoParams, check
from .plugins import Choice, CycleContext, PluginEnv


@dataclass(frozen=True, slots=True)
class MaxScoreParams:
    tie_epsilon: float = 1e-9  # totals this close count as tied
    seed: int | None = None  # tie-break rng seed; unset: the router's rng

    def __post_init__(self) -> None:
        check(self.tie_epsilon >= 0, f"tie_epsilon is {self.tie_epsilon}; use 0 or more")


class MaxScorePicker:
    """The best total; ties broken at random. The runner-up is the best candidate outside the
    tied group (what the winners beat), or none when every candidate tied."""

    def __init__(self, name: str, params: MaxScoreParams, rng: random.Random) -> None:
        self.name = name
        self._eps = params.tie_epsilon
        self._rng = rng if params.seed is None else random.Random(params.seed)

    @classmethod
    def build(cls, name: str, params: MaxScoreParams, env: PluginEnv) -> MaxScorePicker:
        return cls(name, params, env.rng)

    def pick(
        self, ctx: CycleContext, candidates: Sequence[WorkerView], totals: Sequence[float]
    ) -> Choice:
        n = len(totals)
        if n == 1:
            return Choice(0)
        best = max(totals)
        cut = best - self._eps
        tied = [i for i, t in enumerate(totals) if t >= cut]
        win = tied[0] if len(tied) == 1 else tied[self._rng.randrange(len(tied))]
        if len(tied) == n:
            return Choice(win, -1, n)
        runner = max((i for i in range(n) if totals[i] < cut), key=totals.__getitem__)
        return Choice(win, runner, len(tied))


@dataclass(frozen=True, slots=True)
class SeedParams:
    seed: int | None = None  # rng seed; unset: the router's rng


class RandomPicker:
    """Uniformly at random (ignores scores): a baseline."""

    def __init__(self, name: str, params: SeedParams, rng: random.Random) -> None:
        self.name = name
        self._rng = rng if params.seed is None else random.Random(params.seed)

    @classmethod
    def build(cls, name: str, params: SeedParams, env: PluginEnv) -> RandomPicker:
        return cls(name, params, env.rng)

    def pick(
        self, ctx: CycleContext, candidates: Sequence[WorkerView], totals: Sequence[float]
    ) -> Choice:
        return Choice(self._rng.randrange(len(candidates)), uses_scores=False)


class RoundRobinPicker:
    """Each candidate in turn (ignores scores): a baseline."""

    def __init__(self, name: str, params: NoParams) -> None:
        self.name = name
        self._next = 0

    def pick(
        self, ctx: CycleContext, candidates: Sequence[WorkerView], totals: Sequence[float]
    ) -> Choice:
        i = self._next % len(candidates)
        self._next += 1
        return Choice(i, uses_scores=False)
