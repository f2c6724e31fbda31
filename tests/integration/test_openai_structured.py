"""Structured output through a real router and real worker services (simulated engines, real
etcd and gRPC): the simulated engine cannot honour a constraint and says so, and its refusal
reaches the OpenAI client as a 400 naming the parameter that asked for it (the worker's field
rides the gRPC status through the router). The router's own checks answer without a worker."""

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
    async with sim_mesh(etcd, "openai-structured") as (router, _):
        assert router.http is not None
        async with RouterClient(router.address) as grpc_client:
            await grpc_client.wait_for_models()
        async with openai.AsyncOpenAI(
            base_url=router.http.base_url, api_key="none", max_retries=0
        ) as client:
            yield client


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
@pytest.mark.parametrize(
    ("extra", "param", "says"),
    [
        pytest.param(
            {"extra_body": {"response_format": {"type": "json_object"}}},
            "response_format",
            "simulated engine",
            id="worker-refuses",
        ),
        pytest.param(
            {"extra_body": {"structured_outputs": {"regex": "a+"}}},
            "structured_outputs",
            "simulated engine",
            id="worker-refuses-vllm-field",
        ),
        pytest.param(
            {"extra_body": {"structured_outputs": {"choice": ["a", ""]}}},
            "structured_outputs",
            "empty string",
            id="router-checks",
        ),
    ],
)
async def test_structured_output_refusals_name_the_param(
    front: openai.AsyncOpenAI, extra: dict[str, Any], param: str, says: str, stream: bool
):
    with pytest.raises(openai.BadRequestError) as bad:
        await front.completions.create(
            model="sim", prompt=PROMPT, max_tokens=2, stream=stream, **extra
        )
    assert bad.value.body["param"] == param, bad.value.body  # type: ignore[index]
    assert says in bad.value.message


async def test_without_structured_output_the_same_request_is_served(front: openai.AsyncOpenAI):
    done = await front.completions.create(model="sim", prompt=PROMPT, max_tokens=2)
    assert done.choices[0].finish_reason == "length"
