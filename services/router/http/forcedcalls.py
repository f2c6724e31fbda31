"""Tool calls out of a completion whose tool choice was forced. Pure.

The router constrained the completion to JSON (``services/router/core/forced_tools.py``):

- ``tool_choice: "required"``: an array of ``{"name": ..., "parameters": {...}}`` objects.
  ``RequiredParser`` reads it delta by delta and gives each call once its object closes;
- a named function: the text is that call's arguments object (``named_call``; streamed, the
  arguments go out as they come, the way OpenAI streams them).

Generation cut short by ``max_tokens`` leaves a last object unclosed: what it holds stays text
(the answer's content), like any element that is not a call: a slip is shown, never a 500.
"""

from __future__ import annotations

import json

from .toolcalls import Call, Piece, Text


def _call(element: str) -> Call | None:
    try:
        obj = json.loads(element)
    except ValueError:
        return None
    if not isinstance(obj, dict):
        return None
    name, params = obj.get("name"), obj.get("parameters", {})
    if not isinstance(name, str) or not name or not isinstance(params, dict):
        return None
    return Call(name, json.dumps(params, ensure_ascii=False))


class RequiredParser:
    """Feed it the completion's deltas, then ``finish``; each returns the pieces now known."""

    def __init__(self) -> None:
        self._text = ""
        self._pos = 0  # next character to scan
        self._opened = False  # the array's '[' was seen
        self._closed = False  # its ']' was seen
        self._start = -1  # where the element being read began; -1: between elements
        self._depth = 0  # nesting inside the element
        self._in_string = False
        self._escape = False
        self._stray = -1  # where text that is no part of the array began; -1: none
        self.calls = 0

    def _element_done(self, out: list[Piece], end: int) -> None:
        element = self._text[self._start : end]
        self._start = -1
        call = _call(element)
        if call is None:
            out.append(Text(element))
        else:
            self.calls += 1
            out.append(call)

    def feed(self, delta: str) -> list[Piece]:
        out: list[Piece] = []
        self._text += delta
        text = self._text
        while self._pos < len(text) and self._stray < 0:
            ch = text[self._pos]
            if self._start >= 0:  # inside an element
                if self._in_string:
                    if self._escape:
                        self._escape = False
                    elif ch == "\\":
                        self._escape = True
                    elif ch == '"':
                        self._in_string = False
                elif ch == '"':
                    self._in_string = True
                elif ch in "{[":
                    self._depth += 1
                elif ch in "}]":
                    self._depth -= 1
                    if self._depth == 0:
                        self._element_done(out, self._pos + 1)
            elif ch.isspace() or (self._opened and not self._closed and ch == ","):
                pass
            elif not self._opened and ch == "[":
                self._opened = True
            elif self._opened and not self._closed and ch == "]":
                self._closed = True
            elif self._opened and not self._closed and ch == "{":
                self._start, self._depth = self._pos, 1
            else:  # not the array the schema asks for (an engine that did not constrain it)
                self._stray = self._pos
            self._pos += 1
        if self._stray >= 0:
            out.append(Text(text[self._stray :]))
            self._text, self._pos, self._stray = "", 0, 0  # the rest is text as it comes
        return out

    def finish(self) -> list[Piece]:
        """The unclosed element's text, if any (the completion was cut off)."""
        out: list[Piece] = []
        if self._start >= 0:
            out.append(Text(self._text[self._start :]))
            self._start = -1
        return out


def parse_required(text: str) -> tuple[str, list[Call]]:
    """A whole completion: (content, calls); content is what was not a call (often empty)."""
    parser = RequiredParser()
    pieces = parser.feed(text) + parser.finish()
    calls = [p for p in pieces if isinstance(p, Call)]
    if not calls:
        return text, []
    return "".join(p.text for p in pieces if isinstance(p, Text)).strip(), calls


def named_call(text: str, name: str) -> Call | None:
    """A whole completion for a named tool choice: the call, its arguments the text as is (cut
    short by max_tokens they are the cut JSON, and finish_reason says "length"); None when
    the model wrote nothing."""
    return Call(name, text) if text.strip() else None
