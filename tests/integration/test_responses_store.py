"""One conformance suite for both response stores (``services/router/state``): embedded SQLite
and a real redis-server. Round trip of a record (its token ids exactly), missing ids, delete,
overwrite, expiry, a record surviving a reopen of its store (SQLite file: a router restart;
Redis: another router), and an unreachable store as UNAVAILABLE."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from kvmesh import errors
from services.router.state import (
    ResponsesConfig,
    ResponseStore,
    StoredResponse,
    StoreKind,
    open_store,
)

from .local_redis import LocalRedis

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]


def record(rid: str = "resp_1", tenant: str = "", n: int = 5000) -> StoredResponse:
    return StoredResponse(
        id=rid,
        tenant=tenant,
        session_id="sess",
        created_at=1.5,
        model="tiny",
        response={"id": rid, "object": "response", "output": [{"type": "message"}]},
        history=({"role": "user", "content": "héllo"}, {"role": "assistant", "content": "hi"}),
        instructions="Be terse.",
        tools_key="",
        prompt_ids=list(range(n)),
        output_ids=[4_000_000_000, 7, 1],
    )


def config(kind: str, tmp_path: Path, redis: LocalRedis, **kw: Any) -> ResponsesConfig:
    return ResponsesConfig(
        store=StoreKind(kind), sqlite_path=tmp_path / "r.sqlite3", redis_url=redis.url, **kw
    )


@pytest.fixture(params=["sqlite", "redis"])
def kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
async def store(
    kind: str, tmp_path: Path, redis_server: LocalRedis, request: pytest.FixtureRequest
) -> AsyncIterator[ResponseStore]:
    s = open_store(config(kind, tmp_path, redis_server), f"c-{request.node.name}")
    yield s
    await s.close()


async def test_round_trip(store: ResponseStore):
    await store.put(record())
    got = await store.get("resp_1")
    assert got == record()
    assert list(got.prompt_ids) == list(range(5000)) and list(got.output_ids) == [
        4_000_000_000,
        7,
        1,
    ]
    assert await store.get("resp_missing") is None


async def test_overwrite_and_delete(store: ResponseStore):
    await store.put(record(n=3))
    await store.put(record(n=4))
    got = await store.get("resp_1")
    assert got is not None and len(got.prompt_ids) == 4
    assert await store.delete("resp_1") is True
    assert await store.get("resp_1") is None
    assert await store.delete("resp_1") is False


async def test_expired_records_are_gone(kind: str, tmp_path: Path, redis_server: LocalRedis):
    s = open_store(config(kind, tmp_path, redis_server, ttl_s=0.2), "c-expiry")
    try:
        await s.put(record("resp_short"))
        assert await s.get("resp_short") is not None
        await asyncio.sleep(0.4)
        assert await s.get("resp_short") is None
        assert await s.delete("resp_short") is False
    finally:
        await s.close()


async def test_a_second_store_sees_the_record(kind: str, tmp_path: Path, redis_server: LocalRedis):
    """SQLite: the file after its store closed (a router restart). Redis: a second client
    (another router) while the first is open."""
    first = open_store(config(kind, tmp_path, redis_server), "c-shared")
    await first.put(record("resp_shared", tenant="team-a"))
    if kind == "sqlite":
        await first.close()
    second = open_store(config(kind, tmp_path, redis_server), "c-shared")
    try:
        got = await second.get("resp_shared")
        assert got is not None and got.tenant == "team-a" and got.history == record().history
    finally:
        await second.close()
        if kind == "redis":
            await first.close()


async def test_clusters_do_not_share_redis_keys(redis_server: LocalRedis, tmp_path: Path):
    a = open_store(config("redis", tmp_path, redis_server), "c-one")
    b = open_store(config("redis", tmp_path, redis_server), "c-two")
    try:
        await a.put(record("resp_scoped"))
        assert await b.get("resp_scoped") is None
    finally:
        await a.close()
        await b.close()


async def test_an_unreachable_store_is_unavailable(tmp_path: Path):
    dead = ResponsesConfig(store=StoreKind.REDIS, redis_url="redis://127.0.0.1:1/0", timeout_s=1)
    s = open_store(dead, "c-dead")
    with pytest.raises(errors.Unavailable, match=r"redis at redis://127\.0\.0\.1:1/0"):
        await s.get("resp_1")
    await s.close()
    blocked = tmp_path / "file"
    blocked.write_text("")
    s = open_store(ResponsesConfig(sqlite_path=blocked / "r.sqlite3"), "c-dead")
    with pytest.raises(errors.Unavailable, match="sqlite at"):
        await s.put(record())
    await s.close()


def test_config_rejects_bad_values():
    with pytest.raises(errors.InvalidArgument, match="--responses-ttl-s"):
        ResponsesConfig(ttl_s=0)
    with pytest.raises(errors.InvalidArgument, match=r"\*\*\*@host"):
        ResponsesConfig(store=StoreKind.REDIS, redis_url="http://:secret@host:1")
