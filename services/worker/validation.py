"""Checks on a Generate request before it reaches the engine. Pure: every rule names the field,
the allowed range and what was received, so the caller knows what to fix."""

from __future__ import annotations

from kvmesh.errors import InvalidArgument

from .core import EngineInfo, GenerateRequest, Sampling

MAX_REQUEST_ID_CHARS = 256
MAX_STOP_STRINGS = 16


def check_request(request: GenerateRequest, info: EngineInfo) -> None:
    """Raises ``InvalidArgument`` for the first rule ``request`` breaks."""
    check_request_id(request.request_id)
    check_sampling(request.sampling, info.vocab_size)
    check_prompt(request.prompt_token_ids, request.sampling.max_tokens, info)


def check_request_id(request_id: str) -> None:
    if not request_id:
        raise InvalidArgument("request_id is empty; set a unique id per request")
    if len(request_id) > MAX_REQUEST_ID_CHARS:
        raise InvalidArgument(
            f"request_id has {len(request_id)} characters; use at most {MAX_REQUEST_ID_CHARS}"
        )


def check_sampling(s: Sampling, vocab_size: int = 0) -> None:
    if s.max_tokens <= 0:
        raise InvalidArgument(f"sampling.max_tokens must be > 0 (got {s.max_tokens})")
    if s.temperature is not None and not 0.0 <= s.temperature <= 2.0:
        raise InvalidArgument(f"sampling.temperature must be in [0, 2] (got {s.temperature:g})")
    if s.top_p is not None and not 0.0 < s.top_p <= 1.0:
        raise InvalidArgument(f"sampling.top_p must be in (0, 1] (got {s.top_p:g})")
    if s.top_k is not None and s.top_k < -1:
        raise InvalidArgument(
            f"sampling.top_k must be -1 or 0 (both disable it) or > 0 (got {s.top_k})"
        )
    if len(s.stop) > MAX_STOP_STRINGS:
        raise InvalidArgument(
            f"sampling.stop has {len(s.stop)} strings; use at most {MAX_STOP_STRINGS}"
        )
    if any(not x for x in s.stop):
        raise InvalidArgument("sampling.stop contains an empty string; remove it")
    if vocab_size > 0:
        bad = next((t for t in s.stop_token_ids if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise InvalidArgument(
                f"sampling.stop_token_ids has {bad}, outside the vocabulary [0, {vocab_size})"
            )


def check_prompt(token_ids: tuple[int, ...], max_tokens: int, info: EngineInfo) -> None:
    n = len(token_ids)
    if n == 0:
        raise InvalidArgument("prompt_token_ids is empty; send at least one token")
    bad = next((t for t in token_ids if not 0 <= t < info.vocab_size), None)
    if bad is not None:
        raise InvalidArgument(
            f"prompt_token_ids has token id {bad}, outside the model's vocabulary "
            f"[0, {info.vocab_size})"
        )
    if n >= info.max_model_len:
        raise InvalidArgument(
            f"the prompt has {n} tokens but the model's context is {info.max_model_len} "
            "tokens; shorten the prompt"
        )
    if n + max_tokens > info.max_model_len:
        raise InvalidArgument(
            f"prompt ({n} tokens) + max_tokens ({max_tokens}) = {n + max_tokens} exceeds the "
            f"model's context of {info.max_model_len} tokens; lower max_tokens to at most "
            f"{info.max_model_len - n} or shorten the prompt"
        )
