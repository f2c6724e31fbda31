"""The worker's request validation, table-driven: each bad request names the field and the fix."""

from __future__ import annotations

import dataclasses

import pytest

from kvmesh.errors import InvalidArgument
from services.worker.core import EngineInfo, GenerateRequest, Sampling
from services.worker.validation import check_request

INFO = EngineInfo(model="m", model_path="/m", max_model_len=100, block_size=32, vocab_size=50)


def req(
    prompt: tuple[int, ...] = (1, 2, 3), rid: str = "r1", **sampling: object
) -> GenerateRequest:
    sampling.setdefault("max_tokens", 10)
    return GenerateRequest(request_id=rid, prompt_token_ids=prompt, sampling=Sampling(**sampling))


def salted(cache_salt: str) -> GenerateRequest:
    return dataclasses.replace(req(), cache_salt=cache_salt)


def store_prefix(blocks: int, tokens: int = 70) -> GenerateRequest:
    return dataclasses.replace(req(prompt=(1,) * tokens), store_prefix_blocks=blocks)


GOOD = [
    pytest.param(req(), id="plain"),
    pytest.param(req(prompt=(0, 49)), id="vocab-edges"),
    pytest.param(req(prompt=(1,) * 90, max_tokens=10), id="fills-context-exactly"),
    pytest.param(req(temperature=0.0), id="greedy"),
    pytest.param(req(temperature=2.0), id="temperature-max"),
    pytest.param(req(top_p=1.0), id="top-p-1"),
    pytest.param(req(top_p=0.01), id="top-p-small"),
    pytest.param(req(top_k=-1), id="top-k-minus-1-disables"),
    pytest.param(req(top_k=0), id="top-k-0-disables"),
    pytest.param(req(top_k=5), id="top-k-5"),
    pytest.param(req(stop=("x",), stop_token_ids=(49,)), id="stops"),
    pytest.param(salted("a" * 128), id="cache-salt-max"),
    pytest.param(salted("0f" * 32), id="cache-salt-hex"),
    pytest.param(store_prefix(0), id="store-prefix-none"),
    pytest.param(store_prefix(2), id="store-prefix-every-full-block"),
]

BAD = [
    pytest.param(req(rid=""), "request_id is empty", id="no-request-id"),
    pytest.param(req(rid="x" * 300), "use at most 256", id="long-request-id"),
    pytest.param(req(prompt=()), "the prompt has no tokens", id="empty-prompt"),
    pytest.param(req(prompt=(1, 50)), "token id 50 is outside the model's vocabulary [0, 50)", id="oov"),
    pytest.param(req(prompt=(1, -1)), "token id -1", id="negative-token"),
    pytest.param(req(max_tokens=0), "sampling.max_tokens must be > 0 (got 0)", id="max-tokens-0"),
    pytest.param(req(max_tokens=-3), "must be > 0 (got -3)", id="max-tokens-negative"),
    pytest.param(
        req(prompt=(1,) * 100), "the prompt has 100 tokens but the model's context is 100",
        id="prompt-fills-context",
    ),
    pytest.param(
        req(prompt=(1,) * 95, max_tokens=10),
        "prompt (95 tokens) + max_tokens (10) = 105 exceeds the model's context of 100 tokens; "
        "lower max_tokens to at most 5",
        id="prompt-plus-max-tokens",
    ),
    pytest.param(req(temperature=-0.1), "temperature must be in [0, 2] (got -0.1)", id="temp-low"),
    pytest.param(req(temperature=2.5), "temperature must be in [0, 2] (got 2.5)", id="temp-high"),
    pytest.param(req(top_p=0.0), "top_p must be in (0, 1] (got 0)", id="top-p-0"),
    pytest.param(req(top_p=1.5), "top_p must be in (0, 1] (got 1.5)", id="top-p-high"),
    pytest.param(req(top_k=-2), "top_k must be -1 or 0 (both disable it) or > 0 (got -2)", id="top-k"),
    pytest.param(req(stop=("",)), "sampling.stop contains an empty string", id="empty-stop"),
    pytest.param(req(stop=("a",) * 17), "sampling.stop has 17 strings", id="many-stops"),
    pytest.param(req(stop_token_ids=(50,)), "stop_token_ids has 50", id="stop-token-oov"),
    pytest.param(salted("a" * 129), "cache_salt has 129 characters; use at most 128", id="salt-long"),
    pytest.param(salted("team/a"), "cache_salt contains '@', '/'", id="salt-slash"),
    pytest.param(salted("a@b"), "cache_salt contains", id="salt-at"),
    pytest.param(salted("a\0b"), "cache_salt contains", id="salt-nul"),
    pytest.param(
        store_prefix(3), "store_prefix_blocks is 3; the prompt has 2 full blocks of 32 tokens, "
        "so use 0 to 2 (or leave it unset)", id="store-prefix-past-the-prompt",
    ),
]  # fmt: skip


@pytest.mark.parametrize("request_", GOOD)
def test_good_requests_pass(request_: GenerateRequest) -> None:
    check_request(request_, INFO)


@pytest.mark.parametrize(("request_", "message"), BAD)
def test_bad_requests_say_what_to_fix(request_: GenerateRequest, message: str) -> None:
    with pytest.raises(InvalidArgument) as err:
        check_request(request_, INFO)
    assert message in str(err.value)
