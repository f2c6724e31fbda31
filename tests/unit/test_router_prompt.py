"""The router's prompt step (services/router/prompt.py): short prompts on the loop, long ones in
one executor job, the same ids, hashes, checks and spans either way. Real tokenizer (the tiny
model's), real hashing."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from kvmesh.errors import InvalidArgument
from kvmesh.kv.hashing import HashConfig, RequestKeys, SessionHasher, block_hashes
from kvmesh.telemetry import setup_tracing
from services.router.hashing import PromptHasher
from services.router.prompt import PromptBuilder, PromptInput
from services.router.tokenizer import TemplateInput, Tokenizers

BLOCK = 16
TEXT = "the quick brown fox jumps over the lazy dog " * 40  # ~400 tokens, 1760 chars


@pytest.fixture(scope="module")
def spans() -> InMemorySpanExporter:
    exporter = InMemorySpanExporter()
    provider = trace.get_tracer_provider()
    if isinstance(provider, TracerProvider):  # another module set one up already
        provider.add_span_processor(SimpleSpanProcessor(exporter))
    else:
        setup_tracing("kvmesh-prompt-test", extra_processor=SimpleSpanProcessor(exporter))
    return exporter


@pytest.fixture(scope="module")
def pool() -> Iterator[ThreadPoolExecutor]:
    with ThreadPoolExecutor(1, thread_name_prefix="tokenize") as pool:
        yield pool


def builder(pool: ThreadPoolExecutor, inline_tokens: int) -> tuple[PromptBuilder, Tokenizers]:
    tokenizers = Tokenizers(pool)
    return PromptBuilder(tokenizers, PromptHasher(), pool, inline_tokens), tokenizers


def expected_hashes(ids: list[int]) -> tuple[bytes, ...]:
    return tuple(SessionHasher(HashConfig(block_size=BLOCK)).hash(None, ids).hashes)


def no_check(_ids: list[int]) -> None:
    pass


async def test_short_prompt_on_the_loop_long_one_in_the_executor(
    pool: ThreadPoolExecutor, tiny_model: Path
):
    path = str(tiny_model)
    short, tokenizers = builder(pool, inline_tokens=len(TEXT) // 3)
    tokenizers._load("m", path)
    long, long_tok = builder(pool, inline_tokens=len(TEXT) // 3 - 1)
    long_tok._load("m", path)
    want = tokenizers.encode_text_now("m", path, TEXT)
    threads: list[str] = []

    def check(ids: list[int]) -> None:
        threads.append(threading.current_thread().name)

    a = await short.build("m", path, BLOCK, "", PromptInput(text=TEXT), check)
    b = await long.build("m", path, BLOCK, "", PromptInput(text=TEXT), check)
    assert (a.inline, b.inline) == (True, False)
    assert a.token_ids == b.token_ids == want
    assert a.hashed.hashes == b.hashed.hashes == expected_hashes(want)
    assert threads[0] == threading.current_thread().name and threads[1].startswith("tokenize")


async def test_token_ids_are_hashed_without_a_tokenizer(pool: ThreadPoolExecutor):
    ids = list(range(100, 100 + 5 * BLOCK + 3))
    b, _ = builder(pool, inline_tokens=len(ids))
    p = await b.build("m", "/nonexistent", BLOCK, "", PromptInput(token_ids=ids), no_check)
    assert p.inline and p.token_ids == ids and p.hashed.hashes == expected_hashes(ids)
    b, _ = builder(pool, inline_tokens=len(ids) - 1)
    p = await b.build("m", "/nonexistent", BLOCK, "", PromptInput(token_ids=ids), no_check)
    assert not p.inline and p.hashed.hashes == expected_hashes(ids)


@pytest.mark.parametrize("inline_tokens", [10_000, 0], ids=["loop", "executor"])
async def test_a_salted_prompt_hashes_as_its_engine_will(
    pool: ThreadPoolExecutor, inline_tokens: int
):
    """The tenant's salt goes into the hash of the first block, so every block differs from the
    unsalted chain and from another salt's: the hashes vLLM publishes for that request."""
    ids = list(range(100, 100 + 4 * BLOCK))
    b, _ = builder(pool, inline_tokens)
    cfg = HashConfig(block_size=BLOCK)
    got = {}
    for salt in ("", "salt-a", "salt-b"):
        p = await b.build("m", "", BLOCK, "sess", PromptInput(token_ids=ids), no_check, salt)
        want = block_hashes(ids, cfg, keys=RequestKeys(cache_salt=salt or None))
        assert list(p.hashed.hashes) == want
        assert p.hashed.reused_blocks == 0  # the session's chain of another salt is not reused
        got[salt] = set(p.hashed.hashes)
    assert not got[""] & got["salt-a"] and not got["salt-a"] & got["salt-b"]


async def test_a_tokenizer_not_loaded_yet_never_loads_on_the_loop(
    pool: ThreadPoolExecutor, tiny_model: Path
):
    b, tokenizers = builder(pool, inline_tokens=10_000)
    p = await b.build("m", str(tiny_model), BLOCK, "", PromptInput(text="hello"), no_check)
    assert not p.inline and tokenizers.is_loaded("m", str(tiny_model))
    p = await b.build("m", str(tiny_model), BLOCK, "", PromptInput(text="hello"), no_check)
    assert p.inline


async def test_chat_prompts_estimate_from_their_content(pool: ThreadPoolExecutor, tiny_model: Path):
    chat = TemplateInput(({"role": "user", "content": TEXT},))
    assert PromptInput(chat=chat).estimated_tokens() == len(TEXT) // 3
    b, tokenizers = builder(pool, inline_tokens=len(TEXT) // 3)
    tokenizers._load("m", str(tiny_model))
    p = await b.build("m", str(tiny_model), BLOCK, "", PromptInput(chat=chat), no_check)
    assert p.inline and p.token_ids == tokenizers.encode_chat_now("m", str(tiny_model), chat)


@pytest.mark.parametrize("inline_tokens", [10_000, 0])
async def test_a_refused_prompt_is_not_hashed_and_keeps_its_error(
    pool: ThreadPoolExecutor, inline_tokens: int
):
    b, _ = builder(pool, inline_tokens)

    def refuse(ids: list[int]) -> None:
        raise InvalidArgument(f"{len(ids)} tokens is too long", "input")

    with pytest.raises(InvalidArgument, match="5 tokens is too long") as err:
        await b.build("m", "", BLOCK, "s", PromptInput(token_ids=[1, 2, 3, 4, 5]), refuse)
    assert err.value.field == "input"


@pytest.mark.parametrize("inline_tokens", [10_000, 0])
async def test_both_paths_record_tokenize_then_hash_under_the_request_span(
    pool: ThreadPoolExecutor, spans: InMemorySpanExporter, inline_tokens: int
):
    ids = list(range(10, 10 + 4 * BLOCK))
    b, _ = builder(pool, inline_tokens)
    spans.clear()
    with trace.get_tracer(__name__).start_as_current_span("request") as root:
        await b.build("m", "", BLOCK, "", PromptInput(token_ids=ids), no_check)
    got = {s.name: s for s in spans.get_finished_spans()}
    tok, hashed = got["tokenize"], got["hash"]
    for s in (tok, hashed):
        assert s.parent is not None and s.parent.span_id == root.get_span_context().span_id
    assert tok.attributes["prompt_tokens"] == len(ids)
    assert hashed.attributes["blocks"] == 4
    assert tok.end_time <= hashed.start_time <= hashed.end_time
