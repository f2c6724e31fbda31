"""Checks on a Generate request before it reaches the engine. Pure: every rule names the field,
the allowed range and what was received, so the caller knows what to fix."""

from __future__ import annotations

from kvmesh.errors import InvalidArgument
from kvmesh.kv.hashing import check_cache_salt
from kvmesh.sampling import check_prompt, check_sampling

from .core import EngineInfo, GenerateRequest, KvSource

MAX_REQUEST_ID_CHARS = 256
MAX_KVMANAGER_ID_CHARS = 256
MAX_HANDOFF_WAIT_S = 600.0  # kv_source.handoff_wait_s: a prefill longer than this is not waited for


def check_request(request: GenerateRequest, info: EngineInfo) -> None:
    """Raises ``InvalidArgument`` for the first rule ``request`` breaks."""
    check_request_id(request.request_id)
    check_sampling(request.sampling, info.vocab_size, info.max_logprobs)
    check_prompt(
        request.prompt_token_ids, request.sampling.max_tokens, info.vocab_size, info.max_model_len
    )
    if request.kv_source is not None:
        check_kv_source(request.kv_source, len(request.prompt_token_ids), info.block_size)
    check_cache_salt(request.cache_salt)
    check_rank(request.data_parallel_rank, info.data_parallel_size)
    if request.store_prefix_blocks is not None:
        check_store_prefix(
            request.store_prefix_blocks, len(request.prompt_token_ids), info.block_size
        )


def check_store_prefix(blocks: int, prompt_tokens: int, block_size: int) -> None:
    """The router's count of the node store's prefix is at most the prompt's full blocks."""
    full = prompt_tokens // block_size if block_size > 0 else 0
    if block_size > 0 and blocks > full:
        raise InvalidArgument(
            f"store_prefix_blocks is {blocks}; the prompt has {full} full blocks of "
            f"{block_size} tokens, so use 0 to {full} (or leave it unset)",
            "store_prefix_blocks",
        )


def check_rank(rank: int | None, size: int) -> None:
    """A data-parallel rank names one of the engine's ranks (or is unset: the engine picks)."""
    if rank is not None and not 0 <= rank < max(size, 1):
        raise InvalidArgument(
            f"data_parallel_rank is {rank}; this worker's engine has {max(size, 1)} "
            f"data-parallel rank(s), so use 0 to {max(size, 1) - 1} or leave it unset",
            "data_parallel_rank",
        )


def check_kv_source(source: KvSource, prompt_tokens: int, block_size: int) -> None:
    """A peer hint names a kvmanager and at most the prompt's full blocks."""
    if not source.kvmanager_id or len(source.kvmanager_id) > MAX_KVMANAGER_ID_CHARS:
        raise InvalidArgument(
            f"kv_source.kvmanager_id has {len(source.kvmanager_id)} characters; set the peer "
            f"kvmanager's id (1 to {MAX_KVMANAGER_ID_CHARS} characters) or leave kv_source unset"
        )
    full = prompt_tokens // block_size if block_size > 0 else 0
    if not 0 < source.blocks <= full:
        raise InvalidArgument(
            f"kv_source.blocks is {source.blocks}; the prompt has {full} full blocks of "
            f"{block_size} tokens, so use 1 to {full} (or leave kv_source unset)"
        )
    if not 0 <= source.handoff_wait_s <= MAX_HANDOFF_WAIT_S:  # also refuses NaN
        raise InvalidArgument(
            f"kv_source.handoff_wait_s is {source.handoff_wait_s}; use 0 (the worker's default)"
            f" to {MAX_HANDOFF_WAIT_S:g} seconds"
        )
    if not 0 <= source.max_fetch_s <= MAX_HANDOFF_WAIT_S:  # also refuses NaN
        raise InvalidArgument(
            f"kv_source.max_fetch_s is {source.max_fetch_s}; use 0 (the worker's peer fetch"
            f" timeout) to {MAX_HANDOFF_WAIT_S:g} seconds"
        )


def check_request_id(request_id: str) -> None:
    if not request_id:
        raise InvalidArgument("request_id is empty; set a unique id per request")
    if len(request_id) > MAX_REQUEST_ID_CHARS:
        raise InvalidArgument(
            f"request_id has {len(request_id)} characters; use at most {MAX_REQUEST_ID_CHARS}"
        )
