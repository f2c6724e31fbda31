"""Session retention, the router's part (pure): what a turn asks its node's kvmanager to keep,
and whether the next turn found it. The adapter (``services/router/retention.py``) makes the
calls; docs/agents.md#retention.

A turn of session S on worker W pins, on W's node kvmanager, the hash chain of the turn's prompt
and output (the output's last token has no KV yet, so it is left out): the next turn's prompt
extends it. The book remembers, per session, how many prompt blocks the last pin covered; the
next turn is a *hit* when its cached prompt tokens cover them (the engine or the kvmanager kept
the prefix), else a *miss*.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

from kvmesh.errors import InvalidArgument
from kvmesh.settings import setting


@dataclass(frozen=True, slots=True)
class RetentionConfig:
    ttl_s: float = setting(
        600.0,
        "how long a session's blocks are kept on its node after its last turn (the agent's "
        "tool time), seconds; 0: no retention",
    )
    timeout_s: float = setting(1.0, "deadline of a RetainSession call to a kvmanager, seconds")
    max_sessions: int = setting(65536, "sessions whose last pin the router remembers (LRU)")
    max_ttl_s: float = setting(
        3600.0,
        "the longest retention a request may ask for (an Anthropic cache_control ttl), seconds",
    )
    prefetch_timeout_s: float = setting(
        10.0,
        "deadline of a PrefetchSession call (a session's next turn arrived: its node kvmanager "
        "brings its retained blocks from disk to RAM), seconds; 0: no prefetch",
    )

    def __post_init__(self) -> None:
        if self.ttl_s < 0:
            raise InvalidArgument(f"retention ttl_s must be >= 0, got {self.ttl_s}")
        if not self.timeout_s > 0:
            raise InvalidArgument(f"retention timeout_s must be > 0, got {self.timeout_s}")
        if self.max_sessions < 1:
            raise InvalidArgument(f"retention max_sessions must be >= 1, got {self.max_sessions}")
        if not self.max_ttl_s > 0:
            raise InvalidArgument(f"retention max_ttl_s must be > 0, got {self.max_ttl_s}")
        if self.prefetch_timeout_s < 0:
            raise InvalidArgument(
                f"retention prefetch_timeout_s must be >= 0, got {self.prefetch_timeout_s}"
            )

    def turn_ttl_s(self, asked_s: float) -> float:
        """How long a turn's blocks are kept: what the request asked for (an Anthropic
        cache_control ttl; 0 or less: nothing asked), at most ``max_ttl_s``, else ``ttl_s``."""
        if asked_s > 0:
            return min(asked_s, self.max_ttl_s)
        return self.ttl_s

    @property
    def enabled(self) -> bool:
        return self.ttl_s > 0


class TurnOutcome(StrEnum):
    HIT = "hit"  # the previous turn's retained prefix was cached
    MISS = "miss"  # it was not (evicted, expired, or the turn went to another node)


def retained_ids(prompt_ids: Sequence[int], output_ids: Sequence[int]) -> list[int]:
    """The token ids whose full blocks a turn leaves in KV: the prompt and the output but its
    last token (sampled, never run through the model)."""
    return [*prompt_ids, *output_ids[:-1]]


@dataclass(frozen=True, slots=True)
class _Pinned:
    prompt_blocks: int
    block_size: int
    worker_id: str


class SessionBook:
    """Per session (tenant, id): what its last pin covered, least recently used dropped."""

    def __init__(self, max_sessions: int) -> None:
        self._max = max_sessions
        self._pins: OrderedDict[tuple[str, str], _Pinned] = OrderedDict()

    def __len__(self) -> int:
        return len(self._pins)

    def judge(self, tenant: str, session_id: str, cached_prompt_tokens: int) -> TurnOutcome | None:
        """The outcome of a turn given its cached prompt tokens; None: no previous pin."""
        p = self._pins.get((tenant, session_id))
        if p is None or p.prompt_blocks == 0:
            return None
        covered = cached_prompt_tokens >= p.prompt_blocks * p.block_size
        return TurnOutcome.HIT if covered else TurnOutcome.MISS

    def pinned(
        self, tenant: str, session_id: str, prompt_tokens: int, block_size: int, worker_id: str
    ) -> None:
        key = (tenant, session_id)
        self._pins.pop(key, None)
        self._pins[key] = _Pinned(prompt_tokens // block_size, block_size, worker_id)
        while len(self._pins) > self._max:
            self._pins.popitem(last=False)

    def worker_of(self, tenant: str, session_id: str) -> str | None:
        """The worker that served the session's last pinned turn (its blocks are on that
        worker's node), if the book remembers one."""
        p = self._pins.get((tenant, session_id))
        return p.worker_id if p is not None else None

    def forget(self, tenant: str, session_id: str) -> None:
        self._pins.pop((tenant, session_id), None)
