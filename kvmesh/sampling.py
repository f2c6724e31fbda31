"""Sampling parameters and the checks every service applies to a request. Pure.

The router checks before tokenizing and routing (fail fast, without a worker round trip); the
worker checks again before its engine (it may be called by other clients). Both use these
functions, so the rules and messages are the same everywhere: each names the field, the
allowed range and what was received.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvmesh.errors import InvalidArgument

MAX_STOP_STRINGS = 16


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
    logprobs: int | None = None  # alternatives per generated token (0: its own only); None: off
    prompt_logprobs: int | None = None  # the same per prompt token; None: off


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
        logprobs=p.logprobs if p.HasField("logprobs") else None,
        prompt_logprobs=p.prompt_logprobs if p.HasField("prompt_logprobs") else None,
    )
