"""The fields an OpenAI request body shares between chat and completions, typed: the sampling
parameters (with vLLM's extensions), ``n`` and ``best_of``. Pure; anything we cannot honour is a
``BadRequest`` naming the field."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from kvmesh.sampling import structured_output_pb
from kvmesh.v1 import common_pb2

from .errors import BadRequest
from .structured import structured_output

MAX_STOP = 4  # stop sequences per request, as the OpenAI API allows
MAX_N = 128  # choices per prompt (n), as the OpenAI API allows


def typed(body: Mapping[str, Any], name: str, types: type | tuple[type, ...], what: str) -> Any:
    value = body.get(name)
    if value is None:
        return None
    # bool is an int in Python; JSON true is not a number.
    if isinstance(value, bool) and bool not in (types if isinstance(types, tuple) else (types,)):
        raise BadRequest(f"{name} must be {what} (got {json.dumps(value)})", name)
    if not isinstance(value, types):
        raise BadRequest(f"{name} must be {what} (got {json.dumps(value)[:80]})", name)
    return value


def number(body: Mapping[str, Any], name: str) -> float | None:
    v = typed(body, name, (int, float), "a number")
    return None if v is None else float(v)


def integer(body: Mapping[str, Any], name: str) -> int | None:
    v = typed(body, name, int, "an integer")
    return None if v is None else int(v)


def flag(body: Mapping[str, Any], name: str) -> bool:
    return bool(typed(body, name, bool, "true or false"))


def choices_per_prompt(body: Mapping[str, Any]) -> int:
    """``n`` (1 to MAX_N), and ``best_of`` checked against it: vLLM V1 dropped best_of (its
    server ignores the field), so only a best_of that selects nothing (= n) is accepted."""
    n = integer(body, "n")
    if n is None:
        n = 1
    if not 1 <= n <= MAX_N:
        raise BadRequest(f"n must be in [1, {MAX_N}] (got {n})", "n")
    best_of = integer(body, "best_of")
    if best_of is not None and best_of < n:
        raise BadRequest(f"best_of must be >= n = {n} (got {best_of})", "best_of")
    if best_of is not None and best_of > n:
        raise BadRequest(
            f"best_of > n is not supported (got best_of {best_of}, n {n}): choosing the best "
            "by log probability was removed in vLLM V1, which kvmesh serves with; send "
            f"n = {best_of} and pick on the client",
            "best_of",
        )
    return n


def structured_param(body: Mapping[str, Any]) -> str:
    return "structured_outputs" if body.get("structured_outputs") is not None else "response_format"


def max_tokens_param(body: Mapping[str, Any]) -> str:
    """The field bounding the answer's length: max_completion_tokens wins over max_tokens."""
    return (
        "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    )


def sampling_params(body: Mapping[str, Any], default_max_tokens: int) -> common_pb2.SamplingParams:
    param = max_tokens_param(body)
    max_tokens = integer(body, param)
    if max_tokens is None:
        max_tokens = default_max_tokens
    if max_tokens <= 0:
        raise BadRequest(f"{param} must be > 0 (got {max_tokens})", param)
    if max_tokens >= 2**32:
        raise BadRequest(f"{param} is too large (got {max_tokens})", param)
    stop = body.get("stop")
    if stop is None:
        stops: list[str] = []
    elif isinstance(stop, str):
        stops = [stop]
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        stops = list(stop)
    else:
        raise BadRequest("stop must be a string or a list of strings", "stop")
    if len(stops) > MAX_STOP:
        raise BadRequest(f"stop has {len(stops)} strings; send at most {MAX_STOP}", "stop")
    stop_token_ids = body.get("stop_token_ids") or []  # vLLM extension
    if not isinstance(stop_token_ids, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 2**32 for t in stop_token_ids
    ):
        raise BadRequest("stop_token_ids must be a list of token ids", "stop_token_ids")
    sampling = common_pb2.SamplingParams(
        max_tokens=max_tokens,
        stop=stops,
        stop_token_ids=stop_token_ids,
        ignore_eos=flag(body, "ignore_eos"),  # vLLM extension
    )
    temperature = number(body, "temperature")
    if temperature is not None:
        sampling.temperature = temperature
    top_p = number(body, "top_p")
    if top_p is not None:
        sampling.top_p = top_p
    top_k = integer(body, "top_k")  # vLLM extension
    if top_k is not None:
        if not -(2**31) <= top_k < 2**31:
            raise BadRequest(f"top_k is out of range (got {top_k})", "top_k")
        sampling.top_k = top_k
    seed = integer(body, "seed")
    if seed is not None:
        if not -(2**63) <= seed < 2**63:
            raise BadRequest(f"seed must fit in 64 bits (got {seed})", "seed")
        sampling.seed = seed
    structured = structured_output(body)
    if structured is not None:
        sampling.structured_output.CopyFrom(
            structured_output_pb(structured, common_pb2.StructuredOutput)
        )
    _penalties(body, sampling)
    return sampling


def _penalties(body: Mapping[str, Any], sampling: common_pb2.SamplingParams) -> None:
    """presence / frequency / repetition penalties, logit_bias, min_tokens: typed here, their
    ranges (and logit_bias's vocabulary) checked by the router (``kvmesh.sampling``)."""
    for name in ("presence_penalty", "frequency_penalty", "repetition_penalty"):
        value = number(body, name)
        if value is not None:
            setattr(sampling, name, value)
    bias = body.get("logit_bias")
    if bias is not None:
        if not isinstance(bias, dict):
            raise BadRequest(
                "logit_bias must be an object: token id (a string) -> bias", "logit_bias"
            )
        for key, value in bias.items():
            token = key.strip() if isinstance(key, str) else ""
            if not token.isdecimal() or int(token) >= 2**32:
                raise BadRequest(
                    f"logit_bias keys must be token ids (got {json.dumps(key)[:40]})", "logit_bias"
                )
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise BadRequest(
                    f"logit_bias[{token}] must be a number (got {json.dumps(value)[:40]})",
                    "logit_bias",
                )
            sampling.logit_bias[int(token)] = float(value)
    min_tokens = integer(body, "min_tokens")  # vLLM extension
    if min_tokens is not None:
        if not 0 <= min_tokens < 2**32:
            raise BadRequest(f"min_tokens must be >= 0 (got {min_tokens})", "min_tokens")
        sampling.min_tokens = min_tokens
