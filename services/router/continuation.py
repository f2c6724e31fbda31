"""A conversation's next prompt as an exact extension of its previous turn's tokens.

The Responses API's ``previous_response_id`` names a turn whose prompt and output token ids the
router stored. Rendering the whole conversation again through the chat template and tokenizing
it would give *nearly* those tokens: the template writes the assistant's turn its own way (tool
calls re-serialized, the end-of-turn marker), and a tokenizer may merge across the seam. Nearly
is not enough: one differing token early on and every block after it hashes differently, so the
session's hash chain and the engines' cached KV are lost. So the next prompt is built as

    previous prompt ids + previous output ids + tokens(bridge + delta)

``delta``: what the template adds after the previous assistant turn to render the new messages
(and the generation prompt): the text of the whole conversation rendered, less the text of the
conversation up to and including that assistant turn. ``bridge``: what closes the assistant's
turn in the template (ChatML: ``<|im_end|>\\n``), less what the model already wrote of it (a
model that ended on its end-of-turn token wrote ``<|im_end|>``, which leaves ``\\n``; one cut by
max_tokens wrote none of it).

Pure: the template and tokenizer come in as a ``ChatTemplate``. ``None`` means the template is
not prefix-stable for this conversation (the history renders differently once more messages
follow); the caller then renders the whole conversation instead."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

# Stands in for an assistant turn's content, to find what the template writes after it.
_PROBE = "\x00kvmesh-probe\x00"

Message = Mapping[str, Any]


class ChatTemplate(Protocol):
    """A model's chat template and tokenizer (``tokenizer.Tokenizers`` for one model)."""

    def render(
        self,
        messages: Sequence[Message],
        tools: Sequence[Mapping[str, Any]] | None,
        add_generation_prompt: bool,
    ) -> str: ...

    def encode(self, text: str) -> list[int]:
        """``text``'s ids, special tokens in it parsed, none added (the template holds them)."""
        ...

    def special_text(self, token_id: int) -> str | None:
        """The text of ``token_id`` when it is a special token (``<|im_end|>``), else None."""
        ...


@dataclass(frozen=True, slots=True)
class Prior:
    """What the router stored of the previous turn: its prompt's ids and its output's."""

    prompt_ids: Sequence[int]
    output_ids: Sequence[int]

    @property
    def token_ids(self) -> list[int]:
        return [*self.prompt_ids, *self.output_ids]


def closing(
    template: ChatTemplate,
    history: Sequence[Message],
    tools: Sequence[Mapping[str, Any]] | None,
) -> str | None:
    """What the template writes after an assistant turn's content (ChatML: ``<|im_end|>\\n``),
    probed with a plain assistant message after ``history``; None if it cannot be found."""
    probe = template.render([*history, {"role": "assistant", "content": _PROBE}], tools, False)
    if probe.count(_PROBE) != 1:
        return None
    return probe.split(_PROBE, 1)[1]


def bridge(template: ChatTemplate, output_ids: Sequence[int], close: str) -> str:
    """What follows the model's output to close its turn: ``close`` less the end-of-turn token
    the model ended on, if it did. A model that ended on another special token (an EOS the
    template does not write, as the tiny model's ``</s>``) keeps it, and the turn is closed
    after it: the prompt still extends the tokens the engine holds."""
    if output_ids:
        tail = template.special_text(output_ids[-1])
        if tail is not None and close.startswith(tail):
            return close[len(tail) :]
    return close


def extend(
    template: ChatTemplate,
    prior: Prior,
    messages: Sequence[Message],
    tools: Sequence[Mapping[str, Any]] | None,
    new_from: int,
) -> list[int] | None:
    """The next prompt's ids: ``prior``'s tokens, then the tokens that close its assistant turn
    and render ``messages[new_from:]`` (with the generation prompt). ``messages[new_from - 1]``
    is that assistant turn, ``messages[:new_from - 1]`` the conversation its prompt rendered,
    ``tools`` the tools both turns render (the caller checks they are the same). None: not an
    exact extension (the caller renders the whole conversation)."""
    if not 0 < new_from <= len(messages) or messages[new_from - 1].get("role") != "assistant":
        return None
    head = messages[:new_from]
    whole = template.render(messages, tools, True)
    upto = template.render(head, tools, False)
    if not whole.startswith(upto):
        return None
    close = closing(template, head[:-1], tools)
    if close is None or not upto.endswith(close):
        return None
    seam = bridge(template, prior.output_ids, close)
    return [*prior.token_ids, *template.encode(seam + whole[len(upto) :])]
