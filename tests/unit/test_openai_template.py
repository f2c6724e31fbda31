"""Tools and tool calls reach the model's chat template through the router's tokenizer:
``template_input`` (ChatInput -> the Hugging Face convention, checked) and ``Tokenizers`` on the
tiny model, whose template renders them hermes-style. A template that ignores tools (SmolLM2's)
still renders."""

from __future__ import annotations

import itertools
import json
import re
import shutil
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from google.protobuf import json_format

from kvmesh.errors import InvalidArgument
from kvmesh.v1 import router_pb2
from services.router.core.types import ChatMessage
from services.router.tokenizer import TemplateInput, Tokenizers, template_input

# SmolLM2-135M-Instruct's template, as its GGUF carries it: plain ChatML, no tools.
SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
    "Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}"
)

WEATHER_TOOL = {
    "type": "function",
    "name": "weather",
    "description": "Today's weather",
    "parameters_json": '{"type": "object", "properties": {"city": {"type": "string"}}}',
}


def chat(**fields: Any) -> router_pb2.ChatInput:
    return json_format.ParseDict(fields, router_pb2.ChatInput())


def agent_turns(turns: int) -> router_pb2.ChatInput:
    """An agent's history after ``turns`` tool round trips, tools offered on every turn."""
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are an agent."},
        {"role": "user", "content": "Weather in Paris, then Rome?"},
    ]
    for i, city in enumerate(["Paris", "Rome", "Oslo"][:turns]):
        call = {"id": f"c{i}", "name": "weather", "arguments": json.dumps({"city": city})}
        messages.append({"role": "assistant", "tool_calls": [call]})
        messages.append({"role": "tool", "tool_call_id": f"c{i}", "content": f"{city}: sunny"})
    return chat(messages=messages, tools=[WEATHER_TOOL])


# ---- template_input --------------------------------------------------------------------------
def test_template_input_is_the_hugging_face_convention():
    got = template_input(agent_turns(1))
    assert got.messages == (
        {"role": "system", "content": "You are an agent."},
        {"role": "user", "content": "Weather in Paris, then Rome?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "c0",
                    "type": "function",
                    "function": {"name": "weather", "arguments": {"city": "Paris"}},
                }
            ],
        },
        {"role": "tool", "content": "Paris: sunny", "tool_call_id": "c0"},
    )
    assert got.tools == (
        {
            "type": "function",
            "function": {
                "name": "weather",
                "description": "Today's weather",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
            },
        },
    )


@pytest.mark.parametrize(
    ("choice", "has_tools"),
    [
        pytest.param({}, True, id="unset"),
        pytest.param({"mode": "TOOL_CHOICE_MODE_AUTO"}, True, id="auto"),
        pytest.param({"mode": "TOOL_CHOICE_MODE_REQUIRED"}, True, id="required"),
        pytest.param(
            {"mode": "TOOL_CHOICE_MODE_FUNCTION", "function_name": "weather"}, True, id="named"
        ),
        pytest.param({"mode": "TOOL_CHOICE_MODE_NONE"}, False, id="none-hides-them"),
    ],
)
def test_tool_choice(choice: dict[str, Any], has_tools: bool):
    got = template_input(
        chat(messages=[{"role": "user", "content": "x"}], tools=[WEATHER_TOOL], tool_choice=choice)
    )
    assert (got.tools is not None) is has_tools


USER = {"role": "user", "content": "x"}


@pytest.mark.parametrize(
    ("fields", "says"),
    [
        pytest.param(
            {"messages": [{"role": "assistant", "tool_calls": [{"name": "f", "arguments": "{"}]}]},
            "chat.messages[0].tool_calls[0].arguments is not valid JSON",
            id="arguments-bad-json",
        ),
        pytest.param(
            {"messages": [{"role": "assistant", "tool_calls": [{"name": "f", "arguments": "3"}]}]},
            "chat.messages[0].tool_calls[0].arguments must be a JSON object",
            id="arguments-not-object",
        ),
        pytest.param(
            {"messages": [{"role": "assistant", "tool_calls": [{"arguments": "{}"}]}]},
            "chat.messages[0].tool_calls[0].name is empty",
            id="call-without-name",
        ),
        pytest.param(
            {"messages": [{"role": "assistant", "tool_calls": [{"name": "f", "type": "x"}]}]},
            "chat.messages[0].tool_calls[0].type is 'x'",
            id="call-type",
        ),
        pytest.param(
            {"messages": [{"role": "user", "content": "x", "tool_calls": [{"name": "f"}]}]},
            "only assistants call tools",
            id="user-calls",
        ),
        pytest.param(
            {"messages": [USER], "tools": [{"name": "f", "parameters_json": "[]"}]},
            "chat.tools[0].parameters_json must be a JSON object",
            id="schema-not-object",
        ),
        pytest.param(
            {"messages": [USER], "tools": [{"description": "d"}]},
            "chat.tools[0].name is empty",
            id="tool-without-name",
        ),
        pytest.param(
            {"messages": [USER], "tools": [{"name": "f"}, {"name": "f"}]},
            "chat.tools[1].name 'f' is defined twice",
            id="tool-twice",
        ),
        pytest.param(
            {"messages": [USER], "tool_choice": {"mode": "TOOL_CHOICE_MODE_REQUIRED"}},
            "chat.tools is empty",
            id="required-without-tools",
        ),
        pytest.param(
            {
                "messages": [USER],
                "tools": [{"name": "f"}],
                "tool_choice": {"mode": "TOOL_CHOICE_MODE_FUNCTION", "function_name": "g"},
            },
            "chat.tool_choice.function_name 'g' is not one of chat.tools (f)",
            id="named-unknown",
        ),
    ],
)
def test_template_input_errors_name_the_field(fields: dict[str, Any], says: str):
    with pytest.raises(InvalidArgument, match=re.escape(says)):
        template_input(chat(**fields))


# ---- rendered by the tiny model's template, through the router's tokenizer --------------------
@pytest.fixture(scope="module")
def tokenizers() -> Iterator[Tokenizers]:
    with ThreadPoolExecutor(1) as pool:
        yield Tokenizers(pool)


async def render(tokenizers: Tokenizers, path: Path, chat: Any) -> tuple[list[int], str]:
    ids = await tokenizers.encode_chat("m", str(path), chat)
    tok = tokenizers._load("m", str(path))
    return ids, tok.decode(ids)


async def test_tiny_renders_tools_calls_and_results(tokenizers: Tokenizers, tiny_model: Path):
    _, text = await render(tokenizers, tiny_model, template_input(agent_turns(2)))
    assert text.startswith("<|im_start|>system\nYou are an agent.\n\n# Tools\n")
    assert (
        '<tools>\n{"type": "function", "function": {"name": "weather", "description": '
        '"Today\'s weather", "parameters": {"type": "object", "properties": '
        '{"city": {"type": "string"}}}}}\n</tools>'
    ) in text
    for city in ("Paris", "Rome"):
        assert (
            "<|im_start|>assistant\n<tool_call>\n"
            f'{{"name": "weather", "arguments": {{"city": "{city}"}}}}\n</tool_call><|im_end|>\n'
            f"<|im_start|>tool\n<tool_response>\n{city}: sunny\n</tool_response><|im_end|>\n"
        ) in text
    assert text.endswith("<|im_start|>assistant\n")
    assert text.count("<|im_start|>system") == 1  # the system prompt is not repeated


async def test_each_turn_extends_the_last_prompt(tokenizers: Tokenizers, tiny_model: Path):
    """What keeps an agent's cache warm: turn n's prompt tokens start turn n+1's."""
    prompts = [
        (await render(tokenizers, tiny_model, template_input(agent_turns(n))))[0] for n in range(3)
    ]
    for shorter, longer in itertools.pairwise(prompts):
        assert longer[: len(shorter)] == shorter and len(longer) > len(shorter)


async def test_tool_choice_none_and_plain_messages(tokenizers: Tokenizers, tiny_model: Path):
    plain = [ChatMessage("user", "Hi")]
    _, text = await render(tokenizers, tiny_model, plain)
    assert text == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    hidden = chat(
        messages=[{"role": "user", "content": "Hi"}],
        tools=[WEATHER_TOOL],
        tool_choice={"mode": "TOOL_CHOICE_MODE_NONE"},
    )
    assert (await render(tokenizers, tiny_model, template_input(hidden)))[1] == text


async def test_a_template_refusal_is_invalid_argument(tokenizers: Tokenizers, tiny_model: Path):
    with pytest.raises(InvalidArgument, match="refused the messages: unknown role: robot"):
        await tokenizers.encode_chat(
            "m", str(tiny_model), TemplateInput(({"role": "robot", "content": "x"},))
        )


async def test_a_template_without_tools_ignores_them(
    tokenizers: Tokenizers, tiny_model: Path, tmp_path: Path
):
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_model / name, tmp_path / name)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["chat_template"] = SMOLLM2_TEMPLATE
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    _, text = await render(tokenizers, tmp_path, template_input(agent_turns(1)))
    assert "<tools>" not in text and "weather" not in text
    assert "<|im_start|>assistant\n<|im_end|>\n<|im_start|>tool\nParis: sunny<|im_end|>" in text
