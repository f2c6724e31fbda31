"""Tokenization with each model's own tokenizer (and chat template).

``template_input`` turns a ``ChatInput`` (messages, structured tool calls, tools, tool choice)
into what ``apply_chat_template`` takes, in the Hugging Face convention, checking what the
template would choke on; ``Tokenizers`` renders and tokenizes it, on the calling thread
(``prompt.PromptBuilder`` runs a long prompt in the executor) or in the executor
(``encode_chat``)."""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from collections.abc import Mapping, Sequence
from concurrent.futures import Executor, Future
from dataclasses import dataclass
from typing import Any

from kvmesh.errors import InvalidArgument, Unavailable
from kvmesh.v1 import router_pb2

from .core.types import ChatMessage

log = logging.getLogger(__name__)


class Tokenizers:
    """Loads a model's Hugging Face tokenizer once, from a local directory, and runs it."""

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

    def is_loaded(self, model: str, path: str) -> bool:
        """Whether ``model``'s tokenizer is loaded (using it then costs no import or read)."""
        return self._overrides.get(model, path) in self._cache

    def preload(self, model: str, path: str) -> Future[None]:
        """Loads a model's tokenizer in the background, so its first request does not pay for
        importing transformers and reading the tokenizer (seconds). Errors surface on use."""

        def run() -> None:
            try:
                self._load(model, path)
            except Exception as exc:  # logged here; a request using it reports it
                log.warning("preloading the tokenizer of %s failed: %s", model, exc)

        return self._executor.submit(run)

    def decode_now(self, model: str, path: str, token_ids: Sequence[int]) -> str:
        """``token_ids``' text as the engine's detokenizer makes it (special tokens skipped), on
        the calling thread."""
        tok = self._load(model, path)
        return str(tok.decode(list(token_ids), skip_special_tokens=True))

    def encode_text_now(self, model: str, path: str, text: str) -> list[int]:
        """``text``'s token ids, on the calling thread."""
        tok = self._load(model, path)
        return list(tok(text, add_special_tokens=True)["input_ids"])

    def encode_chat_now(
        self, model: str, path: str, chat: TemplateInput | Sequence[ChatMessage]
    ) -> list[int]:
        """The prompt's token ids: ``chat`` (``template_input(request.chat)``, or plain messages
        without tools) rendered with the model's chat template plus the generation prompt, on
        the calling thread."""
        from jinja2 import TemplateError, TemplateSyntaxError

        if not isinstance(chat, TemplateInput):
            chat = TemplateInput(tuple(_as_dict(m) for m in chat))
        messages = list(chat.messages)
        tools = list(chat.tools) if chat.tools else None
        tok = self._load(model, path)
        if not getattr(tok, "chat_template", None):
            raise InvalidArgument(
                f"model {model!r} has no chat template; send text or token_ids instead"
            )
        try:
            rendered = tok.apply_chat_template(
                messages, tools=tools, tokenize=False, add_generation_prompt=True
            )
        except TemplateSyntaxError:  # a broken template: the model's fault, not the caller's
            raise
        except TemplateError as exc:  # the template's raise_exception: a caller's mistake
            raise InvalidArgument(
                f"the chat template of model {model!r} refused the messages: {exc}",
                "chat.messages",
            ) from None
        # The template already holds the special tokens (BOS included), as vLLM does.
        return list(tok(rendered, add_special_tokens=False)["input_ids"])

    def template(self, model: str, path: str) -> HfChatTemplate:
        """``model``'s chat template and tokenizer as ``continuation.ChatTemplate`` (loaded on
        the calling thread)."""
        tok = self._load(model, path)
        if not getattr(tok, "chat_template", None):
            raise InvalidArgument(
                f"model {model!r} has no chat template; send text or token_ids instead"
            )
        return HfChatTemplate(model, tok)

    async def encode_chat(
        self, model: str, path: str, chat: TemplateInput | Sequence[ChatMessage]
    ) -> list[int]:
        """``encode_chat_now`` in the executor, so a long prompt never blocks the loop."""
        return await asyncio.get_running_loop().run_in_executor(
            self._executor, self.encode_chat_now, model, path, chat
        )


class HfChatTemplate:
    """A Hugging Face tokenizer's chat template and tokenizer, as ``continuation.ChatTemplate``
    (the Responses API's next prompt, extending its previous turn's tokens)."""

    def __init__(self, model: str, tok: Any) -> None:
        self._model = model
        self._tok = tok
        self._special = frozenset(int(i) for i in tok.all_special_ids)

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None,
        add_generation_prompt: bool,
    ) -> str:
        from jinja2 import TemplateError, TemplateSyntaxError

        try:
            return str(
                self._tok.apply_chat_template(
                    [dict(m) for m in messages],
                    tools=[dict(t) for t in tools] if tools else None,
                    tokenize=False,
                    add_generation_prompt=add_generation_prompt,
                )
            )
        except TemplateSyntaxError:
            raise
        except TemplateError as exc:
            raise InvalidArgument(
                f"the chat template of model {self._model!r} refused the messages: {exc}",
                "chat.messages",
            ) from None

    def encode(self, text: str) -> list[int]:
        return list(self._tok(text, add_special_tokens=False)["input_ids"])

    def special_text(self, token_id: int) -> str | None:
        if token_id not in self._special:
            return None
        return str(self._tok.decode([token_id], skip_special_tokens=False))


@dataclass(frozen=True, slots=True)
class TemplateInput:
    """What ``apply_chat_template`` gets, in the Hugging Face convention: messages (an
    assistant's ``tool_calls`` as ``{"id", "type": "function", "function": {"name",
    "arguments": <parsed JSON object>}}``) and tools (``{"type": "function", "function": {"name",
    "description", "parameters"}}``; None: the template sees no tools)."""

    messages: tuple[dict[str, Any], ...]
    tools: tuple[dict[str, Any], ...] | None = None


def _as_dict(m: ChatMessage) -> dict[str, Any]:
    d: dict[str, Any] = {"role": m.role, "content": m.content}
    if m.name:
        d["name"] = m.name
    if m.tool_call_id:
        d["tool_call_id"] = m.tool_call_id
    return d


def _json_object(text: str, field: str) -> dict[str, Any]:
    """``text`` as a JSON object; empty means {}."""
    if not text.strip():
        return {}
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise InvalidArgument(f"{field} is not valid JSON ({exc}); send a JSON object") from None
    if not isinstance(value, dict):
        raise InvalidArgument(f"{field} must be a JSON object (got {text[:60]!r})")
    return value


def _check_type(kind: str, field: str) -> None:
    if kind not in ("", "function"):
        raise InvalidArgument(f"{field} is {kind!r}; only 'function' tools are supported")


def _tool_call(call: router_pb2.ToolCall, field: str) -> dict[str, Any]:
    _check_type(call.type, f"{field}.type")
    if not call.name:
        raise InvalidArgument(f"{field}.name is empty; name the function called")
    return {
        "id": call.id,
        "type": "function",
        "function": {
            "name": call.name,
            "arguments": _json_object(call.arguments, f"{field}.arguments"),
        },
    }


def _tool(tool: router_pb2.Tool, field: str) -> dict[str, Any]:
    _check_type(tool.type, f"{field}.type")
    if not tool.name:
        raise InvalidArgument(f"{field}.name is empty; name the function")
    fn: dict[str, Any] = {"name": tool.name}
    if tool.description:
        fn["description"] = tool.description
    if tool.parameters_json:
        fn["parameters"] = _json_object(tool.parameters_json, f"{field}.parameters_json")
    return {"type": "function", "function": fn}


def template_input(chat: router_pb2.ChatInput) -> TemplateInput:
    """``chat`` in the chat template's terms. INVALID_ARGUMENT, naming the field, for arguments
    or schemas that are not JSON objects, nameless or non-function tools, a tool defined twice,
    and a tool choice naming no given tool. Tool choice NONE leaves the tools out."""
    messages = []
    for i, m in enumerate(chat.messages):
        d = _as_dict(ChatMessage(m.role, m.content, m.name, m.tool_call_id))
        if m.tool_calls:
            field = f"chat.messages[{i}].tool_calls"
            if m.role != "assistant":
                raise InvalidArgument(
                    f"{field} is set on a {m.role!r} message; only assistants call tools"
                )
            d["tool_calls"] = [_tool_call(c, f"{field}[{j}]") for j, c in enumerate(m.tool_calls)]
        messages.append(d)
    tools = [_tool(t, f"chat.tools[{j}]") for j, t in enumerate(chat.tools)]
    names = [t.name for t in chat.tools]
    for j, name in enumerate(names):
        if name in names[:j]:
            raise InvalidArgument(f"chat.tools[{j}].name {name!r} is defined twice")
    choice = chat.tool_choice
    forcing = (router_pb2.TOOL_CHOICE_MODE_REQUIRED, router_pb2.TOOL_CHOICE_MODE_FUNCTION)
    if choice.mode in forcing and not tools:
        raise InvalidArgument("chat.tool_choice asks for a tool call but chat.tools is empty")
    if choice.mode == router_pb2.TOOL_CHOICE_MODE_FUNCTION and choice.function_name not in names:
        raise InvalidArgument(
            f"chat.tool_choice.function_name {choice.function_name!r} is not one of chat.tools "
            f"({', '.join(names)})"
        )
    if choice.mode == router_pb2.TOOL_CHOICE_MODE_NONE or not tools:
        return TemplateInput(tuple(messages))
    return TemplateInput(tuple(messages), tuple(tools))
