"""Prefill speed per worker, learned from the workers' own reports.

Each load report carries two cumulative counters the engine keeps (``LoadSnapshot``
``prefill_computed_tokens`` and ``prefill_s``: prompt tokens computed by requests whose prefill
completed, and the seconds those prefills took, scheduling to first token). Between two reports
of a worker, their deltas give one sample of seconds per computed token; a sample waits until it
covers ``min_sample_tokens`` (tiny prompts say little), and samples enter an exponential moving
average with a half-life counted in samples. A worker first seen with counters that already
cover ``min_sample_tokens`` (it served before this router started) starts from their ratio,
its average since it started, instead of waiting for a sample: a router restarted in front of
a busy fleet would otherwise price its first burst at the default and let in far more prefill
than the workers can run before the samples come. A worker with no sample yet gets the mean
of the workers that have one, and the configured default when none has. Counters that go backwards (the
engine restarted) start the worker over. Pure: no clock, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..types import LoadSnapshot


@dataclass(slots=True)
class _Worker:
    tokens: int  # counters at the start of the pending sample
    seconds: float
    rate: float = 0.0  # s per token; 0: no sample yet


class PrefillRates:
    def __init__(
        self, default_s_per_token: float, min_sample_tokens: int = 2048, half_life: float = 8.0
    ) -> None:
        self._default = default_s_per_token
        self._min = min_sample_tokens
        self._alpha = 1.0 - 0.5 ** (1.0 / half_life)
        self._workers: dict[str, _Worker] = {}
        self._sum = 0.0  # of the learned rates
        self._learned = 0

    def observe(self, worker_id: str, load: LoadSnapshot) -> None:
        """Takes the worker's latest report (cheap when nothing changed)."""
        tokens, seconds = load.prefill_computed_tokens, load.prefill_s
        w = self._workers.get(worker_id)
        if w is None:
            w = self._workers[worker_id] = _Worker(tokens, seconds)
            if tokens >= self._min and seconds > 0.0:  # its average since it started
                w.rate = seconds / tokens
                self._sum += w.rate
                self._learned += 1
            return
        dt = tokens - w.tokens
        if dt < 0 or seconds < w.seconds:  # restarted: its old rate no longer says much
            self._forget(w)
            w.tokens, w.seconds = tokens, seconds
            return
        if dt < self._min:
            return
        sample = (seconds - w.seconds) / dt
        w.tokens, w.seconds = tokens, seconds
        if sample <= 0.0:
            return
        if w.rate:
            new = w.rate + self._alpha * (sample - w.rate)
            self._sum += new - w.rate
            w.rate = new
        else:
            w.rate = sample
            self._sum += sample
            self._learned += 1

    def s_per_token(self, worker_id: str) -> float:
        """The worker's measured seconds per computed prompt token (see module doc)."""
        w = self._workers.get(worker_id)
        if w is not None and w.rate > 0:
            return w.rate
        if self._learned:
            return self._sum / self._learned
        return self._default

    def forget(self, worker_id: str) -> None:
        w = self._workers.pop(worker_id, None)
        if w is not None:
            self._forget(w)

    def _forget(self, w: _Worker) -> None:
        if w.rate:
            self._sum -= w.rate
            self._learned -= 1
            w.rate = 0.0
