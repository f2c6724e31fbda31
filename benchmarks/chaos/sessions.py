"""The load of ``kvmesh bench chaos``: K concurrent multi-turn agent sessions, greedy, over the
router's gRPC API and its OpenAI HTTP front door, each turn resending the whole conversation.

A session is deterministic (its first prompt and every user turn come from its seed; greedy
outputs), so the same turn of the same session has the same prompt in every run while the
outputs match: that is how a faulted run's outputs are compared with the no-fault run's. A
session that reaches ``turns`` turns starts over as a new conversation (its next generation),
so sessions can run for as long as a fault scenario takes.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import aiohttp
import grpc

from kvmesh.client import RouterClient, make_request

# One turn's outcome. ``key`` = (api, session, generation, turn) names the same turn across runs.
OK, FAILED_BEFORE_FIRST, FAILED_MID, HUNG = "ok", "failed-before-first", "failed-mid", "hung"


@dataclass(frozen=True, slots=True)
class LoadSpec:
    sessions: int = 8  # concurrent sessions per API
    turns: int = 6  # turns of one conversation before the session starts a new one
    first_prompt_tokens: int = 256  # token ids of a conversation's first prompt (gRPC)
    turn_tokens: int = 32  # new user tokens each turn (gRPC)
    max_tokens: int = 48  # output tokens a turn
    request_timeout_s: float = 120.0  # a turn not finished by then counts as hung
    vocab_low: int = 5
    vocab_high: int = 1000
    model: str = "tiny"


@dataclass(slots=True)
class TurnResult:
    key: tuple[str, int, int, int]
    outcome: str
    latency_s: float
    output: str  # token ids (gRPC, as text) or text (HTTP): compared across runs
    resumes: int = 0
    error: str = ""
    prompt_tokens: int = 0  # from the final usage (gRPC)
    recomputed_tokens: int = 0  # prompt tokens the resumed attempts prefilled again (gRPC)
    router: int = -1  # HTTP: the index of the router the last attempt went to


@dataclass(slots=True)
class LoadResult:
    turns: list[TurnResult] = field(default_factory=list)

    def by_key(self) -> dict[tuple[str, int, int, int], TurnResult]:
        return {t.key: t for t in self.turns}


def _words(rng: random.Random, n: int) -> str:
    return " ".join(f"w{rng.randrange(1000)}" for _ in range(n))


async def _grpc_session(
    client: RouterClient, spec: LoadSpec, s: int, stop: asyncio.Event, out: LoadResult
) -> None:
    gen = 0
    while not stop.is_set():
        rng = random.Random(f"grpc-{s}-{gen}")
        prompt = [
            rng.randrange(spec.vocab_low, spec.vocab_high) for _ in range(spec.first_prompt_tokens)
        ]
        for turn in range(spec.turns):
            if stop.is_set():
                return
            key = ("grpc", s, gen, turn)
            req = make_request(
                prompt,
                max_tokens=spec.max_tokens,
                temperature=0.0,
                ignore_eos=True,
                session_id=f"grpc-{s}-{gen}",
                request_id=f"chaos-grpc-{s}-{gen}-{turn}-{time.monotonic_ns()}",
            )
            start = time.monotonic()
            got: list[int] = []
            resumes = prompt_tokens = recomputed = 0
            try:
                async with asyncio.timeout(spec.request_timeout_s):
                    async for chunk in client.stream(req, timeout_s=spec.request_timeout_s + 5):
                        got.extend(chunk.token_ids)
                        if chunk.HasField("finished"):
                            u = chunk.finished.usage
                            resumes, prompt_tokens = u.resumes, u.prompt_tokens
                            recomputed = u.resume_recomputed_tokens
                outcome, error = OK, ""
            except TimeoutError:
                outcome, error = HUNG, "no answer in time"
            except grpc.aio.AioRpcError as exc:
                outcome = FAILED_MID if got else FAILED_BEFORE_FIRST
                error = f"{exc.code().name}: {exc.details()}"
            out.turns.append(
                TurnResult(
                    key,
                    outcome,
                    time.monotonic() - start,
                    ",".join(map(str, got)),
                    resumes,
                    error,
                    prompt_tokens,
                    recomputed,
                )
            )
            if outcome != OK:
                break  # the conversation cannot go on from a broken turn: start a new one
            prompt = (
                prompt
                + got
                + [rng.randrange(spec.vocab_low, spec.vocab_high) for _ in range(spec.turn_tokens)]
            )
        gen += 1


async def _post(
    http: aiohttp.ClientSession,
    base_urls: list[str],
    s: int,
    body: object,
    session: str,
    tried: list[int],
) -> aiohttp.ClientResponse:
    """Session ``s``'s router, or, as a client behind a load balancer (a Kubernetes Service)
    sees it: a connection refused by a dead router, one that broke before any response (a
    pooled keep-alive connection to a router that has since died), or a 503 from one that is
    starting or draining, is retried once on the next router (the OpenAI SDK retries all three
    itself; the Service sends the retry to a live, ready router)."""
    headers = {"x-kvmesh-session-id": session}
    for attempt in range(2):
        i = (s + attempt) % len(base_urls)
        tried.append(i)
        url = base_urls[i]
        try:
            resp = await http.post(f"{url}/completions", json=body, headers=headers)
        except aiohttp.ClientConnectionError:
            if attempt:
                raise
            continue
        if resp.status == 503 and not attempt:
            resp.release()
            continue
        return resp
    raise AssertionError("unreachable")


async def _http_session(
    http: aiohttp.ClientSession,
    base_urls: list[str],
    spec: LoadSpec,
    s: int,
    stop: asyncio.Event,
    out: LoadResult,
) -> None:
    gen = 0
    while not stop.is_set():
        rng = random.Random(f"http-{s}-{gen}")
        prompt = _words(rng, spec.first_prompt_tokens // 2)
        for turn in range(spec.turns):
            if stop.is_set():
                return
            key = ("http", s, gen, turn)
            body = {
                "model": spec.model,
                "prompt": prompt,
                "max_tokens": spec.max_tokens,
                "temperature": 0,
                "ignore_eos": True,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            start = time.monotonic()
            text: list[str] = []
            resumes = 0
            outcome, error = OK, ""
            tried: list[int] = []
            try:
                async with asyncio.timeout(spec.request_timeout_s):
                    resp = await _post(http, base_urls, s, body, f"http-{s}-{gen}", tried)
                    async with resp:
                        if resp.status != 200:
                            outcome = FAILED_BEFORE_FIRST
                            error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                        else:
                            done = False
                            async for raw in resp.content:
                                line = raw.decode().strip()
                                if not line.startswith("data: "):
                                    continue
                                data = line[6:]
                                if data == "[DONE]":
                                    done = True
                                    break
                                msg = json.loads(data)
                                if "error" in msg:
                                    outcome = FAILED_MID if text else FAILED_BEFORE_FIRST
                                    error = str(msg["error"].get("message", msg["error"]))[:200]
                                    break
                                for c in msg.get("choices", []):
                                    text.append(c.get("text", ""))
                                resumes = max(resumes, int(msg.get("kvmesh", {}).get("resumes", 0)))
                            if outcome == OK and not done:
                                outcome = FAILED_MID if text else FAILED_BEFORE_FIRST
                                error = "the stream ended without [DONE]"
            except TimeoutError:
                outcome, error = HUNG, "no answer in time"
            except (aiohttp.ClientError, ConnectionError) as exc:
                outcome = FAILED_MID if text else FAILED_BEFORE_FIRST
                error = f"{type(exc).__name__}: {exc}"
            answer = "".join(text)
            out.turns.append(
                TurnResult(
                    key,
                    outcome,
                    time.monotonic() - start,
                    answer,
                    resumes,
                    error,
                    router=tried[-1] if tried else -1,
                )
            )
            if outcome != OK:
                break
            prompt = f"{prompt}{answer} {_words(rng, spec.turn_tokens // 2)}"
        gen += 1


async def run_load(
    grpc_addresses: str,
    http_base_urls: list[str],
    spec: LoadSpec,
    until: Callable[[], asyncio.Future[object] | asyncio.Task[object]],
    apis: tuple[str, ...] = ("grpc", "http"),
) -> LoadResult:
    """Runs the sessions until ``until()`` (started once the sessions are) completes, then lets
    every turn in flight finish. The no-fault run passes a timer; a scenario, its fault.
    ``grpc_addresses``: the routers, comma-separated (the client fails over between them,
    kvmesh/client.py); ``http_base_urls``: session i talks to router i mod n."""
    out = LoadResult()
    stop = asyncio.Event()
    async with RouterClient(grpc_addresses) as client, aiohttp.ClientSession() as http:
        tasks = []
        if "grpc" in apis:
            tasks += [
                asyncio.create_task(_grpc_session(client, spec, s, stop, out))
                for s in range(spec.sessions)
            ]
        if "http" in apis:
            tasks += [
                asyncio.create_task(_http_session(http, http_base_urls, spec, s, stop, out))
                for s in range(spec.sessions)
            ]
        try:
            await until()
        finally:
            stop.set()
            await asyncio.gather(*tasks)
    return out
