"""Checks on a Generate request before it reaches the engine. Pure: every rule names the field,
the allowed range and what was received, so the caller knows what to fix."""

from __future__ import annotations

from kvmesh.errors import InvalidArgument
from kvmesh.sampling import check_prompt, check_sampling

from .core import EngineInfo, GenerateRequest

MAX_REQUEST_ID_CHARS = 256


def check_request(request: GenerateRequest, info: EngineInfo) -> None:
    """Raises ``InvalidArgument`` for the first rule ``request`` breaks."""
    check_request_id(request.request_id)
    check_sampling(request.sampling, info.vocab_size)
    check_prompt(
        request.prompt_token_ids, request.sampling.max_tokens, info.vocab_size, info.max_model_len
    )


def check_request_id(request_id: str) -> None:
    if not request_id:
        raise InvalidArgument("request_id is empty; set a unique id per request")
    if len(request_id) > MAX_REQUEST_ID_CHARS:
        raise InvalidArgument(
            f"request_id has {len(request_id)} characters; use at most {MAX_REQUEST_ID_CHARS}"
        )
