"""Tokenization with each model's own tokenizer (and chat template), off the event loop."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Sequence
from concurrent.futures import Executor, Future
from typing import Any

from kvmesh.errors import InvalidArgument, Unavailable

from .core.types import ChatMessage

log = logging.getLogger(__name__)


class Tokenizers:
    """Loads a model's Hugging Face tokenizer once, from a local directory, and runs it in an
    executor so a long prompt never blocks the router's loop."""

    def __init__(self, executor: Executor, overrides: dict[str, str] | None = None) -> None:
        self._executor = executor
        self._overrides = dict(overrides or {})  # model name -> tokenizer path
        self._cache: dict[str, Any] = {}
        self._lock = threading.Lock()

    def _load(self, model: str, path: str) -> Any:
        path = self._overrides.get(model, path)
        with self._lock:
            tok = self._cache.get(path)
            if tok is None:
                from transformers import AutoTokenizer

                try:
                    tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
                except (OSError, ValueError) as exc:
                    raise Unavailable(
                        f"cannot load the tokenizer of model {model!r} from {path!r}: {exc}; "
                        "the router needs the model directory (or --tokenizer MODEL=PATH)"
                    ) from exc
                self._cache[path] = tok
                log.info("loaded tokenizer for model %s from %s", model, path)
            return tok

    def preload(self, model: str, path: str) -> Future[None]:
        """Loads a model's tokenizer in the background, so its first request does not pay for
        importing transformers and reading the tokenizer (seconds). Errors surface on use."""

        def run() -> None:
            try:
                self._load(model, path)
            except Exception as exc:  # logged here; a request using it reports it
                log.warning("preloading the tokenizer of %s failed: %s", model, exc)

        return self._executor.submit(run)

    async def encode_text(self, model: str, path: str, text: str) -> list[int]:
        def run() -> list[int]:
            tok = self._load(model, path)
            return list(tok(text, add_special_tokens=True)["input_ids"])

        return await asyncio.get_running_loop().run_in_executor(self._executor, run)

    async def encode_chat(
        self, model: str, path: str, messages: Sequence[ChatMessage]
    ) -> list[int]:
        def run() -> list[int]:
            tok = self._load(model, path)
            if not getattr(tok, "chat_template", None):
                raise InvalidArgument(
                    f"model {model!r} has no chat template; send text or token_ids instead"
                )
            rendered = tok.apply_chat_template(
                [_as_dict(m) for m in messages], tokenize=False, add_generation_prompt=True
            )
            # The template already holds the special tokens (BOS included), as vLLM does.
            return list(tok(rendered, add_special_tokens=False)["input_ids"])

        return await asyncio.get_running_loop().run_in_executor(self._executor, run)


def _as_dict(m: ChatMessage) -> dict[str, str]:
    d = {"role": m.role, "content": m.content}
    if m.name:
        d["name"] = m.name
    if m.tool_call_id:
        d["tool_call_id"] = m.tool_call_id
    return d
