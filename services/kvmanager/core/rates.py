"""Measured transfer speeds of one kvmanager, per KV layout, for the routers' cost model.

Three kinds (``Transfer``): ``cpu`` and ``disk``, blocks served to a worker's connector from that
tier (GetBlocks: the tier read and the send, from the kvmanager's side; the engine's copy into
its cache is not seen here), and ``peer``, blocks fetched from another node's kvmanager into this
one (FetchFromPeer). A peer fetch is also measured per source (``add(..., source=peer id)``):
links differ (one may be slow, shaped or far), and the routers price a fetch from a given peer
with the speed of that link (``peer_snapshot``).

Each sample is (tokens, seconds) of one call, tokens = blocks x the layout's block size; a sample
under ``min_sample_tokens`` waits, added to the next ones (tiny calls are mostly latency),
while a call that took ``min_sample_s`` or more is a sample on its own (a slow link says so in
one call, undiluted by the quick calls pending), and samples enter an
exponential moving average of seconds per token with a half-life counted in samples.
``snapshot()`` is what the kvmanager publishes on its etcd record
(``KvManagerRecord.transfer_s_per_token``: layout key -> kind -> seconds per token), and
``peer_snapshot()`` its per-source peer speeds (``KvManagerRecord.peer_s_per_token``: peer
kvmanager id -> layout key -> seconds per token); routers price a fetch with them and fall back
to their configured rates where nothing was measured yet. Pure: no clock, no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum


class Transfer(StrEnum):
    CPU = "cpu"  # node CPU tier -> a worker
    DISK = "disk"  # node disk tier -> a worker
    PEER = "peer"  # another node's kvmanager -> this one


@dataclass(slots=True)
class _Rate:
    tokens: int = 0  # pending: not yet a sample
    seconds: float = 0.0
    s_per_token: float = 0.0  # 0: no sample yet


class TransferMeter:
    def __init__(
        self,
        min_sample_tokens: int = 4096,
        half_life_samples: float = 8.0,
        min_sample_s: float = 0.1,
    ) -> None:
        if min_sample_tokens < 1 or half_life_samples <= 0 or not min_sample_s > 0:
            raise ValueError(
                "min_sample_tokens must be >= 1, half_life_samples > 0 and min_sample_s > 0"
            )
        self._min = min_sample_tokens
        self._min_s = min_sample_s
        self._alpha = 1.0 - 0.5 ** (1.0 / half_life_samples)
        # (layout, kind, source): source "" is the kind's own rate, a peer id one link's.
        self._rates: dict[tuple[str, Transfer, str], _Rate] = {}

    def add(
        self, layout_key: str, kind: Transfer, tokens: int, seconds: float, source: str = ""
    ) -> None:
        """One call moved ``tokens`` of KV of ``layout_key`` in ``seconds``; ``source``: the
        peer kvmanager a ``peer`` fetch came from (its link is measured too)."""
        if tokens <= 0 or not seconds > 0.0:  # nothing moved, or a clock that did not tick
            return
        self._add((layout_key, kind, ""), tokens, seconds)
        if source and kind is Transfer.PEER:
            self._add((layout_key, kind, source), tokens, seconds)

    def _add(self, key: tuple[str, Transfer, str], tokens: int, seconds: float) -> None:
        r = self._rates.get(key)
        if r is None:
            r = self._rates[key] = _Rate()
        if seconds >= self._min_s:  # a slow call: a sample on its own, not diluted by quick ones
            sample = seconds / tokens
        else:
            r.tokens += tokens
            r.seconds += seconds
            if r.tokens < self._min and r.seconds < self._min_s:
                return
            sample = r.seconds / r.tokens
            r.tokens, r.seconds = 0, 0.0
        r.s_per_token = (
            sample if not r.s_per_token else r.s_per_token + self._alpha * (sample - r.s_per_token)
        )

    def s_per_token(self, layout_key: str, kind: Transfer, source: str = "") -> float:
        """The measured seconds per token (0: no sample yet); ``source``: of one peer's link."""
        r = self._rates.get((layout_key, kind, source))
        return r.s_per_token if r is not None else 0.0

    def snapshot(self) -> dict[str, dict[str, float]]:
        """layout key -> kind -> seconds per token, for the kinds measured so far."""
        out: dict[str, dict[str, float]] = {}
        for (layout, kind, source), r in sorted(self._rates.items()):
            if r.s_per_token and not source:
                out.setdefault(layout, {})[kind.value] = r.s_per_token
        return out

    def peer_snapshot(self) -> dict[str, dict[str, float]]:
        """peer kvmanager id -> layout key -> seconds per token of fetches from it."""
        out: dict[str, dict[str, float]] = {}
        for (layout, _kind, source), r in sorted(self._rates.items()):
            if r.s_per_token and source:
                out.setdefault(source, {})[layout] = r.s_per_token
        return out


def moved(
    published: Mapping[str, Mapping[str, float]], now: Mapping[str, Mapping[str, float]]
) -> bool:
    """Whether ``now`` is worth publishing over ``published``: a rate appeared, or one moved
    by more than 20% (the record is not rewritten for noise). Both maps are two levels of
    names (layout -> kind, or peer -> layout) over seconds per token."""
    for outer, inner in now.items():
        old = published.get(outer, {})
        for name, v in inner.items():
            was = old.get(name)
            if was is None or abs(v - was) > 0.2 * was:
                return True
    return False
