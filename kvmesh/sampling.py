"""Sampling parameters and the checks every service applies to a request. Pure.

The router checks before tokenizing and routing (fail fast, without a worker round trip); the
worker checks again before its engine (it may be called by other clients). Both use these
functions, so the rules and messages are the same everywhere: each names the field, the
allowed range and what was received.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from kvmesh.errors import InvalidArgument

MAX_STOP_STRINGS = 16
MAX_PENALTY = 2.0  # presence_penalty and frequency_penalty lie in [-MAX_PENALTY, MAX_PENALTY]
MAX_LOGIT_BIAS = 100.0  # logit_bias values lie in [-MAX_LOGIT_BIAS, MAX_LOGIT_BIAS]
MAX_LOGIT_BIAS_TOKENS = 1024  # token ids one request may bias (OpenAI's limit is 300)


@dataclass(frozen=True, slots=True)
class Sampling:
    """How to sample; None leaves the engine's default (see common.proto SamplingParams)."""

    max_tokens: int
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # 0 or -1 disable it
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    presence_penalty: float | None = None  # [-2, 2]; None: 0
    frequency_penalty: float | None = None  # [-2, 2]; None: 0
    repetition_penalty: float | None = None  # > 0; None: 1
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) pairs, by token id
    min_tokens: int = 0  # no end of sequence / stop token before this many tokens


def check_sampling(s: Sampling, vocab_size: int = 0) -> None:
    """Raises ``InvalidArgument`` for the first rule ``s`` breaks (vocab_size 0: not checked),
    its ``field`` the one at fault (``sampling.<name>``)."""
    if s.max_tokens <= 0:
        raise InvalidArgument(
            f"sampling.max_tokens must be > 0 (got {s.max_tokens})", "sampling.max_tokens"
        )
    if s.temperature is not None and not 0.0 <= s.temperature <= 2.0:
        raise InvalidArgument(
            f"sampling.temperature must be in [0, 2] (got {s.temperature:g})",
            "sampling.temperature",
        )
    if s.top_p is not None and not 0.0 < s.top_p <= 1.0:
        raise InvalidArgument(
            f"sampling.top_p must be in (0, 1] (got {s.top_p:g})", "sampling.top_p"
        )
    if s.top_k is not None and s.top_k < -1:
        raise InvalidArgument(
            f"sampling.top_k must be -1 or 0 (both disable it) or > 0 (got {s.top_k})",
            "sampling.top_k",
        )
    if len(s.stop) > MAX_STOP_STRINGS:
        raise InvalidArgument(
            f"sampling.stop has {len(s.stop)} strings; use at most {MAX_STOP_STRINGS}",
            "sampling.stop",
        )
    if any(not x for x in s.stop):
        raise InvalidArgument("sampling.stop contains an empty string; remove it", "sampling.stop")
    if vocab_size > 0:
        bad = next((t for t in s.stop_token_ids if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise InvalidArgument(
                f"sampling.stop_token_ids has {bad}, outside the vocabulary [0, {vocab_size})",
                "sampling.stop_token_ids",
            )
    _check_penalties(s)
    _check_logit_bias(s.logit_bias, vocab_size)
    if not 0 <= s.min_tokens <= s.max_tokens:
        raise InvalidArgument(
            f"sampling.min_tokens must be in [0, max_tokens = {s.max_tokens}] (got {s.min_tokens})",
            "sampling.min_tokens",
        )


def _check_penalties(s: Sampling) -> None:
    for name, value in (
        ("presence_penalty", s.presence_penalty),
        ("frequency_penalty", s.frequency_penalty),
    ):
        if value is not None and not -MAX_PENALTY <= value <= MAX_PENALTY:  # refuses NaN too
            raise InvalidArgument(
                f"sampling.{name} must be in [-2, 2] (got {value:g})", f"sampling.{name}"
            )
    r = s.repetition_penalty
    if r is not None and not (0.0 < r < math.inf):
        raise InvalidArgument(
            f"sampling.repetition_penalty must be > 0 and finite; 1 means none (got {r:g})",
            "sampling.repetition_penalty",
        )


def _check_logit_bias(bias: tuple[tuple[int, float], ...], vocab_size: int) -> None:
    if len(bias) > MAX_LOGIT_BIAS_TOKENS:
        raise InvalidArgument(
            f"sampling.logit_bias has {len(bias)} token ids; bias at most {MAX_LOGIT_BIAS_TOKENS}",
            "sampling.logit_bias",
        )
    for token, value in bias:
        if not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:
            raise InvalidArgument(
                f"sampling.logit_bias[{token}] must be in [-100, 100] (got {value:g})",
                "sampling.logit_bias",
            )
        if token < 0 or (vocab_size > 0 and token >= vocab_size):
            raise InvalidArgument(
                f"sampling.logit_bias has token id {token}, outside the vocabulary "
                f"[0, {vocab_size})",
                "sampling.logit_bias",
            )


def check_prompt(
    token_ids: Sequence[int], max_tokens: int, vocab_size: int, max_model_len: int
) -> None:
    """The tokenized prompt against the model: non-empty, inside the vocabulary, fits the
    context with room for ``max_tokens`` (field ``input``, or ``sampling.max_tokens`` when the
    prompt alone fits)."""
    n = len(token_ids)
    if n == 0:
        raise InvalidArgument("the prompt has no tokens; send a non-empty prompt", "input")
    bad = next((t for t in token_ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise InvalidArgument(
            f"token id {bad} is outside the model's vocabulary [0, {vocab_size})", "input"
        )
    if n >= max_model_len:
        raise InvalidArgument(
            f"the prompt has {n} tokens but the model's context is {max_model_len} tokens; "
            "shorten the prompt",
            "input",
        )
    if n + max_tokens > max_model_len:
        raise InvalidArgument(
            f"prompt ({n} tokens) + max_tokens ({max_tokens}) = {n + max_tokens} exceeds the "
            f"model's context of {max_model_len} tokens; lower max_tokens to at most "
            f"{max_model_len - n} or shorten the prompt",
            "sampling.max_tokens",
        )


def sampling_from_pb(p) -> Sampling:  # type: ignore[no-untyped-def]
    """From a ``kvmesh.v1.SamplingParams`` message (duck-typed: this module imports no grpc)."""
    return Sampling(
        max_tokens=p.max_tokens,
        temperature=p.temperature if p.HasField("temperature") else None,
        top_p=p.top_p if p.HasField("top_p") else None,
        top_k=p.top_k if p.HasField("top_k") else None,
        seed=p.seed if p.HasField("seed") else None,
        stop=tuple(p.stop),
        stop_token_ids=tuple(p.stop_token_ids),
        ignore_eos=p.ignore_eos,
        presence_penalty=_optional(p, "presence_penalty"),
        frequency_penalty=_optional(p, "frequency_penalty"),
        repetition_penalty=_optional(p, "repetition_penalty"),
        logit_bias=tuple(sorted(p.logit_bias.items())),
        min_tokens=p.min_tokens,
    )


def _optional(p, name: str) -> float | None:  # type: ignore[no-untyped-def]
    return float(getattr(p, name)) if p.HasField(name) else None
