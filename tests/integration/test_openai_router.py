"""The OpenAI front door of a real router (in front of simulated workers behind the real worker
service, on a real etcd), driven by the official ``openai`` client: what only the router knows
reaches the OpenAI answer. A request without a model is answered with the served model's name;
a value the router finds out of range is a 400 whose ``param`` names the OpenAI parameter (the
field travels with the gRPC status); more than 4 stop strings is a 400 naming ``stop``."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import openai
import pytest

from kvmesh.client import RouterClient

from .test_router_metrics import sim_mesh

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

PROMPT = list(range(1, 65))  # token ids: the simulated workers take no text


@pytest.fixture(scope="module")
async def front(etcd) -> AsyncIterator[openai.AsyncOpenAI]:
    async with sim_mesh(etcd, "openai-router") as (router, _):
        assert router.http is not None
        async with RouterClient(router.address) as grpc_client:
            await grpc_client.wait_for_models()
        async with openai.AsyncOpenAI(
            base_url=router.http.base_url, api_key="none", max_retries=0
        ) as client:
            yield client


async def test_no_model_is_answered_with_the_served_name(front: openai.AsyncOpenAI):
    done = await front.completions.create(model="", prompt=PROMPT, max_tokens=2)
    assert done.model == "sim"
    stream = await front.completions.create(model="", prompt=PROMPT, max_tokens=2, stream=True)
    assert {chunk.model async for chunk in stream} == {"sim"}


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
@pytest.mark.parametrize(
    ("extra", "param"),
    [
        pytest.param({"temperature": 3.0}, "temperature", id="temperature"),
        pytest.param({"top_p": 1.5}, "top_p", id="top_p"),
        pytest.param({"max_tokens": 4090}, "max_tokens", id="max_tokens-past-context"),
        pytest.param(
            {"extra_body": {"max_completion_tokens": 4090}},
            "max_completion_tokens",
            id="max_completion_tokens-past-context",
        ),
        pytest.param({"prompt": [*PROMPT, 5000]}, "prompt", id="token-outside-vocabulary"),
        pytest.param({"stop": ["a", "b", "c", "d", "e"]}, "stop", id="five-stops"),
    ],
)
async def test_out_of_range_names_the_param(
    front: openai.AsyncOpenAI, extra: dict[str, Any], param: str, stream: bool
):
    args: dict[str, Any] = {"model": "sim", "prompt": PROMPT, "max_tokens": 2, **extra}
    with pytest.raises(openai.BadRequestError) as bad:
        await front.completions.create(**args, stream=stream)
    assert bad.value.status_code == 400
    assert bad.value.body["param"] == param, bad.value.body  # type: ignore[index]


async def test_four_stops_are_accepted(front: openai.AsyncOpenAI):
    done = await front.completions.create(
        model="sim", prompt=PROMPT, max_tokens=2, stop=["a", "b", "c", "d"]
    )
    assert done.choices[0].finish_reason == "length"
