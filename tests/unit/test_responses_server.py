"""The Responses edge of the HTTP server over a fake router backend on a loopback port and a
real SQLite store: the official ``openai`` SDK parses what the server sends (objects, events,
errors). The real mesh is in tests/integration/test_responses_router.py."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import openai
import pytest

from kvmesh import errors
from kvmesh.v1 import router_pb2
from services.router.continuation import Prior
from services.router.http import OpenAIServer
from services.router.state import ResponseStore
from services.router.state.sqlite_store import SqliteStore

from .test_openai_server import FakeRouter


class RenderingRouter(FakeRouter):
    """The fake router, with a prompt renderer: a first turn's prompt is [1, 2, 3]; a chained
    one extends the prior's ids with [9]."""

    def __init__(self) -> None:
        super().__init__()
        self.priors: list[Prior | None] = []

    async def render_prompt(
        self, request: router_pb2.GenerateRequest, prior: Prior | None, new_from: int
    ) -> tuple[list[int], bool]:
        self.priors.append(prior)
        if prior is None:
            return [1, 2, 3], False
        return [*prior.token_ids, 9], True


@pytest.fixture
async def store(tmp_path: Path) -> AsyncIterator[ResponseStore]:
    s = SqliteStore(tmp_path / "r.sqlite3", ttl_s=60, timeout_s=5)
    yield s
    await s.close()


async def serve(store: ResponseStore, backend: Any, **kw: Any) -> OpenAIServer:
    server = OpenAIServer(port=0, backend=backend, responses_store=store, **kw)
    await server.start()
    return server


def client(server: OpenAIServer, key: str = "sk-x") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=server.base_url, api_key=key, max_retries=0)


async def test_create_retrieve_chain_delete(store: ResponseStore):
    fake = RenderingRouter()
    server = await serve(store, fake)
    try:
        async with client(server) as c:
            first = await c.responses.create(model="tiny", input="hi", instructions="I.")
            assert first.output_text == "Hello" and first.status == "completed"
            assert (await c.responses.retrieve(first.id)).output_text == "Hello"
            events = [
                e
                async for e in await c.responses.create(
                    model="tiny",
                    input="more",
                    instructions="I.",
                    previous_response_id=first.id,
                    stream=True,
                )
            ]
            second = events[-1].response
            assert events[-1].type == "response.completed" and second.output_text == "Hello"
            await c.responses.delete(first.id)
            with pytest.raises(openai.NotFoundError):
                await c.responses.retrieve(first.id)
    finally:
        await server.close()
    assert fake.priors == [None, Prior([1, 2, 3], [])]
    sent = fake.requests[1]
    assert sent.WhichOneof("input") == "token_ids" and list(sent.token_ids.ids) == [1, 2, 3, 9]
    assert sent.session_id == first.id  # the chain is one session
    kept = await store.get(second.id)
    assert kept is not None and list(kept.prompt_ids) == [1, 2, 3, 9]
    assert [m["role"] for m in kept.history] == ["user", "assistant", "user", "assistant"]


async def test_the_sdk_stream_helper_accumulates_the_events(store: ResponseStore):
    """``client.responses.stream`` rebuilds the Response from the events (it appends each
    content part to its item): the snapshot must be the final Response."""
    server = await serve(store, RenderingRouter())
    try:
        async with (
            client(server) as c,
            c.responses.stream(model="tiny", input="hi", max_output_tokens=4) as stream,
        ):
            texts = [e.delta async for e in stream if e.type == "response.output_text.delta"]
            final = await stream.get_final_response()
    finally:
        await server.close()
    assert texts == ["Hel", "lo"]
    assert final.output_text == "Hello" and len(final.output[0].content) == 1  # type: ignore[union-attr]


async def test_responses_belong_to_their_tenant(store: ResponseStore):
    server = await serve(store, RenderingRouter(), api_keys={"k-a": "team-a", "k-b": "team-b"})
    try:
        async with client(server, "k-a") as a, client(server, "k-b") as b:
            mine = await a.responses.create(model="tiny", input="hi")
            with pytest.raises(openai.NotFoundError):
                await b.responses.retrieve(mine.id)
            with pytest.raises(openai.NotFoundError):
                await b.responses.delete(mine.id)
            with pytest.raises(openai.NotFoundError) as nf:
                await b.responses.create(model="tiny", input="x", previous_response_id=mine.id)
            assert nf.value.code == "previous_response_not_found"
            assert (await a.responses.retrieve(mine.id)).id == mine.id
    finally:
        await server.close()


async def test_router_errors_before_and_after_the_first_event(store: ResponseStore):
    fake = RenderingRouter()
    server = await serve(store, fake)
    try:
        async with client(server) as c:
            fake.fail = errors.Unavailable("no worker")
            with pytest.raises(openai.InternalServerError) as exc:
                await c.responses.create(model="tiny", input="hi")
            assert exc.value.status_code == 503
            fake.fail, fake.fail_after = None, errors.DeadlineExceeded("too slow")
            events = [
                e async for e in await c.responses.create(model="tiny", input="hi", stream=True)
            ]
            assert events[-1].type == "error" and "too slow" in events[-1].message
            assert events[-1].code == "timeout"
    finally:
        await server.close()


async def test_a_front_door_without_a_renderer_says_why(store: ResponseStore):
    server = await serve(store, FakeRouter())
    try:
        async with client(server) as c:
            with pytest.raises(openai.InternalServerError, match="own HTTP front door"):
                await c.responses.create(model="tiny", input="hi")
    finally:
        await server.close()


async def test_an_unreachable_store_is_503(tmp_path: Path):
    (tmp_path / "file").write_text("")
    broken = SqliteStore(tmp_path / "file" / "r.sqlite3", ttl_s=60, timeout_s=5)
    server = await serve(broken, RenderingRouter())
    try:
        async with client(server) as c:
            with pytest.raises(openai.InternalServerError, match="responses store") as exc:
                await c.responses.create(model="tiny", input="hi")
            assert exc.value.status_code == 503
            # store: false needs no store
            assert (await c.responses.create(model="tiny", input="hi", store=False)).output_text
    finally:
        await server.close()
        await broken.close()


async def test_no_store_no_endpoint():
    server = OpenAIServer(port=0, backend=RenderingRouter())
    await server.start()
    try:
        async with client(server) as c:
            with pytest.raises(openai.NotFoundError):
                await c.responses.create(model="tiny", input="hi")
    finally:
        await server.close()


async def test_without_max_output_tokens_the_answer_may_fill_the_context(store: ResponseStore):
    """As OpenAI's: no max_output_tokens, the context's room after the prompt (the fake serves a
    64-token context and renders a 3-token prompt), not the router's chat default."""
    fake = RenderingRouter()
    server = await serve(store, fake)
    try:
        async with client(server) as c:
            await c.responses.create(model="tiny", input="hi")
            await c.responses.create(model="tiny", input="hi", max_output_tokens=5)
    finally:
        await server.close()
    assert [r.sampling.max_tokens for r in fake.requests] == [61, 5]
