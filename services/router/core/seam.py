"""Stop strings across the seam of a resumed stream (docs/failover.md). Pure: no grpc or I/O.

A request resumed on another worker (``lifecycle.Action.RESUME_ELSEWHERE``) goes on from the
text the client has. The new worker checks its stop strings in its own output only, so a stop
string that begins before the seam (in the text already sent, or in the text the first worker
held back because it could be the start of one) and ends after it would go unnoticed. ``Seam``
watches the resumed attempt's first characters for exactly those, holding back what could still
be the start of one, as vLLM's detokenizer holds back its stop buffer. Once the new text is
longer than the longest stop string, nothing can span the seam any more and ``Seam`` is done:
the stream passes through untouched (no per-token work for the rest of the request).

Coordinates: ``tail`` is the end of the text the client has, ``pending`` the first worker's
held-back text (to send now: the client has its tokens, not yet their text), then the new
worker's text. A stop string found is cut with what follows, as vLLM does
(``include_stop_str_in_output`` off); the part of one already sent cannot be taken back.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class Seam:
    stops: tuple[str, ...]  # the request's stop strings (non-empty ones)
    tail: str  # the last characters the client has (at most the longest stop string's)
    pending: str = ""  # held back by the first worker: sent before the new worker's text
    stream: str = field(default="", init=False)  # pending + the new worker's text so far
    sent: int = field(default=0, init=False)  # characters of ``stream`` handed out
    done: bool = field(default=False, init=False)  # nothing can span the seam any more

    def __post_init__(self) -> None:
        self.stream = self.pending
        self.done = not self.stops

    def feed(self, text: str, final: bool = False) -> tuple[str, str | None]:
        """The text to send for a new chunk of the resumed attempt (``final``: its last), and
        the stop string that spans the seam when one does (the request ends there)."""
        if self.done:
            return text, None
        self.stream += text
        window = self.tail + self.stream
        seam = len(self.tail) + len(self.pending)  # where the new worker's text starts
        start, stop = _first_spanning(window, seam, self.stops)
        if stop is not None:
            cut = max(start - len(self.tail), self.sent)
            out = self.stream[self.sent : cut]
            self.sent, self.done = len(self.stream), True
            return out, stop
        longest = max(len(s) for s in self.stops)
        if final or len(self.stream) - len(self.pending) >= longest - 1:
            self.done = True  # no stop string can span the seam any more
            hold = len(self.stream)
        else:
            hold = max(_hold_from(window, seam, self.stops) - len(self.tail), self.sent)
        out = self.stream[self.sent : hold]
        self.sent = hold
        return out, None


def _first_spanning(window: str, seam: int, stops: tuple[str, ...]) -> tuple[int, str | None]:
    """The earliest stop string in ``window`` that starts before ``seam`` and ends after it."""
    best, found = len(window), None
    for s in stops:
        i = window.find(s, max(0, seam - len(s) + 1))
        if 0 <= i < seam and i < best:
            best, found = i, s
    return best, found


def _hold_from(window: str, seam: int, stops: tuple[str, ...]) -> int:
    """Where in ``window`` a stop string spanning the seam could still start (the text from
    there is held back); ``len(window)`` when none can."""
    longest = max(len(s) for s in stops)
    for p in range(max(0, seam - longest + 1), seam):
        rest = window[p:]
        if any(len(rest) < len(s) and s.startswith(rest) for s in stops):
            return p
    return len(window)
