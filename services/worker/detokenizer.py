"""A fix of vLLM's streamed text for a prompt whose text ends inside a character.

vLLM's fast detokenizer primes each request's ``DecodeStream`` with the whole prompt
(``DecodeStream(ids=prompt_token_ids)``). When the prompt's text ends inside a character (byte
tokens of one character split between the prompt and the output: emoji, CJK and the like on
byte-level tokenizers) the stream establishes no text prefix, and its first text is the text of
the *whole prompt* followed by the new tokens': the client is sent its own prompt, and a stop
string found in that text stops the request (vllm-project/vllm#48853, open for vLLM 0.32).

For kvmesh this is no corner case: a request resumed after its worker died mid-stream
(docs/failover.md) goes on with prompt + the tokens the client has, and those end wherever the
first worker stopped, inside a character as likely as anywhere else. The worker therefore
primes the stream itself when the prompt ends inside a character: with the prompt's last
``CONTEXT_TOKENS`` tokens up to its last complete character, then the unfinished character's
tokens (which have no text yet: their character comes with the first new token's text, as an
uninterrupted stream sends it). A prompt that ends with a whole character keeps vLLM's stream;
checking that costs one decode of the prompt's last tokens per request.

``install()`` applies it to vLLM's ``FastIncrementalDetokenizer`` in this process (the worker's
AsyncLLM detokenizes in the worker's process).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence
from typing import Any

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

log = logging.getLogger(__name__)

REPLACEMENT = "\ufffd"  # what a decoder writes for bytes that are not (yet) a character
CONTEXT_TOKENS = 8  # prompt tokens the stream is primed with (a decoder's leading-space rules)
MAX_UNFINISHED_TOKENS = 8  # tokens one unfinished character may span (4 bytes, and more)


def primed_stream(
    tokenizer: Tokenizer, prompt_ids: Sequence[int], skip_special_tokens: bool
) -> DecodeStream | None:
    """A decode stream primed with ``prompt_ids`` that hands out only the new tokens' text,
    when the prompt's text ends inside a character; None when it does not (vLLM's own stream
    is right then) or when the end of the prompt is not text at all (more than
    ``MAX_UNFINISHED_TOKENS`` tokens without a whole character: left to vLLM)."""

    def ends_inside(upto: int) -> bool:
        window = list(prompt_ids[max(upto - CONTEXT_TOKENS, 0) : upto])
        text = tokenizer.decode(window, skip_special_tokens=skip_special_tokens)
        return text.endswith(REPLACEMENT)

    end = len(prompt_ids)
    if end == 0 or not ends_inside(end):
        return None
    upto = end - 1
    while upto > 0 and ends_inside(upto):
        if end - upto >= MAX_UNFINISHED_TOKENS:
            return None
        upto -= 1
    stream = DecodeStream(
        ids=list(prompt_ids[max(upto - CONTEXT_TOKENS, 0) : upto]),
        skip_special_tokens=skip_special_tokens,
    )
    for token_id in prompt_ids[upto:]:
        if stream.step(tokenizer, token_id):  # never: each ends inside the character
            return None
    return stream


def install() -> bool:
    """Primes vLLM's fast detokenizer streams with ``primed_stream`` in this process (once).
    False, with a warning, when this vLLM's detokenizer is not the shape this was written
    for (then vLLM's own streams are used)."""
    try:
        from vllm.v1.engine.detokenizer import FastIncrementalDetokenizer
    except ImportError:
        log.warning("vLLM has no FastIncrementalDetokenizer; its streams are not primed")
        return False
    original = FastIncrementalDetokenizer.__init__
    if getattr(original, "_kvmesh_primed", False):
        return True

    @functools.wraps(original)
    def __init__(self: Any, tokenizer: Any, request: Any) -> None:
        original(self, tokenizer, request)
        ids = request.prompt_token_ids
        if not ids or not isinstance(getattr(self, "tokenizer", None), Tokenizer):
            return
        stream = primed_stream(self.tokenizer, ids, self.skip_special_tokens)
        if stream is not None:
            self.stream = stream

    __init__._kvmesh_primed = True  # type: ignore[attr-defined]
    FastIncrementalDetokenizer.__init__ = __init__  # type: ignore[method-assign]
    return True
