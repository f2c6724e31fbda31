"""The OpenAI HTTP edge over a fake router backend on a loopback port: SSE framing, headers,
status codes, auth, body limit, and a disconnect closing the router call. The official openai
client parses what the server sends (the real mesh is in tests/e2e/test_openai.py)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import aiohttp
import openai
import pytest

from kvmesh import errors
from kvmesh.v1 import common_pb2, router_pb2
from services.router.http import OpenAIServer
from services.router.metrics import RouterMetrics


class FakeRouter:
    """Answers every request with ``texts`` then a finished chunk; ``fail`` raises before the
    first chunk, ``fail_after`` after it; ``hang`` waits forever after the first chunk."""

    def __init__(self) -> None:
        self.texts = ["Hel", "lo"]
        self.fail: errors.KvmeshError | None = None
        self.fail_after: errors.KvmeshError | None = None
        self.hang = False
        self.requests: list[router_pb2.GenerateRequest] = []
        self.closed: list[str] = []
        self.hanging = asyncio.Event()

    async def generate(
        self, request: router_pb2.GenerateRequest, timeout_s: float
    ) -> AsyncIterator[router_pb2.GenerateResponse]:
        self.requests.append(request)
        try:
            if self.fail is not None:
                raise self.fail
            for t in self.texts:
                yield router_pb2.GenerateResponse(request_id=request.request_id, text=t)
                if self.fail_after is not None:
                    raise self.fail_after
                if self.hang:
                    self.hanging.set()
                    await asyncio.Event().wait()
            last = router_pb2.GenerateResponse(request_id=request.request_id)
            last.finished.reason = common_pb2.FINISH_REASON_STOP
            last.finished.usage.CopyFrom(
                common_pb2.Usage(
                    prompt_tokens=7,
                    cached_prompt_tokens=3,
                    completion_tokens=len(self.texts),
                    worker_id="w-1",
                )
            )
            yield last
        finally:
            self.closed.append(request.request_id)

    async def list_models(self, timeout_s: float) -> router_pb2.ListModelsResponse:
        return router_pb2.ListModelsResponse(
            models=[router_pb2.ModelInfo(name="tiny", max_model_len=64, block_size=4, workers=1)]
        )

    async def close(self) -> None:
        pass


@pytest.fixture
async def served() -> AsyncIterator[tuple[OpenAIServer, FakeRouter]]:
    fake = FakeRouter()
    server = OpenAIServer(port=0, backend=fake, max_body_bytes=4096)
    await server.start()
    try:
        yield server, fake
    finally:
        await server.close()


def client(server: OpenAIServer, key: str = "EMPTY") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=server.base_url, api_key=key, max_retries=0)


async def test_chat_non_streaming(served):
    server, fake = served
    async with client(server) as c:
        raw = await c.chat.completions.with_raw_response.create(
            model="tiny",
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=4,
            extra_headers={"x-kvmesh-session-id": "s1", "x-kvmesh-priority": "2"},
        )
    resp = raw.parse()
    assert resp.choices[0].message.content == "Hello"
    assert resp.usage is not None and resp.usage.prompt_tokens_details is not None
    assert resp.usage.prompt_tokens_details.cached_tokens == 3
    assert raw.headers["x-kvmesh-worker"] == "w-1"
    assert raw.headers["x-kvmesh-cached-tokens"] == "3"
    assert (resp.model_extra or {})["kvmesh"]["worker_id"] == "w-1"
    req = fake.requests[0]
    assert (req.session_id, req.priority, req.request_id) == ("s1", 2, resp.id)
    assert req.tenant.startswith("key-")


async def test_chat_streaming_sse_framing(served):
    server, _ = served
    async with (
        aiohttp.ClientSession() as s,
        s.post(
            server.base_url + "/chat/completions",
            json={
                "model": "tiny",
                "messages": [{"role": "user", "content": "hi"}],
                "stream": True,
                "stream_options": {"include_usage": True},
            },
        ) as r,
    ):
        assert r.status == 200 and r.headers["Content-Type"].startswith("text/event-stream")
        raw = (await r.read()).decode()
    events = raw.split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""]
    payloads = [json.loads(e.removeprefix("data: ")) for e in events[:-2]]
    assert [p["choices"][0]["delta"] for p in payloads[:-1]] == [
        {"role": "assistant", "content": ""},
        {"content": "Hel"},
        {"content": "lo"},
        {},
    ]
    assert payloads[-2]["kvmesh"]["worker_id"] == "w-1"
    assert payloads[-1]["usage"]["prompt_tokens_details"] == {"cached_tokens": 3}


async def test_completions_streaming_with_the_openai_client(served):
    server, _ = served
    async with client(server) as c:
        stream = await c.completions.create(model="tiny", prompt="x", stream=True, max_tokens=2)
        text = "".join([chunk.choices[0].text async for chunk in stream if chunk.choices])
    assert text == "Hello"


@pytest.mark.parametrize(
    ("fail", "exc", "status"),
    [
        pytest.param(
            errors.NotFound("model 'x' is not served"), openai.NotFoundError, 404, id="404"
        ),
        pytest.param(
            errors.InvalidArgument("prompt too long"), openai.BadRequestError, 400, id="400"
        ),
        pytest.param(errors.ResourceExhausted("busy"), openai.RateLimitError, 429, id="429"),
        pytest.param(errors.Unavailable("no worker"), openai.InternalServerError, 503, id="503"),
        pytest.param(errors.DeadlineExceeded("late"), openai.InternalServerError, 504, id="504"),
    ],
)
@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
async def test_router_errors_map_even_when_streaming(served, fail, exc, status, stream):
    server, fake = served
    fake.fail = fail
    async with client(server) as c:
        with pytest.raises(exc) as err:
            await c.chat.completions.create(
                model="x", messages=[{"role": "user", "content": "hi"}], stream=stream
            )
    assert err.value.status_code == status
    assert err.value.body["message"] == str(fail)  # type: ignore[index]


async def test_error_mid_stream_is_an_sse_error_event(served):
    server, fake = served
    fake.fail_after = errors.Unavailable("worker died")
    async with client(server) as c:
        stream = await c.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], stream=True
        )
        with pytest.raises(openai.APIError, match="worker died"):
            async for _ in stream:
                pass


async def test_local_errors(served):
    server, _ = served
    url = server.base_url
    async with aiohttp.ClientSession() as s:
        cases = [
            (s.post(url + "/chat/completions", data=b"{nope"), 400, None),
            (s.post(url + "/chat/completions", json={"messages": [], "n": 0}), 400, "n"),
            (s.post(url + "/completions", data=b"x" * 5000), 413, None),
            (s.get(url + "/nothing"), 404, None),
            (s.get(url + "/chat/completions"), 405, None),
            (s.get(url + "/models/absent"), 404, None),
        ]
        for call, status, param in cases:
            async with call as r:
                body = await r.json()
                assert r.status == status, body
                assert set(body["error"]) == {"message", "type", "param", "code"}
                assert body["error"]["param"] == param


async def test_api_keys():
    fake = FakeRouter()
    server = OpenAIServer(port=0, backend=fake, api_keys={"sk-good": "team-a"})
    await server.start()
    try:
        async with client(server, "sk-bad") as c:
            with pytest.raises(openai.AuthenticationError):
                await c.models.list()
        async with client(server, "sk-good") as c:
            assert [m.id for m in (await c.models.list()).data] == ["tiny"]
            await c.completions.create(model="tiny", prompt="x", max_tokens=2)
        assert fake.requests[0].tenant == "team-a"
    finally:
        await server.close()


async def test_client_disconnect_closes_the_router_call(served):
    server, fake = served
    fake.hang = True
    for stream in (True, False):
        fake.hanging.clear()
        async with aiohttp.ClientSession() as s:
            req = asyncio.ensure_future(
                s.post(
                    server.base_url + "/completions",
                    json={"model": "tiny", "prompt": "x", "stream": stream},
                )
            )
            await asyncio.wait_for(fake.hanging.wait(), 5)
            if stream:
                resp = await req
                await resp.content.readline()
                resp.close()
            else:
                req.cancel()
        rid = fake.requests[-1].request_id
        for _ in range(100):
            if rid in fake.closed:
                break
            await asyncio.sleep(0.02)
        assert rid in fake.closed, f"stream={stream}: the router call was not closed"


async def test_requests_are_counted_by_endpoint_and_http_status():
    fake = FakeRouter()
    metrics = RouterMetrics()
    server = OpenAIServer(port=0, backend=fake, max_body_bytes=4096, metrics=metrics)
    await server.start()
    url = server.base_url
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
    try:
        async with aiohttp.ClientSession() as s:
            calls = [
                s.post(url + "/chat/completions", json=chat),
                s.post(url + "/chat/completions", json={**chat, "stream": True}),
                s.post(url + "/chat/completions", data=b"{nope"),
                s.post(url + "/completions", data=b"x" * 5000),
                s.get(url + "/models"),
                s.get(url + "/models/tiny"),
                s.get(url + "/models/absent"),
                s.get(url + "/nothing"),
                s.get(url + "/chat/completions"),
            ]
            for call in calls:
                async with call as r:
                    await r.read()
            fake.fail = errors.Unavailable("no worker")
            async with s.post(url + "/completions", json={"model": "tiny", "prompt": "x"}) as r:
                assert r.status == 503
            fake.fail, fake.hang = None, True
            req = asyncio.ensure_future(
                s.post(url + "/completions", json={"model": "tiny", "prompt": "x"})
            )
            await asyncio.wait_for(fake.hanging.wait(), 5)
            req.cancel()  # the client goes away: 499
            for _ in range(100):
                if fake.closed[-1:] == [fake.requests[-1].request_id]:
                    break
                await asyncio.sleep(0.02)
    finally:
        await server.close()
    counts = {
        (sample.labels["endpoint"], sample.labels["code"]): sample.value
        for family in metrics.registry.collect()
        if family.name == "kvmesh_router_http_requests"
        for sample in family.samples
        if sample.name == "kvmesh_router_http_requests_total"
    }
    assert counts == {
        ("/v1/chat/completions", "200"): 2,
        ("/v1/chat/completions", "400"): 1,
        ("/v1/completions", "413"): 1,
        ("/v1/completions", "503"): 1,
        ("/v1/completions", "499"): 1,
        ("/v1/models", "200"): 1,
        ("/v1/models/{model}", "200"): 1,
        ("/v1/models/{model}", "404"): 1,
        ("other", "404"): 1,
        ("other", "405"): 1,
    }
