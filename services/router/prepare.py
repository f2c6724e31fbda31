"""A ``GenerateRequest``'s parts as the router serves them: its prompt input (checked), and a
forced tool choice (``tool_choice`` required or a named function) as the structured output that
constrains the answer to the calls (``core/forced_tools.py``)."""

from __future__ import annotations

import json

from kvmesh import errors
from kvmesh.sampling import structured_output_pb
from kvmesh.v1 import common_pb2, router_pb2

from .core import validation
from .core.forced_tools import ForcedChoice, ForcedKind, ToolDef, forced_output
from .core.types import ChatMessage
from .prompt import PromptInput
from .tokenizer import template_input


def prompt_input(request: router_pb2.GenerateRequest) -> PromptInput:
    kind = request.WhichOneof("input")
    if kind == "text":
        validation.check_text(request.text)
        return PromptInput(text=request.text)
    if kind == "chat":
        messages = [
            ChatMessage(m.role, m.content, m.name, m.tool_call_id) for m in request.chat.messages
        ]
        validation.check_chat(messages)
        return PromptInput(chat=template_input(request.chat))  # tool calls and tools, checked
    if kind == "token_ids":
        return PromptInput(token_ids=request.token_ids.ids)
    raise errors.InvalidArgument("no input: set one of text, chat or token_ids")


def constrained_sampling(
    request: router_pb2.GenerateRequest, forced: ForcedChoice | None
) -> common_pb2.SamplingParams:
    """The request's sampling; with a forced tool choice, constrained to the tool calls
    whatever else was asked."""
    if forced is None:
        return request.sampling
    sampling_pb = common_pb2.SamplingParams()
    sampling_pb.CopyFrom(request.sampling)
    sampling_pb.structured_output.CopyFrom(
        structured_output_pb(
            forced_output(forced, tool_defs(request.chat)), common_pb2.StructuredOutput
        )
    )
    return sampling_pb


def forced_choice(request: router_pb2.GenerateRequest) -> ForcedChoice | None:
    """A chat request's tool choice when it forces a call (REQUIRED, FUNCTION), else None."""
    if request.WhichOneof("input") != "chat":
        return None
    choice = request.chat.tool_choice
    if choice.mode == router_pb2.TOOL_CHOICE_MODE_REQUIRED:
        return ForcedChoice(ForcedKind.REQUIRED)
    if choice.mode == router_pb2.TOOL_CHOICE_MODE_FUNCTION:
        return ForcedChoice(ForcedKind.FUNCTION, choice.function_name)
    return None


def tool_defs(chat: router_pb2.ChatInput) -> list[ToolDef]:
    """``chat.tools`` with their parameter schemas parsed (``template_input`` checked them)."""
    return [
        ToolDef(t.name, json.loads(t.parameters_json) if t.parameters_json else None)
        for t in chat.tools
    ]
