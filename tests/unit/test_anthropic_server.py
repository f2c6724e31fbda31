"""The Anthropic Messages edge of the HTTP server over a fake router backend on a loopback port:
the official ``anthropic`` SDK parses what the server sends (events, errors, headers). The real
mesh is in tests/integration/test_anthropic_router.py."""

from __future__ import annotations

from collections.abc import AsyncIterator

import aiohttp
import anthropic
import pytest

from kvmesh import errors
from services.router.http import OpenAIServer

from .test_openai_server import FakeRouter

HI: list[anthropic.types.MessageParam] = [{"role": "user", "content": "hi"}]


@pytest.fixture
async def served() -> AsyncIterator[tuple[OpenAIServer, FakeRouter]]:
    fake = FakeRouter()
    server = OpenAIServer(port=0, backend=fake, max_body_bytes=4096)
    await server.start()
    try:
        yield server, fake
    finally:
        await server.close()


def client(server: OpenAIServer) -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(
        base_url=f"http://{server.host}:{server.port}", api_key="sk-x", max_retries=0
    )


async def test_message_and_stream(served):
    server, fake = served
    async with client(server) as c:
        raw = await c.messages.with_raw_response.create(
            model="tiny", max_tokens=4, messages=HI, metadata={"user_id": "sess-1"}
        )
        msg = await raw.parse()
        assert raw.headers["request-id"] == msg.id and msg.id.startswith("msg_")
        assert raw.headers["x-kvmesh-worker"] == "w-1"
        async with c.messages.stream(model="tiny", max_tokens=4, messages=HI) as stream:
            texts = [t async for t in stream.text_stream]
            final = await stream.get_final_message()
    assert [b.type for b in msg.content] == ["text"]
    assert msg.content[0].text == "Hello"  # type: ignore[union-attr]
    assert msg.stop_reason == "end_turn"
    # The fake's usage: 7 prompt tokens, 3 cached; its block size is 4: 4 more were cached now.
    assert (
        msg.usage.input_tokens,
        msg.usage.cache_creation_input_tokens,
        msg.usage.cache_read_input_tokens,
        msg.usage.output_tokens,
    ) == (3, 1, 3, 2)
    assert fake.requests[0].session_id == "sess-1"
    assert fake.requests[0].tenant.startswith("key-")  # x-api-key read as the key
    assert texts == ["Hel", "lo"]
    assert final.usage == msg.usage and final.stop_reason == "end_turn"


async def test_count_tokens_without_a_count_backend(served):
    """A backend that cannot count (a router over gRPC) counts with one generated token."""
    server, fake = served
    async with client(server) as c:
        counted = await c.messages.count_tokens(model="tiny", messages=HI, system="Be brief.")
    assert counted.input_tokens == 7
    assert fake.requests[0].sampling.max_tokens == 1


@pytest.mark.parametrize(
    ("fail", "cls", "status", "kind"),
    [
        pytest.param(errors.NotFound("model 'x'"), anthropic.NotFoundError, 404, "not_found_error"),
        pytest.param(
            errors.Unavailable("no worker"), anthropic.APIStatusError, 529, "overloaded_error"
        ),
        pytest.param(errors.KvmeshError("boom"), anthropic.InternalServerError, 500, "api_error"),
    ],
)
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
async def test_router_errors_in_anthropics_shape(
    served, fail: errors.KvmeshError, cls: type[Exception], status: int, kind: str, stream: bool
):
    server, fake = served
    fake.fail = fail
    async with client(server) as c:
        with pytest.raises(cls) as info:
            await c.messages.create(model="tiny", max_tokens=4, messages=HI, stream=stream)
    err = info.value
    assert isinstance(err, anthropic.APIStatusError)
    assert err.status_code == status
    assert err.body["type"] == "error" and err.body["error"]["type"] == kind  # type: ignore[index]


async def test_error_after_the_first_event_is_an_error_event(served):
    server, fake = served
    fake.fail_after = errors.Unavailable("worker lost")

    async def drain(c: anthropic.AsyncAnthropic) -> None:
        async with c.messages.stream(model="tiny", max_tokens=4, messages=HI) as stream:
            async for _ in stream:
                pass

    async with client(server) as c:
        with pytest.raises(anthropic.APIStatusError) as info:
            await drain(c)
    assert info.value.body["error"]["type"] == "overloaded_error"  # type: ignore[index]


async def test_bad_requests_and_aiohttps_errors_in_anthropics_shape(served):
    server, _ = served
    base = f"http://{server.host}:{server.port}/v1/messages"
    async with aiohttp.ClientSession() as s:
        for method, url, body, status in [
            ("POST", base, {"model": "tiny", "messages": HI}, 400),  # no max_tokens
            ("POST", base, "not json", 400),
            ("GET", base, None, 405),
            ("POST", base, {"pad": "x" * 5000}, 413),
            ("POST", base + "/nope", {}, 404),
        ]:
            kwargs = {"data": body} if isinstance(body, str) else {"json": body}
            async with s.request(method, url, **kwargs) as r:
                got = await r.json()
                assert r.status == status, got
                assert got["type"] == "error", got
                assert got["error"]["type"] in ("invalid_request_error", "not_found_error",
                                                "request_too_large"), got  # fmt: skip
