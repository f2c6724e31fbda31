"""A request's prompt: its token ids and block hashes, in one step.

Tokenizing (and rendering a chat template) and hashing are pure CPU work. A long prompt runs
in the router's executor, both steps in one job, so the loop stays responsive; a short one runs
on the loop itself, where two hops to a thread and back would cost more than the work (the
hops are a wake-up of another thread each way, which on a busy service core means waiting for
the scheduler: time added to every request's TTFT). ``inline_tokens`` draws the line, on an
estimate made before tokenizing (token ids: their count; text: characters / 3, a generous
estimate for BPE tokenizers, so a long text is never misjudged short).

The tokenize and hash spans are kept either way (in the executor their times are taken there
and the spans made afterwards), so a trace looks the same on both paths.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass

from opentelemetry import trace

from kvmesh.kv.hashing import SessionHashes
from kvmesh.telemetry import tracer

from . import continuation
from .continuation import Prior
from .hashing import PromptHasher
from .tokenizer import TemplateInput, Tokenizers

_tracer = tracer(__name__)

CHARS_PER_TOKEN_ESTIMATE = 3  # text length / this bounds its token count from above, mostly


@dataclass(frozen=True, slots=True)
class PromptInput:
    """What to tokenize: exactly one of ``text``, ``chat`` or ``token_ids``."""

    text: str | None = None
    chat: TemplateInput | None = None
    token_ids: Sequence[int] | None = None

    def estimated_tokens(self) -> int:
        if self.token_ids is not None:
            return len(self.token_ids)
        if self.text is not None:
            return len(self.text) // CHARS_PER_TOKEN_ESTIMATE
        chat = self.chat
        assert chat is not None
        chars = sum(len(str(m.get("content") or "")) for m in chat.messages)
        chars += sum(len(str(t)) for t in chat.tools or ())
        return chars // CHARS_PER_TOKEN_ESTIMATE


@dataclass(frozen=True, slots=True)
class Prompt:
    token_ids: list[int]
    hashed: SessionHashes
    inline: bool  # made on the event loop (short prompt), not in the executor


class PromptBuilder:
    def __init__(
        self,
        tokenizers: Tokenizers,
        hasher: PromptHasher,
        executor: Executor,
        inline_tokens: int = 2048,
    ) -> None:
        self._tokenizers = tokenizers
        self._hasher = hasher
        self._executor = executor
        self._inline_tokens = inline_tokens

    def _encoder(self, model: str, path: str, source: PromptInput) -> Callable[[], list[int]]:
        if source.token_ids is not None:
            ids = source.token_ids
            return lambda: list(ids)
        if source.text is not None:
            text = source.text
            return lambda: self._tokenizers.encode_text_now(model, path, text)
        chat = source.chat
        assert chat is not None
        return lambda: self._tokenizers.encode_chat_now(model, path, chat)

    async def build(
        self,
        model: str,
        path: str,
        block_size: int,
        session_id: str,
        source: PromptInput,
        check: Callable[[list[int]], None],
        cache_salt: str = "",
    ) -> Prompt:
        """The prompt's ids and hashes (salted with ``cache_salt``, as the engine will hash
        them); ``check`` vets the ids before they are hashed (it raises for a prompt the model
        cannot take)."""
        encode = self._encoder(model, path, source)
        if self._inline(model, path, source):
            with _tracer.start_as_current_span("tokenize") as span:
                ids = encode()
                span.set_attribute("prompt_tokens", len(ids))
            check(ids)
            with _tracer.start_as_current_span("hash") as span:
                hashed = self._hasher.hash(block_size, session_id, ids, cache_salt)
                _hash_attributes(span, hashed)
            return Prompt(ids, hashed, inline=True)

        return await self._in_executor(block_size, session_id, encode, check, cache_salt)

    def _inline(self, model: str, path: str, source: PromptInput) -> bool:
        """Whether ``source`` is short enough to tokenize on the loop (tokenizer loaded)."""
        return source.estimated_tokens() <= self._inline_tokens and (
            source.token_ids is not None or self._tokenizers.is_loaded(model, path)
        )

    async def count(self, model: str, path: str, source: PromptInput) -> int:
        """How many tokens ``source`` is, without hashing (count_tokens); a long one is
        tokenized in the executor."""
        encode = self._encoder(model, path, source)
        if self._inline(model, path, source):
            return len(encode())
        loop = asyncio.get_running_loop()
        return len(await loop.run_in_executor(self._executor, encode))

    async def render(
        self,
        model: str,
        path: str,
        chat: TemplateInput,
        prior: Prior | None = None,
        new_from: int = 0,
    ) -> tuple[list[int], bool]:
        """``chat``'s prompt ids, and whether they extend ``prior`` exactly: its stored prompt
        and output ids, then the new messages ``chat.messages[new_from:]`` (the Responses API's
        ``previous_response_id``: ``continuation.extend``); when they cannot, or without a
        prior, the whole conversation rendered. A long one in the executor."""

        def job() -> tuple[list[int], bool]:
            if prior is not None:
                template = self._tokenizers.template(model, path)
                ids = continuation.extend(template, prior, chat.messages, chat.tools, new_from)
                if ids is not None:
                    return ids, True
            return self._tokenizers.encode_chat_now(model, path, chat), False

        if self._inline(model, path, PromptInput(chat=chat)):
            return job()
        return await asyncio.get_running_loop().run_in_executor(self._executor, job)

    async def decode(self, model: str, path: str, token_ids: Sequence[int]) -> str:
        """``token_ids``' text, in the executor (a resumed stream's seam: docs/failover.md)."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(
            self._executor, self._tokenizers.decode_now, model, path, token_ids
        )

    async def _in_executor(
        self,
        block_size: int,
        session_id: str,
        encode: Callable[[], list[int]],
        check: Callable[[list[int]], None],
        cache_salt: str,
    ) -> Prompt:
        def job() -> tuple[list[int], SessionHashes, tuple[int, int, int, int]]:
            t0 = time.time_ns()
            ids = encode()
            t1 = time.time_ns()
            check(ids)
            t2 = time.time_ns()
            hashed = self._hasher.hash(block_size, session_id, ids, cache_salt)
            return ids, hashed, (t0, t1, t2, time.time_ns())

        loop = asyncio.get_running_loop()
        started = time.time_ns()
        try:
            ids, hashed, (t0, t1, t2, t3) = await loop.run_in_executor(self._executor, job)
        except Exception as exc:  # the span shows the failure, as the inline path's does
            span = _tracer.start_span("tokenize", start_time=started)
            span.record_exception(exc)
            span.set_status(trace.Status(trace.StatusCode.ERROR, type(exc).__name__))
            span.end()
            raise
        span = _tracer.start_span("tokenize", start_time=t0)
        span.set_attribute("prompt_tokens", len(ids))
        span.end(end_time=t1)
        span = _tracer.start_span("hash", start_time=t2)
        _hash_attributes(span, hashed)
        span.end(end_time=t3)
        return Prompt(ids, hashed, inline=False)


def _hash_attributes(span: trace.Span, hashed: SessionHashes) -> None:
    span.set_attribute("blocks", len(hashed.hashes))
    span.set_attribute("reused_blocks", hashed.reused_blocks)
