"""Tool calls in a completion, the hermes / Qwen2.5 way: each call is a block
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` in the model's text. Pure.

``StreamParser`` reads the completion delta by delta and says what each piece is: text for the
answer's content, or a whole call once its block closes. Text that could be the start of a
``<tool_call>`` tag is held back until it is known. A block whose inside is not a JSON object
with a string ``name`` (and an object, or a string holding one, as ``arguments``) stays text,
tags included: a model's slip is shown, never an error. An unclosed block at the end counts as
a call if its inside parses (generation may stop before the closing tag); otherwise it is text.
Whitespace between calls and around them is dropped once a call was found; without calls the
text comes through unchanged. ``parse`` does the same for a whole completion.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

START, END = "<tool_call>", "</tool_call>"


@dataclass(frozen=True, slots=True)
class Call:
    name: str
    arguments: str  # a JSON object, as text


@dataclass(frozen=True, slots=True)
class Text:
    text: str


Piece = Text | Call


def parse_call(inside: str) -> Call | None:
    """The call a block holds, or None when it does not hold one."""
    try:
        obj = json.loads(inside)
    except ValueError:
        return None
    if not isinstance(obj, dict):
        return None
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # a model that encoded the object itself
        try:
            decoded = json.loads(args) if args.strip() else {}
        except ValueError:
            return None
        if not isinstance(decoded, dict):
            return None
        return Call(name, args if args.strip() else "{}")
    if not isinstance(args, dict):
        return None
    return Call(name, json.dumps(args, ensure_ascii=False))


def _held_prefix(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that starts ``tag`` (and is shorter than it)."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class StreamParser:
    """Feed it the completion's text deltas, then ``finish``; each returns the pieces now known."""

    def __init__(self) -> None:
        self._buf = ""  # a possible start tag's beginning, or a block's inside so far
        self._inside = False
        self._space = ""  # trailing whitespace of the text so far, held until more text comes
        self._strip_next = False  # the text right after a call loses its leading whitespace
        self.calls = 0

    def _text(self, out: list[Piece], text: str) -> None:
        if self._strip_next:
            text = text.lstrip()
            if not text:
                return
            self._strip_next = False
        body = text.rstrip()
        if body:
            out.append(Text(self._space + body))
            self._space = text[len(body) :]
        else:
            self._space += text

    def _call(self, out: list[Piece], call: Call) -> None:
        self._space = ""
        self._strip_next = True
        self.calls += 1
        out.append(call)

    def feed(self, delta: str) -> list[Piece]:
        out: list[Piece] = []
        self._buf += delta
        while True:
            if self._inside:
                end = self._buf.find(END)
                if end < 0:
                    return out
                inside, self._buf = self._buf[:end], self._buf[end + len(END) :]
                self._inside = False
                call = parse_call(inside)
                if call is None:
                    self._text(out, START + inside + END)
                else:
                    self._call(out, call)
                continue
            start = self._buf.find(START)
            if start >= 0:
                self._text(out, self._buf[:start])
                self._buf = self._buf[start + len(START) :]
                self._inside = True
                continue
            keep = _held_prefix(self._buf, START)
            self._text(out, self._buf[: len(self._buf) - keep])
            self._buf = self._buf[len(self._buf) - keep :]
            return out

    def finish(self) -> list[Piece]:
        out: list[Piece] = []
        rest, self._buf = self._buf, ""
        if self._inside:
            self._inside = False
            call = parse_call(rest)
            if call is None:
                self._text(out, START + rest)
            else:
                self._call(out, call)
        elif rest:
            self._text(out, rest)
        if self._space and not self.calls:
            out.append(Text(self._space))
        self._space = ""
        return out


def parse(text: str) -> tuple[str, list[Call]]:
    """A whole completion: (content, calls). Without calls the content is ``text`` unchanged;
    with calls it is the text around them, stripped (possibly empty)."""
    parser = StreamParser()
    pieces = parser.feed(text) + parser.finish()
    calls = [p for p in pieces if isinstance(p, Call)]
    if not calls:
        return text, []
    return "".join(p.text for p in pieces if isinstance(p, Text)).strip(), calls
