"""The Responses API's next prompt extends the previous turn's tokens exactly
(``services/router/continuation.py``), on the tiny model's real tokenizer and ChatML template
with hermes tools: whatever the model wrote (an end-of-turn token, a cut-off answer, a tool
call), the new prompt starts with the previous prompt and output ids, and what follows renders
the new messages as the template would."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from services.router.continuation import Prior, bridge, closing, extend
from services.router.tokenizer import HfChatTemplate, Tokenizers

TOOLS: Any = [
    {
        "type": "function",
        "function": {
            "name": "weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
IM_END = (
    4  # the tiny tokenizer's <|im_end|> (special ids 0..4: <s> </s> <pad> <|im_start|> <|im_end|>)
)
EOS = 1  # </s>


@pytest.fixture(scope="module")
def template(tiny_model: Path) -> Iterator[HfChatTemplate]:
    with ThreadPoolExecutor(1) as pool:
        yield Tokenizers(pool).template("tiny", str(tiny_model))


def first_turn(
    template: HfChatTemplate,
    messages: list[dict[str, Any]],
    tools: Any,
    output: str,
    end: list[int],
) -> Prior:
    prompt = template.encode(template.render(messages, tools, True))
    return Prior(prompt, [*template.encode(output), *end])


@pytest.mark.parametrize(
    ("end", "case"),
    [([IM_END], "ended on <|im_end|>"), ([], "cut by max_output_tokens"), ([EOS], "ended on </s>")],
    ids=["im_end", "length", "eos"],
)
@pytest.mark.parametrize("tools", [None, TOOLS], ids=["no-tools", "tools"])
def test_next_prompt_extends_prompt_and_output(
    template: HfChatTemplate, end: list[int], case: str, tools: Any
):
    history = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi there"}]
    prior = first_turn(template, history, tools, "Hello, what next?", end)
    assistant = {"role": "assistant", "content": "Hello, what next?"}
    new = [{"role": "user", "content": "Tell me about the river."}]
    messages = [*history, assistant, *new]
    ids = extend(template, prior, messages, tools, len(history) + 1)
    assert ids is not None, case
    assert ids[: len(prior.token_ids)] == prior.token_ids
    text = template.render(messages, tools, True)
    tail = template.encode(text[len(template.render([*history, assistant], tools, False)) :])
    seam = ids[len(prior.token_ids) : len(ids) - len(tail)]
    assert ids[len(ids) - len(tail) :] == tail  # then the template's rendering of the new turn
    if end == [IM_END]:
        assert seam == template.encode("\n")  # the model closed its turn; the newline remains
    elif end == []:
        assert seam == template.encode("<|im_end|>\n")
    else:  # </s> is no end of turn in the template: the turn is closed after it
        assert seam == template.encode("<|im_end|>\n")


def test_a_tool_call_turn_then_its_result(template: HfChatTemplate):
    history = [{"role": "user", "content": "Weather in Rome?"}]
    written = '<tool_call>\n{"name": "weather", "arguments": {"city": "Rome"}}\n</tool_call>'
    prior = first_turn(template, history, TOOLS, written, [IM_END])
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "weather", "arguments": {"city": "Rome"}},
    }
    assistant = {"role": "assistant", "content": "", "tool_calls": [call]}
    result = {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}
    ids = extend(template, prior, [*history, assistant, result], TOOLS, 2)
    assert ids is not None and ids[: len(prior.token_ids)] == prior.token_ids
    tail = template.encode(
        "\n<|im_start|>tool\n<tool_response>\nsunny\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    assert ids[len(prior.token_ids) :] == tail


def test_closing_and_bridge(template: HfChatTemplate):
    close = closing(template, [{"role": "user", "content": "x"}], None)
    assert close == "<|im_end|>\n"
    assert bridge(template, [10, IM_END], close) == "\n"
    assert bridge(template, [10, 11], close) == close


def test_not_an_assistant_turn_is_no_extension(template: HfChatTemplate):
    messages = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    assert extend(template, Prior([1, 2], [3]), messages, None, 1) is None
    assert extend(template, Prior([1, 2], [3]), messages, None, 0) is None


class UnstableTemplate:
    """A template that writes the last assistant turn differently from earlier ones (as
    templates that strip past reasoning do): no exact extension is possible."""

    def render(self, messages: Any, tools: Any, add_generation_prompt: bool) -> str:
        parts = []
        for i, m in enumerate(messages):
            last = i == len(messages) - 1
            parts.append(f"[{m['role']}{'*' if last else ''}]{m['content']}")
        return "".join(parts) + ("[assistant]" if add_generation_prompt else "")

    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]

    def special_text(self, token_id: int) -> str | None:
        return None


def test_an_unstable_template_falls_back():
    messages = [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b"},
        {"role": "user", "content": "c"},
    ]
    assert extend(UnstableTemplate(), Prior([1], [2]), messages, None, 2) is None
