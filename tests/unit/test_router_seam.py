"""Stop strings across the seam of a resumed stream (services/router/core/seam.py): the text a
resumed attempt hands out, chunk by chunk, and the stop string that spans the seam."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from services.router.core.seam import Seam


@dataclass(frozen=True)
class Row:
    stops: tuple[str, ...]
    tail: str  # the text the client has
    pending: str  # held back by the failed worker
    chunks: tuple[str, ...]  # the new worker's text, one chunk each (the last one final)
    sent: tuple[str, ...]  # what is handed out per chunk
    stop: str | None = None  # the stop string that ends the request
    at: int = -1  # ... at this chunk (-1: the last)


ROWS = {
    "no-stop-nearby-passes-through": Row(
        ("END",), "hello", "", (" world", " again"), (" world", " again")
    ),
    "held-back-text-goes-first": Row(("</s>",), "a <", "/", (" b", " c"), ("/ b", " c")),
    "stop-across-sent-text-and-new": Row(
        ("STOP",), "x ST", "", ("OP y", " z"), ("",), stop="STOP", at=0
    ),
    "stop-across-pending-and-new": Row(("abc",), "x ", "a", ("b", "c", "d"), ("", ""), "abc", 1),
    "a-prefix-held-then-released": Row(("abc",), "x a", "", ("b", "x", "y"), ("", "bx", "y")),
    "stop-wholly-in-new-text-is-the-workers": Row(("ab",), "x", "", ("yy", "ab"), ("yy", "ab")),
    "text-before-the-stop-is-kept": Row(
        ("the end",), "so th", "", ("e end!",), ("",), "the end", 0
    ),
    "final-chunk-releases-what-is-held": Row(("abc",), "a", "", ("b",), ("b",)),
    "earliest-of-several-stops": Row(("zz", "yb"), "xy", "", ("bzz",), ("",), stop="yb", at=0),
}


@pytest.mark.parametrize("row", ROWS.values(), ids=ROWS.keys())
def test_seam(row: Row) -> None:
    seam = Seam(row.stops, row.tail, row.pending)
    sent: list[str] = []
    stop = None
    last = len(row.chunks) - 1
    for i, chunk in enumerate(row.chunks):
        text, stop = seam.feed(chunk, final=i == last)
        sent.append(text)
        if stop is not None:
            assert i == (row.at if row.at >= 0 else last)
            break
    assert tuple(sent) == row.sent
    assert stop == row.stop


def test_once_past_the_longest_stop_nothing_more_is_looked_at() -> None:
    seam = Seam(("abc",), "zz", "")
    assert seam.feed("qrs") == ("qrs", None)
    assert seam.done
    assert seam.feed("abc") == ("abc", None)  # the worker's own to find, not the seam's
