"""Sampling parameters and the checks every service applies to a request. Pure.

The router checks before tokenizing and routing (fail fast, without a worker round trip); the
worker checks again before its engine (it may be called by other clients). Both use these
functions, so the rules and messages are the same everywhere: each names the field, the
allowed range and what was received.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

from kvmesh.errors import InvalidArgument

MAX_STOP_STRINGS = 16
STRUCTURED_FIELD = "sampling.structured_output"


class OutputKind(StrEnum):
    """What a structured output constrains the completion to (common.proto StructuredOutput)."""

    JSON_SCHEMA = "json_schema"  # a JSON value the schema accepts
    JSON_OBJECT = "json_object"  # any JSON object
    REGEX = "regex"  # text the regular expression matches
    CHOICE = "choice"  # exactly one of some strings
    GRAMMAR = "grammar"  # text the grammar (EBNF/GBNF or Lark) derives


@dataclass(frozen=True, slots=True)
class StructuredOutput:
    """The constraint: ``spec`` is the schema (JSON text), regex or grammar; ``choices`` the
    strings for CHOICE; JSON_OBJECT needs neither."""

    kind: OutputKind
    spec: str = ""
    choices: tuple[str, ...] = ()


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
    structured_output: StructuredOutput | None = None
    logprobs: int | None = None  # alternatives per generated token (0: its own only); None: off
    prompt_logprobs: int | None = None  # the same per prompt token; None: off
    presence_penalty: float | None = None  # [-2, 2]; None: 0
    frequency_penalty: float | None = None  # [-2, 2]; None: 0
    repetition_penalty: float | None = None  # > 0; None: 1
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) pairs, by token id
    min_tokens: int = 0  # no end of sequence / stop token before this many tokens


def check_structured_output(so: StructuredOutput) -> None:
    """What can be told without the engine: a schema is JSON text holding an object, a regex or
    grammar is not blank, choices are given and none is empty. The engine checks the rest (a
    schema feature or grammar rule its backend lacks) and says so as INVALID_ARGUMENT too."""
    f = f"{STRUCTURED_FIELD}.{so.kind.value}"
    if so.kind is OutputKind.JSON_SCHEMA:
        try:
            schema = json.loads(so.spec)
        except ValueError as exc:
            raise InvalidArgument(
                f"{f} is not valid JSON ({exc}): {so.spec[:60]!r}", STRUCTURED_FIELD
            ) from None
        if not isinstance(schema, dict):
            raise InvalidArgument(
                f"{f} must be a JSON object (a JSON Schema), got {so.spec[:60]!r}",
                STRUCTURED_FIELD,
            )
    elif so.kind in (OutputKind.REGEX, OutputKind.GRAMMAR):
        if not so.spec.strip():
            raise InvalidArgument(f"{f} is empty; send a {so.kind.value}", STRUCTURED_FIELD)
        if "\x00" in so.spec:
            raise InvalidArgument(f"{f} contains a NUL character", STRUCTURED_FIELD)
    elif so.kind is OutputKind.CHOICE:
        if not so.choices:
            raise InvalidArgument(f"{f} is empty; give at least one string", STRUCTURED_FIELD)
        if any(not c for c in so.choices):
            raise InvalidArgument(f"{f} contains an empty string; remove it", STRUCTURED_FIELD)


def check_sampling(s: Sampling, vocab_size: int = 0, max_logprobs: int = 0) -> None:
    """Raises ``InvalidArgument`` for the first rule ``s`` breaks (vocab_size 0: not checked;
    max_logprobs 0: the engine's bound on logprobs unknown, not checked), its ``field`` the one
    at fault (``sampling.<name>``)."""
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
    if max_logprobs > 0:
        for name, n in (("logprobs", s.logprobs), ("prompt_logprobs", s.prompt_logprobs)):
            if n is not None and n > max_logprobs:
                raise InvalidArgument(
                    f"sampling.{name} is {n}; this engine returns at most {max_logprobs} "
                    "alternatives per token (vLLM's max_logprobs)",
                    f"sampling.{name}",
                )
    if vocab_size > 0:
        bad = next((t for t in s.stop_token_ids if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise InvalidArgument(
                f"sampling.stop_token_ids has {bad}, outside the vocabulary [0, {vocab_size})",
                "sampling.stop_token_ids",
            )
    if s.structured_output is not None:
        check_structured_output(s.structured_output)

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


def fitted_max_tokens(max_tokens: int, prompt_tokens: int, max_model_len: int, fit: bool) -> int:
    """``max_tokens``, or with ``fit`` (an upper bound, as Anthropic's), at most the room the
    prompt leaves in the context (at least 1: a prompt that fills the context is
    ``check_prompt``'s error)."""
    if not fit:
        return max_tokens
    return max(1, min(max_tokens, max_model_len - prompt_tokens))


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
        structured_output=structured_output_from_pb(p.structured_output)
        if p.HasField("structured_output")
        else None,
        logprobs=p.logprobs if p.HasField("logprobs") else None,
        prompt_logprobs=p.prompt_logprobs if p.HasField("prompt_logprobs") else None,
        presence_penalty=_optional(p, "presence_penalty"),
        frequency_penalty=_optional(p, "frequency_penalty"),
        repetition_penalty=_optional(p, "repetition_penalty"),
        logit_bias=tuple(sorted(p.logit_bias.items())),
        min_tokens=p.min_tokens,
    )


def structured_output_from_pb(p) -> StructuredOutput:  # type: ignore[no-untyped-def]
    """From a ``kvmesh.v1.StructuredOutput`` (duck-typed). None of its kinds set, or
    ``json_object`` false, is ``InvalidArgument``."""
    kind = p.WhichOneof("kind")
    if kind is None:
        raise InvalidArgument(
            f"{STRUCTURED_FIELD} is set but names no kind; set one of json_schema, json_object, "
            "regex, choice, grammar (or leave it unset)",
            STRUCTURED_FIELD,
        )
    out = OutputKind(kind)
    if out is OutputKind.JSON_OBJECT:
        if not p.json_object:
            raise InvalidArgument(
                f"{STRUCTURED_FIELD}.json_object must be true when set; leave "
                f"{STRUCTURED_FIELD} unset for unconstrained output",
                STRUCTURED_FIELD,
            )
        return StructuredOutput(out)
    if out is OutputKind.CHOICE:
        return StructuredOutput(out, choices=tuple(p.choice.choices))
    return StructuredOutput(out, spec=getattr(p, kind))


def structured_output_pb(so: StructuredOutput, cls):  # type: ignore[no-untyped-def]
    """``so`` as a ``cls`` (pass ``common_pb2.StructuredOutput``; this module imports no
    stubs)."""
    msg = cls()
    if so.kind is OutputKind.JSON_OBJECT:
        msg.json_object = True
    elif so.kind is OutputKind.CHOICE:
        msg.choice.choices.extend(so.choices)
    else:
        setattr(msg, so.kind.value, so.spec)
    return msg


def _optional(p, name: str) -> float | None:  # type: ignore[no-untyped-def]
    return float(getattr(p, name)) if p.HasField(name) else None
