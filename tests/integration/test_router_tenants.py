"""API keys on a real router (simulated workers behind the real worker service, a real etcd):
its gRPC API on loopback and its OpenAI front door driven by the official ``openai`` client.
No or a wrong key: UNAUTHENTICATED / 401; a known key asking another tenant's name or more
priority than its tenant holds: PERMISSION_DENIED / 403 saying what to fix; a good key: the
servicer sees the tenant the key names. Health, reflection, /health, /version and /metrics
stay open. The key file is re-read when it changes (and on SIGHUP's ``reload_keys``)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import anthropic
import grpc
import openai
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from kvmesh.client import RouterClient, make_request
from kvmesh.v1 import common_pb2, router_pb2, router_pb2_grpc
from services.router.config import RouterConfig
from services.router.core.auth import DEFAULT_SALT_SEED, derive_cache_salt, hash_key
from services.router.main import RunningRouter, start_router
from services.worker.config import WorkerConfig
from services.worker.server import start_worker
from tests.support import eventually

from .test_router_metrics import sim_engine

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

SEARCH_KEY, BATCH_KEY, LATE_KEY = "sk-search", "sk-batch", "sk-late"
PROMPT = list(range(1, 65))


def key_file_tree(**extra: dict[str, Any]) -> dict[str, Any]:
    return {
        "tenants": {
            "search": {"priority": 10, "keys": [f"sha256:{hash_key(SEARCH_KEY)}"]},
            "batch": {"keys": [hash_key(BATCH_KEY)]},
            **extra,
        }
    }


@dataclass
class Seen:
    """What the servicer was asked: (tenant, priority) per request, past the auth edges."""

    requests: list[tuple[str, int]] = field(default_factory=list)
    salts: list[str] = field(default_factory=list)  # the cache_salt of each


@dataclass
class Tenanted:
    router: RunningRouter
    key_file: Path
    seen: Seen
    stub: router_pb2_grpc.RouterStub
    channel: grpc.aio.Channel


@contextlib.contextmanager
def spying(router: RunningRouter) -> Iterator[Seen]:
    """Records the tenant and priority of every request reaching the servicer's ``stream``
    (what both front doors call)."""
    seen = Seen()
    servicer = router.servicer
    original = servicer.stream

    def stream(request: router_pb2.GenerateRequest, rid: str, left: float | None) -> Any:
        seen.requests.append((request.tenant, request.priority))
        seen.salts.append(request.cache_salt)
        return original(request, rid, left)

    servicer.stream = stream  # type: ignore[method-assign]
    try:
        yield seen
    finally:
        servicer.stream = original  # type: ignore[method-assign]


@pytest.fixture(scope="module")
async def mesh(etcd, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Tenanted]:
    name = "tenants"
    key_file = tmp_path_factory.mktemp("keys") / "keys.yaml"
    key_file.write_text(yaml.safe_dump(key_file_tree()))
    endpoints = tuple(etcd.endpoints)
    worker = await start_worker(
        WorkerConfig(worker_id="sim-t", cluster=name, etcd_endpoints=endpoints, drain_grace_s=1),
        sim_engine(),
    )
    router = await start_router(
        RouterConfig(
            cluster=name,
            etcd_endpoints=endpoints,
            drain_grace_s=1.0,
            api_keys_file=key_file,
            api_keys_reload_s=0.05,
        )
    )
    try:
        async with grpc.aio.insecure_channel(router.address) as channel:
            stub = router_pb2_grpc.RouterStub(channel)
            await eventually(lambda: len(router.workers) > 0, what="the worker is known")
            with spying(router) as seen:
                yield Tenanted(router, key_file, seen, stub, channel)
    finally:
        await router.stop()
        await worker.stop()


def bearer(key: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {key}"),)


async def generate(stub: router_pb2_grpc.RouterStub, metadata: Any, **fields: Any) -> list[Any]:
    call = stub.Generate(
        make_request(PROMPT, max_tokens=2, **fields), metadata=metadata, timeout=30
    )
    return [msg async for msg in call]


# ---- gRPC ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("metadata", "fields", "code", "says"),
    [
        pytest.param((), {}, grpc.StatusCode.UNAUTHENTICATED, "no API key", id="no-key"),
        pytest.param(
            bearer("sk-wrong"), {}, grpc.StatusCode.UNAUTHENTICATED, "not valid", id="wrong-key"
        ),
        pytest.param(
            (("authorization", "Basic c2stc2VhcmNo"),),
            {},
            grpc.StatusCode.UNAUTHENTICATED,
            "no API key",
            id="basic-auth",
        ),
        pytest.param(
            bearer(BATCH_KEY),
            {"tenant": "search"},
            grpc.StatusCode.PERMISSION_DENIED,
            "belongs to tenant 'batch', not 'search': leave tenant unset",
            id="other-tenant",
        ),
        pytest.param(
            bearer(BATCH_KEY),
            {"priority": 5},
            grpc.StatusCode.PERMISSION_DENIED,
            "tenant 'batch' may ask priority at most 0, not 5",
            id="priority-above-class",
        ),
    ],
)
async def test_grpc_refused(
    mesh: Tenanted, metadata: Any, fields: dict[str, Any], code: grpc.StatusCode, says: str
):
    before = len(mesh.seen.requests)
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await generate(mesh.stub, metadata, **fields)
    assert refused.value.code() is code
    assert says in (refused.value.details() or ""), refused.value.details()
    assert len(mesh.seen.requests) == before  # refused before the servicer


@pytest.mark.parametrize(
    ("metadata", "fields", "seen"),
    [
        pytest.param(bearer(SEARCH_KEY), {}, ("search", 10), id="class-by-default"),
        pytest.param(
            bearer(SEARCH_KEY), {"tenant": "search", "priority": 3}, ("search", 3), id="own-lower"
        ),
        pytest.param((("x-api-key", BATCH_KEY),), {}, ("batch", 0), id="x-api-key"),
        pytest.param(bearer(BATCH_KEY), {"priority": -4}, ("batch", -4), id="below-class"),
    ],
)
async def test_grpc_tenant_is_the_keys(
    mesh: Tenanted, metadata: Any, fields: dict[str, Any], seen: tuple[str, int]
):
    msgs = await generate(mesh.stub, metadata, **fields)
    assert msgs[-1].HasField("finished")
    assert mesh.seen.requests[-1] == seen


async def test_the_python_client_and_cli_send_the_api_key(mesh: Tenanted):
    async with RouterClient(mesh.router.address, api_key=SEARCH_KEY) as client:
        done = await client.complete(make_request(PROMPT, max_tokens=2), timeout_s=30)
        assert done.usage is not None and mesh.seen.requests[-1] == ("search", 10)
        assert [m.name for m in (await client.list_models()).models]
    async with RouterClient(mesh.router.address) as client:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await client.complete(make_request(PROMPT, max_tokens=2), timeout_s=30)
    assert err.value.code() is grpc.StatusCode.UNAUTHENTICATED
    cli = [sys.executable, "-m", "kvmesh.cli", "generate", "--router", mesh.router.address]
    cli += ["--token-ids", "--max-tokens", "2", " ".join(map(str, PROMPT))]
    env = {**os.environ, "KVMESH_API_KEY": BATCH_KEY}
    ok = await asyncio.to_thread(
        subprocess.run, cli, capture_output=True, text=True, env=env, timeout=60
    )
    assert ok.returncode == 0, ok.stderr
    assert mesh.seen.requests[-1] == ("batch", 0)
    refused = await asyncio.to_thread(
        subprocess.run, [*cli, "--api-key", "sk-wrong"], capture_output=True, text=True, timeout=60
    )
    assert refused.returncode == 1 and "UNAUTHENTICATED" in refused.stderr, refused.stderr


async def test_grpc_list_models_needs_a_key_health_and_reflection_do_not(mesh: Tenanted):
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await mesh.stub.ListModels(router_pb2.ListModelsRequest(), timeout=5)
    assert refused.value.code() is grpc.StatusCode.UNAUTHENTICATED
    models = await mesh.stub.ListModels(
        router_pb2.ListModelsRequest(), metadata=bearer(SEARCH_KEY), timeout=5
    )
    assert [m.name for m in models.models] == ["sim"]
    health = health_pb2_grpc.HealthStub(mesh.channel)
    ok = await health.Check(health_pb2.HealthCheckRequest(service="kvmesh.v1.Router"), timeout=5)
    assert ok.status == health_pb2.HealthCheckResponse.SERVING
    reflect = reflection_pb2_grpc.ServerReflectionStub(mesh.channel)
    answers = reflect.ServerReflectionInfo(
        iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5
    )
    names = {s.name async for a in answers for s in a.list_services_response.service}
    assert "kvmesh.v1.Router" in names


async def test_abort_is_the_tenants_own(mesh: Tenanted):
    """Another tenant aborting a request in flight is told it is not there; its own tenant
    aborts it (the stream ends with reason ABORT)."""
    request = make_request(PROMPT, max_tokens=3000, ignore_eos=True, request_id="search-long")
    call = mesh.stub.Generate(request, metadata=bearer(SEARCH_KEY), timeout=60)
    await anext(aiter(call))  # in flight: its first tokens came
    abort = common_pb2.AbortRequest(request_id="search-long")
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await mesh.stub.Abort(abort, metadata=bearer(BATCH_KEY), timeout=5)
    assert refused.value.code() is grpc.StatusCode.NOT_FOUND
    await mesh.stub.Abort(abort, metadata=bearer(SEARCH_KEY), timeout=5)
    rest = [msg async for msg in call]
    assert rest[-1].finished.reason == common_pb2.FINISH_REASON_ABORT


# ---- HTTP, through the official openai client ------------------------------------------------
def openai_client(mesh: Tenanted, key: str) -> openai.AsyncOpenAI:
    assert mesh.router.http is not None
    return openai.AsyncOpenAI(base_url=mesh.router.http.base_url, api_key=key, max_retries=0)


@pytest.mark.parametrize(
    ("key", "headers", "exc", "status", "code", "says"),
    [
        pytest.param(
            "sk-wrong",
            {},
            openai.AuthenticationError,
            401,
            "invalid_api_key",
            "not valid",
            id="wrong-key",
        ),
        pytest.param(
            BATCH_KEY,
            {"x-kvmesh-tenant": "search"},
            openai.PermissionDeniedError,
            403,
            "permission_denied",
            "leave header x-kvmesh-tenant unset",
            id="other-tenant",
        ),
        pytest.param(
            SEARCH_KEY,
            {"x-kvmesh-priority": "11"},
            openai.PermissionDeniedError,
            403,
            "permission_denied",
            "at most 10, not 11: lower header x-kvmesh-priority",
            id="priority-above-class",
        ),
    ],
)
async def test_http_refused(
    mesh: Tenanted,
    key: str,
    headers: dict[str, str],
    exc: type[openai.APIStatusError],
    status: int,
    code: str,
    says: str,
):
    before = len(mesh.seen.requests)
    async with openai_client(mesh, key) as client:
        for stream in (False, True):
            with pytest.raises(exc) as refused:
                await client.completions.create(
                    model="sim", prompt=PROMPT, max_tokens=2, stream=stream, extra_headers=headers
                )
            assert refused.value.status_code == status
            body = refused.value.body
            assert isinstance(body, dict) and set(body) == {"message", "type", "param", "code"}
            assert body["code"] == code and says in body["message"], body
    assert len(mesh.seen.requests) == before


async def test_http_tenant_is_the_keys(mesh: Tenanted):
    async with openai_client(mesh, SEARCH_KEY) as client:
        done = await client.completions.create(
            model="sim",
            prompt=PROMPT,
            max_tokens=2,
            extra_headers={"x-kvmesh-tenant": "search", "x-kvmesh-priority": "2"},
        )
        assert done.choices[0].finish_reason == "length"
        assert mesh.seen.requests[-1] == ("search", 2)
        assert [m.id for m in (await client.models.list()).data] == ["sim"]
    async with openai_client(mesh, "sk-wrong") as client:
        with pytest.raises(openai.AuthenticationError):
            await client.models.list()  # behind the key, as OpenAI's


async def test_the_cache_salt_is_the_tenants_whatever_the_client_sends(mesh: Tenanted):
    """Both front doors replace a client's cache_salt with its tenant's: the same prompt is
    cached per tenant (the second of one tenant hits, the other tenant's misses), and a
    client naming another tenant's salt gets its own anyway."""
    search, batch = (derive_cache_salt(DEFAULT_SALT_SEED, t) for t in ("search", "batch"))
    assert search != batch
    prompt = [7 + i % 900 for i in range(4 * 32)]  # no other test's prefix

    cached = []
    for key, sent in [(SEARCH_KEY, ""), (SEARCH_KEY, batch), (BATCH_KEY, search)]:
        call = mesh.stub.Generate(
            make_request(prompt, max_tokens=2, cache_salt=sent), metadata=bearer(key), timeout=30
        )
        msgs = [m async for m in call]
        cached.append(msgs[-1].finished.usage.cached_prompt_tokens)
    assert mesh.seen.salts[-3:] == [search, search, batch]
    assert cached == [0, 4 * 32 - 32, 0]  # search hits its own blocks; batch none of them

    async with openai_client(mesh, BATCH_KEY) as client:
        done = await client.completions.create(
            model="sim", prompt=prompt, max_tokens=2, extra_body={"cache_salt": search}
        )
    assert mesh.seen.salts[-1] == batch
    assert done.usage is not None and done.usage.prompt_tokens_details is not None
    assert (
        done.usage.prompt_tokens_details.cached_tokens == 4 * 32 - 32
    )  # batch's own, not search's


async def test_http_open_paths_and_anthropic_style_key(mesh: Tenanted):
    assert mesh.router.http is not None
    base = f"http://{mesh.router.http.host}:{mesh.router.http.port}"
    async with aiohttp.ClientSession() as s:
        for path in ("/health", "/version", "/metrics"):
            async with s.get(base + path) as r:
                assert r.status == 200, path
        async with s.get(base + "/v1/nowhere") as r:
            assert r.status == 404  # no route: as before, not a 401
        async with s.get(base + "/v1/models") as r:
            assert r.status == 401
            assert r.headers["WWW-Authenticate"].startswith("Bearer")
        async with s.get(base + "/v1/models", headers={"x-api-key": BATCH_KEY}) as r:
            assert r.status == 200


async def test_anthropic_sdk_sees_its_own_refusals(mesh: Tenanted):
    """/v1/messages refuses a wrong key in Anthropic's error shape (the SDK's own exception
    types), and a known key asking for another tenant gets 403."""
    assert mesh.router.http is not None
    base = f"http://{mesh.router.http.host}:{mesh.router.http.port}"
    msg = {"model": "sim", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    async with anthropic.AsyncAnthropic(base_url=base, api_key="sk-wrong", max_retries=0) as c:
        with pytest.raises(anthropic.AuthenticationError) as refused:
            await c.messages.create(**msg)
    assert refused.value.body["error"]["type"] == "authentication_error"  # type: ignore[index]
    async with anthropic.AsyncAnthropic(base_url=base, api_key=BATCH_KEY, max_retries=0) as c:
        with pytest.raises(anthropic.PermissionDeniedError) as denied:
            await c.messages.create(**msg, extra_headers={"x-kvmesh-tenant": "search"})
    assert denied.value.body["error"]["type"] == "permission_error"  # type: ignore[index]


# ---- reloads ---------------------------------------------------------------------------------
async def models_with(mesh: Tenanted, key: str) -> grpc.StatusCode:
    try:
        await mesh.stub.ListModels(router_pb2.ListModelsRequest(), metadata=bearer(key), timeout=5)
    except grpc.aio.AioRpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


async def test_key_file_reloads(mesh: Tenanted):
    keys = mesh.router.keys
    assert keys is not None

    async def rewrite(tree: dict[str, Any]) -> None:
        reloads = keys.reloads
        mesh.key_file.write_text(yaml.safe_dump(tree))
        await eventually(lambda: keys.reloads > reloads, what="the changed key file is reloaded")

    assert await models_with(mesh, LATE_KEY) is grpc.StatusCode.UNAUTHENTICATED
    late = {"late": {"priority": 1, "keys": [hash_key(LATE_KEY)]}}
    try:
        await rewrite(key_file_tree(**late))
        assert await models_with(mesh, LATE_KEY) is grpc.StatusCode.OK
        msgs = await generate(mesh.stub, bearer(LATE_KEY))
        assert msgs[-1].HasField("finished") and mesh.seen.requests[-1] == ("late", 1)

        # A broken edit keeps the keys in force (and says so in the log).
        failed = keys.failed_reloads
        mesh.key_file.write_text("tenants: {late: {keys: [sk-late]}}\n")  # a plain key: refused
        await eventually(lambda: keys.failed_reloads > failed, what="the bad file is seen")
        assert await models_with(mesh, LATE_KEY) is grpc.StatusCode.OK

        # SIGHUP's reload re-reads the file even when it looks unchanged.
        await rewrite(key_file_tree(**late))
        reloads = keys.reloads
        mesh.router.reload_keys()
        await eventually(lambda: keys.reloads > reloads, what="the SIGHUP reload")
    finally:
        await rewrite(key_file_tree())
    assert await models_with(mesh, LATE_KEY) is grpc.StatusCode.UNAUTHENTICATED  # removed


async def test_static_api_keys_guard_grpc_too(etcd):
    router = await start_router(
        RouterConfig(
            cluster="tenants-static",
            etcd_endpoints=tuple(etcd.endpoints),
            drain_grace_s=1.0,
            api_keys=("sk-static",),
            http_port=-1,
        )
    )
    try:
        async with grpc.aio.insecure_channel(router.address) as channel:
            stub = router_pb2_grpc.RouterStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.ListModels(router_pb2.ListModelsRequest(), timeout=5)
            assert refused.value.code() is grpc.StatusCode.UNAUTHENTICATED
            await stub.ListModels(
                router_pb2.ListModelsRequest(), metadata=bearer("sk-static"), timeout=5
            )
    finally:
        await router.stop()
