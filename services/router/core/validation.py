"""Checks of the router's own inputs (text, chat messages); sampling and prompt checks are
shared with the worker in ``kvmesh.sampling``. Every rule names the field and says what to fix.
Pure."""

from __future__ import annotations

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
