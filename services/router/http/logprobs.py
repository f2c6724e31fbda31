"""Log probabilities and ``echo`` at the OpenAI front door. Pure: request fields in (checked,
named on error, as vLLM's server checks them), ``kvmesh.v1`` ``TokenLogprob`` entries out in the
OpenAI shapes.

Chat: ``logprobs: true`` with ``top_logprobs: n`` gives ``choices[].logprobs.content[]``, one
``{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}`` per completion token, the
``n`` most likely first. Completions: ``logprobs: n`` gives ``choices[].logprobs`` as
``{tokens, token_logprobs, top_logprobs: [{token: logprob}], text_offset}``, each
``top_logprobs`` entry the token itself and the ``n`` most likely (up to ``n`` + 1, as the
OpenAI API says). ``echo`` puts the prompt before the completion: its text, and with
``logprobs`` its tokens' logprobs (the engine's prompt logprobs; the first token has none).
Streamed, each chunk carries the logprobs of its own tokens. vLLM's ``prompt_logprobs`` extension
is served too (non-streaming). The token strings are the engine's: vLLM decodes each token (and
corrects pieces of multi-byte characters) whenever logprobs are asked for, so they travel in the
stream instead of being decoded a second time here.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvmesh.v1 import common_pb2

from .errors import BadRequest

MIN_LOGPROB = -9999.0  # what OpenAI and vLLM send for -inf (not valid JSON)
_MAX_COUNT = 2**31  # beyond any vocabulary; the worker bounds it by its max_logprobs


@dataclass(frozen=True, slots=True)
class LogprobOptions:
    """What a request asked for, as the answer must show it."""

    top: int | None = None  # alternatives per completion token; None: no logprobs shown
    echo: bool = False  # completions: the prompt goes before the completion
    echo_text: str | None = None  # the prompt as sent; None: joined from its tokens' strings
    show_prompt: bool = False  # vLLM's prompt_logprobs (non-streaming answers)
    prompt_param: str = "prompt_logprobs"  # the parameter that asked for the prompt's logprobs


NO_LOGPROBS = LogprobOptions()  # neither logprobs nor echo: the answer shows none


def _count(body: Mapping[str, Any], name: str) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadRequest(f"{name} must be an integer (got {json.dumps(value)[:80]})", name)
    if value < 0:
        raise BadRequest(f"{name} must be >= 0 (got {value})", name)
    if value >= _MAX_COUNT:
        raise BadRequest(f"{name} is too large (got {value})", name)
    return value


def _prompt_logprobs(body: Mapping[str, Any], stream: bool) -> int | None:
    """vLLM's ``prompt_logprobs`` extension: not with ``stream`` (vLLM refuses it there too,
    and accepts a useless 0). Its other logprob extensions are refused, not ignored."""
    for name in ("logprob_token_ids", "return_tokens_as_token_ids"):
        if body.get(name):
            raise BadRequest(f"{name} (a vLLM extension) is not supported; omit it", name)
    n = _count(body, "prompt_logprobs")
    if n is not None and stream:
        if n > 0:
            raise BadRequest(
                "prompt_logprobs are not available when stream is true", "prompt_logprobs"
            )
        return None  # 0 with stream: vLLM accepts it and returns nothing; nothing to compute
    return n


def parse_chat(
    body: Mapping[str, Any], stream: bool, sampling: common_pb2.SamplingParams
) -> LogprobOptions:
    """``logprobs`` (true or false) and ``top_logprobs`` (an integer; more than 0 needs
    ``logprobs: true``, as in OpenAI's API); sets ``sampling.logprobs``."""
    on = body.get("logprobs")
    if on is not None and not isinstance(on, bool):
        raise BadRequest(f"logprobs must be true or false (got {json.dumps(on)[:80]})", "logprobs")
    top = _count(body, "top_logprobs")
    if top and not on:
        raise BadRequest("top_logprobs needs logprobs set to true", "top_logprobs")
    if body.get("echo"):  # vLLM's chat extension (the last message prepended)
        raise BadRequest("echo is not supported on chat completions; omit it", "echo")
    prompt = _prompt_logprobs(body, stream)
    if prompt is not None:
        sampling.prompt_logprobs = prompt
    if not on:
        return LogprobOptions(show_prompt=prompt is not None)
    sampling.logprobs = top or 0
    return LogprobOptions(top=top or 0, show_prompt=prompt is not None)


def parse_completion(
    body: Mapping[str, Any],
    stream: bool,
    sampling: common_pb2.SamplingParams,
    prompt_text: str | None,
) -> LogprobOptions:
    """``logprobs`` (an integer: alternatives per token), ``echo``, vLLM's ``prompt_logprobs``;
    sets ``sampling.logprobs`` and ``sampling.prompt_logprobs``. ``prompt_text``: the prompt
    when it was sent as text (None: token ids)."""
    top = _count(body, "logprobs")
    echo = body.get("echo")
    if echo is not None and not isinstance(echo, bool):
        raise BadRequest(f"echo must be true or false (got {json.dumps(echo)[:80]})", "echo")
    prompt = _prompt_logprobs(body, stream)
    param = "prompt_logprobs"
    show = prompt is not None
    if prompt is None and echo and top is not None:  # as vLLM: echo's logprobs are the prompt's
        prompt, param, show = top, "logprobs", True
    if prompt is None and echo and prompt_text is None:
        # A token-id prompt's text: the engine's strings of its tokens (0 alternatives).
        prompt, param = 0, "echo"
    if top is not None:
        sampling.logprobs = top
    if prompt is not None:
        sampling.prompt_logprobs = prompt
    return LogprobOptions(
        top=top, echo=bool(echo), echo_text=prompt_text, show_prompt=show, prompt_param=param
    )


# ---- out -------------------------------------------------------------------------------------
def _lp(x: float) -> float:
    return max(x, MIN_LOGPROB)


def _bytes(token: str) -> list[int]:
    return list(token.encode("utf-8", errors="replace"))


def chat_content(entries: Sequence[common_pb2.TokenLogprob], top: int) -> list[dict[str, Any]]:
    """``logprobs.content`` entries of a chat answer for ``entries``."""
    out = []
    for e in entries:
        out.append(
            {
                "token": e.token,
                "logprob": _lp(e.logprob) if e.HasField("logprob") else MIN_LOGPROB,
                "bytes": _bytes(e.token),
                "top_logprobs": [
                    {"token": t.token, "logprob": _lp(t.logprob), "bytes": _bytes(t.token)}
                    for t in e.top[:top]
                ],
            }
        )
    return out


@dataclass(slots=True)
class CompletionLogprobs:
    """A completions answer's ``logprobs`` object, built chunk by chunk (offsets run on)."""

    tokens: list[str] = field(default_factory=list)
    token_logprobs: list[float | None] = field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = field(default_factory=list)
    text_offset: list[int] = field(default_factory=list)

    def json(self) -> dict[str, Any]:
        return {
            "tokens": self.tokens,
            "token_logprobs": self.token_logprobs,
            "top_logprobs": self.top_logprobs,
            "text_offset": self.text_offset,
        }


def completion_logprobs(
    entries: Sequence[common_pb2.TokenLogprob], top: int, offset: int
) -> CompletionLogprobs:
    """``entries`` in the completions shape, the first at text offset ``offset`` (each next one
    after the previous token's string, as vLLM counts them)."""
    out = CompletionLogprobs()
    for e in entries:
        out.tokens.append(e.token)
        out.text_offset.append(offset)
        offset += len(e.token)
        if not e.HasField("logprob"):  # a prompt's first token
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
            continue
        out.token_logprobs.append(_lp(e.logprob))
        alternatives = {e.token: _lp(e.logprob)}
        for t in e.top[:top]:
            alternatives[t.token] = _lp(t.logprob)
        out.top_logprobs.append(alternatives)
    return out


def prompt_logprobs_json(
    entries: Sequence[common_pb2.TokenLogprob],
) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's ``prompt_logprobs``: per prompt token, None for the first, else token id -> its
    ``{logprob, rank, decoded_token}``, the prompt's token first, then the most likely."""
    out: list[dict[str, dict[str, Any]] | None] = []
    for e in entries:
        if not e.HasField("logprob"):
            out.append(None)
            continue
        position = {
            str(e.token_id): {"logprob": _lp(e.logprob), "rank": e.rank, "decoded_token": e.token}
        }
        for rank, t in enumerate(e.top, start=1):
            position.setdefault(
                str(t.token_id),
                {"logprob": _lp(t.logprob), "rank": rank, "decoded_token": t.token},
            )
        out.append(position)
    return out


@dataclass(slots=True)
class LogprobsOut:
    """One answer's logprobs: ``feed`` gives a chunk's ``logprobs`` object (None: none to show)
    and keeps what the non-streaming answer shows (``whole``, ``prompt``)."""

    chat: bool
    options: LogprobOptions
    _content: list[dict[str, Any]] = field(default_factory=list)
    _completion: CompletionLogprobs = field(default_factory=CompletionLogprobs)
    _offset: int = 0
    _prompt: list[common_pb2.TokenLogprob] = field(default_factory=list)

    def feed(
        self,
        entries: Sequence[common_pb2.TokenLogprob],
        prompt: Sequence[common_pb2.TokenLogprob] = (),
        echoed: Sequence[common_pb2.TokenLogprob] = (),
    ) -> dict[str, Any] | None:
        """``entries``: a message's completion tokens; ``prompt``: its prompt logprobs (kept);
        ``echoed``: prompt entries shown before the completion's (echo)."""
        if prompt:
            self._prompt.extend(prompt)
        top = self.options.top
        if top is None:
            return None
        if self.chat:
            content = chat_content(entries, top)
            self._content.extend(content)
            return {"content": content} if content else None
        if not entries and not echoed:
            return None
        chunk = completion_logprobs([*echoed, *entries], top, self._offset)
        if chunk.tokens:
            self._offset = chunk.text_offset[-1] + len(chunk.tokens[-1])
        whole = self._completion
        whole.tokens += chunk.tokens
        whole.token_logprobs += chunk.token_logprobs
        whole.top_logprobs += chunk.top_logprobs
        whole.text_offset += chunk.text_offset
        return chunk.json()

    def whole(self) -> dict[str, Any] | None:
        """The non-streaming answer's ``logprobs`` (None when not asked for)."""
        if self.options.top is None:
            return None
        if self.chat:
            return {"content": self._content}
        return self._completion.json()

    def prompt(self) -> list[dict[str, dict[str, Any]] | None] | None:
        """vLLM's ``prompt_logprobs`` of the non-streaming answer (None when not asked for)."""
        return prompt_logprobs_json(self._prompt) if self.options.show_prompt else None


def echo_prefix(options: LogprobOptions, prompt: Sequence[common_pb2.TokenLogprob]) -> str:
    """The prompt's text for ``echo``: as sent, or its tokens' strings joined (token ids)."""
    if options.echo_text is not None:
        return options.echo_text
    return "".join(e.token for e in prompt)
