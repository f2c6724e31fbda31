"""The real agent CLIs against a real mesh: Claude Code (``claude -p``, the Anthropic Messages
API through ``ANTHROPIC_BASE_URL``) and Codex (``codex exec``, the Responses API through a model
provider with ``wire_api = "responses"``), each for a turn and a continued one, on a real vLLM
worker (tiny model) behind a real router found through a real etcd. docs/agents.md has the
commands and the versions tested.

The tiny model is random and never writes an end of turn: every answer runs until the context
is full (Claude Code's max_tokens, lowered to the context's room; Codex sends none). So the CLIs
end their turns reporting that (Claude Code: an answer cut by the context window; Codex: an
incomplete response), which is the model, not the protocol: what is checked is that each CLI
read the whole answer (its stop reason, its usage), that its requests reached the router's
``/v1/messages`` and ``/v1/responses``, and that the continued turn read the first one's
prompt from the cache. Skipped when a CLI is not installed (``npm install -g
@anthropic-ai/claude-code @openai/codex``)."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from services.router.config import RouterConfig
from services.router.main import RunningRouter, start_router
from services.worker.config import EngineConfig, WorkerConfig
from services.worker.main import VLLM_ENVIRONMENT

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

CLAUDE = shutil.which("claude")
CODEX = shutil.which("codex")
# Room for the CLIs' system prompts and tools (~29K tokens of the tiny tokenizer for Claude
# Code, ~23K for Codex) and a few thousand output tokens: past the tiny model's 4096 positions
# (random weights: nothing to lose).
CONTEXT = 32768
CLI_TIMEOUT_S = 300.0


@dataclass
class Mesh:
    router: RunningRouter
    http: str  # http://host:port


@pytest.fixture(scope="module")
async def mesh(tiny_model: Path, etcd) -> AsyncIterator[Mesh]:
    with pytest.MonkeyPatch.context() as mp:
        for key, value in VLLM_ENVIRONMENT.items():
            mp.setenv(key, os.environ.get(key, value))
        mp.setenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "1")
        from services.worker.engine import VllmEngine
        from services.worker.server import start_worker

        endpoints = tuple(etcd.endpoints)
        config = WorkerConfig(
            engine=EngineConfig(
                model=str(tiny_model),
                served_model_name="tiny",
                dtype="bfloat16",  # nothing here compares outputs: the faster one
                max_model_len=CONTEXT,
                block_size=32,
                kv_cache_bytes=128 << 20,
            ),
            worker_id="w-clis",
            cluster="clis",
            etcd_endpoints=endpoints,
            drain_grace_s=2.0,
            metrics_port=-1,
        )
        engine = await VllmEngine.start(config.engine)
        worker = await start_worker(config, engine)
        router = await start_router(
            RouterConfig(
                cluster="clis",
                etcd_endpoints=endpoints,
                metrics_port=-1,
                http_port=0,
                drain_grace_s=1.0,
            )
        )
        try:
            deadline = time.monotonic() + 30
            while not router.workers.candidates("tiny"):
                assert time.monotonic() < deadline, "the router does not see the worker"
                await asyncio.sleep(0.05)
            assert router.http is not None
            yield Mesh(router, f"http://{router.http.host}:{router.http.port}")
        finally:
            await router.stop()
            await worker.stop()


async def run(argv: list[str], env: dict[str, str], cwd: Path) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        *argv,
        cwd=cwd,
        env=env,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        out, err = await asyncio.wait_for(proc.communicate(), CLI_TIMEOUT_S)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        raise
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


def sample(m: Mesh, name: str, **labels: str) -> float:
    """The sum of the router's samples ``name`` whose labels include ``labels``."""
    total = 0.0
    for metric in m.router.metrics.registry.collect():
        for s in metric.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                total += s.value
    return total


def http_requests(m: Mesh, endpoint: str) -> tuple[float, float]:
    """(answered 200, all) requests the router's HTTP front door ended on ``endpoint``."""
    name = "kvmesh_router_http_requests_total"
    return sample(m, name, endpoint=endpoint, code="200"), sample(m, name, endpoint=endpoint)


def base_env(home: Path) -> dict[str, str]:
    return {"PATH": os.environ["PATH"], "HOME": str(home), "LANG": "C.UTF-8"}


@pytest.mark.skipif(CLAUDE is None, reason="Claude Code is not installed (no `claude` on PATH)")
async def test_claude_code_turn_and_continued_turn(mesh: Mesh, tmp_path: Path):
    assert CLAUDE is not None
    env = base_env(tmp_path) | {
        "ANTHROPIC_BASE_URL": mesh.http,
        "ANTHROPIC_API_KEY": "none",
        "ANTHROPIC_MODEL": "tiny",
        "ANTHROPIC_DEFAULT_HAIKU_MODEL": "tiny",
        "ANTHROPIC_DEFAULT_SONNET_MODEL": "tiny",
        "ANTHROPIC_DEFAULT_OPUS_MODEL": "tiny",
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "DISABLE_TELEMETRY": "1",
        "DISABLE_AUTOUPDATER": "1",
    }
    turns = []
    for extra in ([], ["--continue"]):
        argv = [CLAUDE, "-p", "Say hello.", *extra, "--output-format", "json"]
        _, out, err = await run(argv, env, tmp_path)
        assert out.strip(), err
        turns.append(json.loads(out))
    for turn in turns:
        # The whole answer was read: its usage, and why it ended (the random model runs to the
        # context's end: "The model has reached its context window limit"); a protocol error
        # would be an api_error_status or no usage at all.
        assert turn["api_error_status"] is None, turn
        assert turn["usage"]["output_tokens"] > 0, turn
        prompt = (
            turn["usage"]["input_tokens"]
            + turn["usage"]["cache_creation_input_tokens"]
            + turn["usage"]["cache_read_input_tokens"]
        )
        assert prompt > 10_000, turn  # Claude Code's system prompt and tools
    # The continued turn resent the conversation: its prompt came from the cache.
    assert turns[1]["usage"]["cache_read_input_tokens"] > 10_000, turns[1]
    ok, sent = http_requests(mesh, "/v1/messages")
    assert ok == sent >= 2


@pytest.mark.skipif(CODEX is None, reason="Codex is not installed (no `codex` on PATH)")
async def test_codex_turn_and_resumed_turn(mesh: Mesh, tmp_path: Path):
    assert CODEX is not None
    home = tmp_path / "codex"
    home.mkdir()
    (home / "config.toml").write_text(
        'model = "tiny"\nmodel_provider = "kvmesh"\n\n[model_providers.kvmesh]\n'
        f'name = "kvmesh"\nbase_url = "{mesh.http}/v1"\nwire_api = "responses"\n'
    )
    env = base_env(tmp_path) | {"CODEX_HOME": str(home)}
    cached = []
    for argv in (
        [CODEX, "exec", "--skip-git-repo-check", "--json", "Say hello."],
        [CODEX, "exec", "--skip-git-repo-check", "--json", "resume", "--last", "And again."],
    ):
        before = sample(mesh, "kvmesh_router_cached_prompt_tokens_total")
        _, out, err = await run(argv, env, tmp_path)
        events = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
        kinds = [e["type"] for e in events]
        assert "turn.started" in kinds, (out, err)
        # The whole answer was read: it ran to the context's end (the random model never ends
        # its turn), which Codex reports as an incomplete response; a protocol error would be
        # a status code or a broken stream.
        ended = events[-1]
        assert ended["type"] in ("turn.completed", "turn.failed"), events
        if ended["type"] == "turn.failed":
            assert "Incomplete response returned" in ended["error"]["message"], ended
        cached.append(sample(mesh, "kvmesh_router_cached_prompt_tokens_total") - before)
    ok, sent = http_requests(mesh, "/v1/responses")
    assert ok == sent >= 2
    # The resumed turn resent the whole conversation (store: false): read from the cache.
    assert cached[1] > 20_000, cached
