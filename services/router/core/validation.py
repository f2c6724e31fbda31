"""Checks of the router's own inputs (text, chat messages); sampling and prompt checks are
shared with the worker in ``kvmesh.sampling``. Every rule names the field and says what to fix.
Pure."""

from __future__ import annotations

import math
from collections.abc import Sequence

from kvmesh.errors import InvalidArgument

from .types import ChatMessage

CHAT_ROLES = frozenset({"system", "user", "assistant", "tool"})


def check_chat(messages: Sequence[ChatMessage]) -> None:
    if not messages:
        raise InvalidArgument("chat.messages is empty; send at least one message", "chat.messages")
    for i, m in enumerate(messages):
        if m.role not in CHAT_ROLES:
            raise InvalidArgument(
                f"chat.messages[{i}].role is {m.role!r}; use one of {sorted(CHAT_ROLES)}",
                f"chat.messages[{i}].role",
            )
        if m.role == "tool" and not m.tool_call_id:
            raise InvalidArgument(
                f"chat.messages[{i}] has role 'tool' but no tool_call_id; set the id of the "
                "tool call it answers",
                f"chat.messages[{i}].tool_call_id",
            )
    if all(not m.content for m in messages):
        raise InvalidArgument(
            "chat.messages all have empty content; the prompt would be empty", "chat.messages"
        )


def check_text(text: str) -> None:
    if not text:
        raise InvalidArgument("text is empty; send a non-empty prompt", "text")


def check_resume(
    token_ids: Sequence[int],
    text: str,
    max_tokens: int,
    vocab_size: int,
    not_resumable: str,
    time_to_first_token_s: float = 0.0,
) -> None:
    """A client's resume (``GenerateRequest.resume``: the tokens it has of the answer) against
    the request: resumable, within its max_tokens, inside the vocabulary, a time to first token
    that is a duration."""
    if not (math.isfinite(time_to_first_token_s) and time_to_first_token_s >= 0):
        raise InvalidArgument(
            f"resume.time_to_first_token_s must be a finite number of seconds >= 0 (0: "
            f"unknown), got {time_to_first_token_s}",
            "resume.time_to_first_token_s",
        )
    if not token_ids:
        if text:
            raise InvalidArgument(
                "resume.text is set but resume.token_ids is empty; send the token ids received "
                "(or no resume at all)",
                "resume.token_ids",
            )
        return
    if not_resumable:
        raise InvalidArgument(
            f"this request cannot be resumed ({not_resumable}); send it again without resume",
            "resume",
        )
    if len(token_ids) > max_tokens:
        raise InvalidArgument(
            f"resume.token_ids has {len(token_ids)} tokens but sampling.max_tokens is "
            f"{max_tokens}: a resumed request goes on within its original max_tokens; send the "
            "request as first sent, with only the tokens it streamed",
            "resume.token_ids",
        )
    bad = next((t for t in token_ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise InvalidArgument(
            f"resume.token_ids has token id {bad}, outside the model's vocabulary "
            f"[0, {vocab_size})",
            "resume.token_ids",
        )
