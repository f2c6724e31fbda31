"""Measured transfer speeds of one kvmanager, per KV layout, for the routers' cost model.

Three kinds (``Transfer``): ``cpu`` and ``disk``, blocks served to a worker's connector from that
tier (GetBlocks: the tier read and the send, from the kvmanager's side; the engine's copy into
its cache is not seen here), and ``peer``, blocks fetched from another node's kvmanager into this
one (FetchFromPeer). Each sample is (tokens, seconds) of one call, tokens = blocks x the layout's
block size; a sample under ``min_sample_tokens`` waits, added to the next ones (tiny calls are
mostly latency), and samples enter an exponential moving average of seconds per token with a
half-life counted in samples. ``snapshot()`` is what the kvmanager publishes on its etcd record
(``KvManagerRecord.transfer_s_per_token``: layout key -> kind -> seconds per token); routers
price a fetch with it and fall back to their configured rates where a kind has no sample yet.
Pure: no clock, no I/O.
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
    def __init__(self, min_sample_tokens: int = 4096, half_life_samples: float = 8.0) -> None:
        if min_sample_tokens < 1 or half_life_samples <= 0:
            raise ValueError("min_sample_tokens must be >= 1 and half_life_samples > 0")
        self._min = min_sample_tokens
        self._alpha = 1.0 - 0.5 ** (1.0 / half_life_samples)
        self._rates: dict[tuple[str, Transfer], _Rate] = {}

    def add(self, layout_key: str, kind: Transfer, tokens: int, seconds: float) -> None:
        """One call moved ``tokens`` of KV of ``layout_key`` in ``seconds``."""
        if tokens <= 0 or not seconds > 0.0:  # nothing moved, or a clock that did not tick
            return
        r = self._rates.get((layout_key, kind))
        if r is None:
            r = self._rates[(layout_key, kind)] = _Rate()
        r.tokens += tokens
        r.seconds += seconds
        if r.tokens < self._min:
            return
        sample = r.seconds / r.tokens
        r.tokens, r.seconds = 0, 0.0
        r.s_per_token = (
            sample if not r.s_per_token else r.s_per_token + self._alpha * (sample - r.s_per_token)
        )

    def s_per_token(self, layout_key: str, kind: Transfer) -> float:
        """The measured seconds per token (0: no sample yet)."""
        r = self._rates.get((layout_key, kind))
        return r.s_per_token if r is not None else 0.0

    def snapshot(self) -> dict[str, dict[str, float]]:
        """layout key -> kind -> seconds per token, for the kinds measured so far."""
        out: dict[str, dict[str, float]] = {}
        for (layout, kind), r in sorted(self._rates.items()):
            if r.s_per_token:
                out.setdefault(layout, {})[kind.value] = r.s_per_token
        return out


def moved(
    published: Mapping[str, Mapping[str, float]], now: Mapping[str, Mapping[str, float]]
) -> bool:
    """Whether ``now`` is worth publishing over ``published``: a kind appeared, or a rate moved
    by more than 20% (the record is not rewritten for noise)."""
    for layout, kinds in now.items():
        old = published.get(layout, {})
        for kind, v in kinds.items():
            was = old.get(kind)
            if was is None or abs(v - was) > 0.2 * was:
                return True
    return False
