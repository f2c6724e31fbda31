"""Request validation: every rule names the field and says what to fix. Pure."""

from __future__ import annotations

from collections.abc import Sequence

from kvmesh.errors import InvalidArgument

from .types import ChatMessage, Sampling

CHAT_ROLES = frozenset({"system", "user", "assistant", "tool"})
MAX_STOP_STRINGS = 16


def check_sampling(s: Sampling) -> None:
    if s.max_tokens <= 0:
        raise InvalidArgument(f"sampling.max_tokens must be > 0 (got {s.max_tokens})")
    if s.temperature is not None and not 0.0 <= s.temperature <= 2.0:
        raise InvalidArgument(f"sampling.temperature must be in [0, 2] (got {s.temperature:g})")
    if s.top_p is not None and not 0.0 < s.top_p <= 1.0:
        raise InvalidArgument(f"sampling.top_p must be in (0, 1] (got {s.top_p:g})")
    if s.top_k is not None and s.top_k < -1:
        raise InvalidArgument(
            f"sampling.top_k must be -1, 0 (both disable it) or > 0 (got {s.top_k})"
        )
    if len(s.stop) > MAX_STOP_STRINGS:
        raise InvalidArgument(
            f"sampling.stop has {len(s.stop)} strings; at most {MAX_STOP_STRINGS}"
        )
    if any(not x for x in s.stop):
        raise InvalidArgument("sampling.stop contains an empty string; remove it")


def check_chat(messages: Sequence[ChatMessage]) -> None:
    if not messages:
        raise InvalidArgument("chat.messages is empty; send at least one message")
    for i, m in enumerate(messages):
        if m.role not in CHAT_ROLES:
            raise InvalidArgument(
                f"chat.messages[{i}].role is {m.role!r}; use one of {sorted(CHAT_ROLES)}"
            )
        if m.role == "tool" and not m.tool_call_id:
            raise InvalidArgument(
                f"chat.messages[{i}] has role 'tool' but no tool_call_id; set the id of the "
                "tool call it answers"
            )
    if all(not m.content for m in messages):
        raise InvalidArgument("chat.messages all have empty content; the prompt would be empty")


def check_text(text: str) -> None:
    if not text:
        raise InvalidArgument("text is empty; send a non-empty prompt")


def check_prompt(
    token_ids: Sequence[int], vocab_size: int, max_model_len: int, max_tokens: int
) -> None:
    """The tokenized prompt against the model: non-empty, inside the vocabulary, fits."""
    if not token_ids:
        raise InvalidArgument("the prompt has no tokens; send a non-empty prompt")
    if vocab_size > 0:
        bad = next((t for t in token_ids if t < 0 or t >= vocab_size), None)
        if bad is not None:
            raise InvalidArgument(
                f"token id {bad} is outside the model's vocabulary [0, {vocab_size})"
            )
    if max_model_len > 0:
        n = len(token_ids)
        if n >= max_model_len:
            raise InvalidArgument(
                f"the prompt has {n} tokens but the model's context is {max_model_len} tokens; "
                "shorten the prompt"
            )
        if n + max_tokens > max_model_len:
            raise InvalidArgument(
                f"prompt ({n} tokens) + max_tokens ({max_tokens}) exceeds the model's context "
                f"of {max_model_len} tokens; lower max_tokens to at most {max_model_len - n}"
            )
