"""The work in flight on a worker, priced as engine step time; its rates learned from the engines.

An engine runs its requests in steps (vLLM's continuous batching): every step decodes one token
for each running request and spends the rest of its token budget on prefill chunks. What a step
costs beyond its prefill compute grows with the requests in it and with their context, cached or
not (each decode reads its whole KV: the attention over a 100K-token context costs the same
whether that context was computed or loaded from a cache)::

    step_s(w) = seq_s * requests_in_flight(w) + context_s_per_token * context_in_flight(w)

A request routed to ``w`` rides those steps: its prefill waits for the tokens ahead of it and
its own, ``ceil((prefill_tokens_in_flight(w) + uncached(w)) / step_tokens)`` steps, and it then
decodes for ``decode_steps`` more (its expected output), every one of them longer by
``step_s(w)``; the same context slows the requests it joins. So ``in_flight_s`` is::

    in_flight_s(w) = step_s(w) * (prefill_steps(w) + decode_steps)

A worker that holds a hot prefix is cheap to prefill on, but every request that shares the
prefix brings its whole context into the worker's steps; this term is what makes it busy.

``StepRates`` learns ``seq_s`` and ``context_s_per_token`` from the engines' own reports. Where
a worker reports its engine's decode timing (``LoadSnapshot.decode_tokens`` / ``decode_s``:
finished requests' tokens after their first and the seconds from first to last token, vLLM's
per-request ``decode_time``; the simulator reports its own), a sample is the time between a
decoding request's tokens, ``(decode_s delta) / (decode_tokens delta)`` between two reports at
least ``min_sample_tokens`` apart: the step time as the decoding requests rode it, with no idle
time in it and no request that was still prefilling counted as running (both skewed the older
source below). Its regressors are the means over the decisions made in the sample's window
(each decision reads every candidate: requests arrive at random, so their mean is the window's
time average) of the worker's running requests, the context this router has in flight on it,
and the tokens it still has to prefill there. Where a worker does not report decode timing, a
sample is its cumulative decode output (``generation_tokens``: one token per decoding request
per step) between two reports ``dt`` seconds apart, while ``n`` requests ran: ``dt * n /
tokens`` (only until some worker reports decode timing: the fit then starts over on that
source alone). Either way
a least-squares fit over the fleet's samples
(``step = base + seq_s * n + context_s_per_token * context + p * prefill``, exponentially
forgotten) gives the two slopes; the prefill regressor (``step_fit_prefill``) takes the prefill
chunks that share the steps out of them (the measured prefill rate prices those). Until the
samples vary enough to fit them (or where the workers report neither), the configured rates
stand in.
``decode_steps`` is learned alike: the output tokens the fleet reported emitting per request this
router saw finish (``finished``), a moving average over batches of ``min_finished`` requests.
Pure: the report times come with the reports (``LoadSnapshot.reported_s``); no clock, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..types import LoadSnapshot

_K = 4  # regressors of a step time: 1, requests, context tokens, tokens still to prefill


def in_flight_s(
    requests: int,
    context_tokens: int,
    prefill_tokens: int,
    seq_s: float,
    context_s_per_token: float,
    step_tokens: int,
    decode_steps: float,
) -> float:
    """Seconds that the work in flight on a worker adds to a request routed there (module doc):
    ``requests`` and ``context_tokens`` in flight (cached or not), ``prefill_tokens``: the
    tokens it prefills before its first token (those ahead of it and its own)."""
    step = seq_s * max(requests, 0) + context_s_per_token * max(context_tokens, 0)
    if step <= 0.0:
        return 0.0
    prefill_steps = -(-max(prefill_tokens, 0) // step_tokens) if step_tokens > 0 else 0
    return step * (prefill_steps + decode_steps)


@dataclass(slots=True)
class _Seen:
    tokens: int  # generation_tokens at the start of the pending sample
    at_s: float


@dataclass(slots=True)
class _Timed:
    """A worker reporting decode timing: the counters at the start of the pending sample and
    the sums of the regressors seen since (one term per decision)."""

    tokens: int  # decode_tokens
    decode_s: float
    looks: int = 0
    requests: float = 0.0
    context: float = 0.0
    prefill: float = 0.0


class StepRates:
    """Learns ``(seq_s, context_s_per_token)`` from the workers' reports (module doc)."""

    def __init__(
        self,
        seq_s: float,
        context_s_per_token: float,
        min_sample_tokens: int = 256,
        half_life_samples: float = 64.0,
        min_samples: int = 8,
        decode_steps: float = 256.0,
        min_finished: int = 32,
    ) -> None:
        self._default = (seq_s, context_s_per_token)
        self._decode_steps = decode_steps
        self._min_finished = min_finished
        self._gen: dict[str, int] = {}  # worker -> its last generation_tokens
        self._gen_new = 0  # output tokens reported since the last decode_steps sample
        self._finished_new = 0  # requests finished since then
        self._decode_learned = False
        self._min_tokens = min_sample_tokens
        self._keep = 0.5 ** (1.0 / half_life_samples)
        self._min_samples = min_samples
        self._seen: dict[str, _Seen] = {}
        self._timed: dict[str, _Timed] = {}  # workers whose engines report decode timing
        self.timed_samples = 0  # samples from engine decode timing (the rest: output / time)
        # Forgotten sums of the normal equations over x = (1, n, context, prefill), y = step s.
        self._xx: list[list[float]] = []
        self._xy: list[float] = []
        self._samples = 0
        self._fit: tuple[float, float] | None = None
        self._reset_fit()

    def observe(
        self, worker_id: str, load: LoadSnapshot, context_tokens: int, prefill_tokens: int = 0
    ) -> None:
        """Takes the worker's latest report; ``context_tokens`` and ``prefill_tokens``: the
        prompt tokens this router has in flight on it now, and those still to prefill (cheap
        when nothing changed)."""
        tokens, at = load.generation_tokens, load.reported_s
        last = self._gen.get(worker_id)
        if last is None or tokens != last:
            if last is not None and tokens > last:
                self._gen_new += tokens - last
            self._gen[worker_id] = tokens
        if load.decode_tokens > 0:
            self._observe_timed(worker_id, load, context_tokens, prefill_tokens)
            return
        if at <= 0.0 or self._timed:
            # No report time: nothing to measure with. Or some engine reports decode timing:
            # its samples only (a worker yet to finish a request reports none either way).
            return
        s = self._seen.get(worker_id)
        if s is None or tokens < s.tokens or at < s.at_s:  # new, or its engine restarted
            self._seen[worker_id] = _Seen(tokens, at)
            return
        dt, dn = at - s.at_s, tokens - s.tokens
        if dn < self._min_tokens or dt <= 0.0:
            return
        s.tokens, s.at_s = tokens, at
        running = load.running_requests
        if running <= 0:
            return
        self.add_sample(running, context_tokens, dt * running / dn, prefill_tokens)

    def _observe_timed(
        self, worker_id: str, load: LoadSnapshot, context_tokens: int, prefill_tokens: int
    ) -> None:
        """The engine-timed source (module doc): one sample per ``min_sample_tokens`` decoded."""
        tokens = load.decode_tokens
        if not self._timed:  # the first engine to report decode timing: the older source's
            self._reset_fit()  # samples (taken before it) go
        t = self._timed.get(worker_id)
        if t is None or tokens < t.tokens or load.decode_s < t.decode_s:  # new, or restarted
            self._timed[worker_id] = _Timed(tokens, load.decode_s)
            return
        t.looks += 1
        t.requests += max(load.running_requests, 0)
        t.context += context_tokens
        t.prefill += prefill_tokens
        dn = tokens - t.tokens
        if dn < self._min_tokens:
            return
        ds = load.decode_s - t.decode_s
        k = t.looks
        self._timed[worker_id] = _Timed(tokens, load.decode_s)
        if ds <= 0.0 or t.requests <= 0.0:
            return
        self.timed_samples += 1
        self.add_sample(t.requests / k, t.context / k, ds / dn, t.prefill / k)

    def _reset_fit(self) -> None:
        self._xx = [[0.0] * _K for _ in range(_K)]
        self._xy = [0.0] * _K
        self._samples = 0
        self._fit = None

    def add_sample(
        self, requests: float, context_tokens: float, step_s: float, prefill_tokens: float = 0.0
    ) -> None:
        """One measured step time of a worker running ``requests`` over ``context_tokens``,
        with ``prefill_tokens`` still to prefill among them."""
        x = (1.0, float(requests), float(context_tokens), float(prefill_tokens))
        keep = self._keep
        for i in range(_K):
            row = self._xx[i]
            for j in range(_K):
                row[j] = row[j] * keep + x[i] * x[j]
            self._xy[i] = self._xy[i] * keep + x[i] * step_s
        self._samples += 1
        self._fit = None

    def rates(self) -> tuple[float, float]:
        """(seq_s, context_s_per_token): the fleet's fit, else the configured rates."""
        if self._samples < self._min_samples:
            return self._default
        if self._fit is None:
            self._fit = _solve(self._xx, self._xy) or self._default
        return self._fit

    @property
    def samples(self) -> int:
        """Step-time samples taken so far (both sources)."""
        return self._samples

    def finished(self) -> None:
        """A request this router sent has finished: one more to divide the output by."""
        self._finished_new += 1
        if self._finished_new < self._min_finished:
            return
        if self._gen_new > 0:
            sample = self._gen_new / self._finished_new
            if self._decode_learned:
                self._decode_steps += 0.125 * (sample - self._decode_steps)
            else:
                self._decode_steps, self._decode_learned = sample, True
        self._gen_new = self._finished_new = 0

    def decode_steps(self) -> float:
        """Output tokens per request: measured (see ``finished``), else the configured."""
        return self._decode_steps

    def forget(self, worker_id: str) -> None:
        self._seen.pop(worker_id, None)
        self._timed.pop(worker_id, None)
        self._gen.pop(worker_id, None)


def _solve(xx: list[list[float]], xy: list[float]) -> tuple[float, float] | None:
    """The least-squares slopes (seq_s, context_s_per_token) of ``xx @ b = xy``, or None when
    the samples do not determine them (too little variety) or give a negative slope (noise: a
    step never gets cheaper with more work in it). A regressor past the first three that was
    always 0 is left out. Columns are scaled first, so a context of 1e5 tokens and a count of
    10 requests condition alike."""
    cols = [i for i in range(len(xy)) if i < 3 or xx[i][i] > 0.0]
    k = len(cols)
    scale = [max(abs(xx[i][i]), 1e-300) ** 0.5 for i in cols]
    a = [
        [xx[i][j] / (scale[r] * scale[c]) for c, j in enumerate(cols)] + [xy[i] / scale[r]]
        for r, i in enumerate(cols)
    ]
    for col in range(k):  # Gauss-Jordan with partial pivoting
        piv = max(range(col, k), key=lambda r: abs(a[r][col]))
        if abs(a[piv][col]) < 1e-9:
            return None
        a[col], a[piv] = a[piv], a[col]
        p = a[col][col]
        a[col] = [v / p for v in a[col]]
        for r in range(k):
            if r != col and a[r][col]:
                f = a[r][col]
                a[r] = [v - f * w for v, w in zip(a[r], a[col], strict=True)]
    seq, ctx = a[1][k] / scale[1], a[2][k] / scale[2]
    if seq < 0.0 or ctx < 0.0:
        return None
    return seq, ctx
