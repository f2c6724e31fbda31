"""The worker's priming of vLLM's decode streams (services/worker/detokenizer.py), on the tiny
model's real tokenizer, whose byte tokens split characters, and through vLLM's own
detokenizer class: whatever the point a prompt ends at (a resumed request's prompt ends where
the first worker stopped), the text streamed after it is the uninterrupted stream's. vLLM's
own priming (``DecodeStream(ids=prompt)``) sends the whole prompt's text instead when the
prompt ends inside a character (vllm-project/vllm#48853); the comparison shows the case is
met here."""

from __future__ import annotations

import random
from collections.abc import Sequence
from pathlib import Path

import pytest
import tokenizers
from tokenizers.decoders import DecodeStream

from services.worker.detokenizer import REPLACEMENT, install, primed_stream

SEAMS = 300


@pytest.fixture(scope="module")
def tok(tiny_model: Path) -> tokenizers.Tokenizer:
    return tokenizers.Tokenizer.from_file(str(tiny_model / "tokenizer.json"))


def texts(stream: DecodeStream, tok: tokenizers.Tokenizer, ids: Sequence[int]) -> list[str]:
    return [stream.step(tok, t) or "" for t in ids]


def clean_prompt(tok: tokenizers.Tokenizer, rng: random.Random) -> list[int]:
    """A prompt whose text ends with a whole character (vLLM's priming is right for it)."""
    while True:
        prompt = [rng.randrange(5, 1000) for _ in range(50)]
        if not tok.decode(prompt, skip_special_tokens=True).endswith(REPLACEMENT):
            return prompt


def seams(tok: tokenizers.Tokenizer) -> list[tuple[list[int], list[int], list[str]]]:
    """(prompt, output, the uninterrupted stream's text per output token), SEAMS of them."""
    out = []
    for seed in range(SEAMS):
        rng = random.Random(seed)
        prompt = clean_prompt(tok, rng)
        output = [rng.randrange(5, 1000) for _ in range(60)]
        stream = DecodeStream(ids=prompt, skip_special_tokens=True)
        out.append((prompt, output, texts(stream, tok, output)))
    return out


def test_the_text_after_any_seam_is_the_uninterrupted_streams(tok: tokenizers.Tokenizer):
    vllm_wrong = primed = 0
    for seed, (prompt, output, uninterrupted) in enumerate(seams(tok)):
        cut = random.Random(seed).randrange(1, 40)  # the first worker sent output[:cut]
        resumed_prompt, later = prompt + output[:cut], output[cut:]
        # The uninterrupted stream's text from the seam on: what it held back at the cut first.
        want = "".join(uninterrupted[cut:])
        stream = primed_stream(tok, resumed_prompt, skip_special_tokens=True)
        if stream is None:  # the prompt ends with a whole character: vLLM's own priming
            stream = DecodeStream(ids=resumed_prompt, skip_special_tokens=True)
        else:
            primed += 1
        assert "".join(texts(stream, tok, later)) == want, seed
        vllm_own = DecodeStream(ids=resumed_prompt, skip_special_tokens=True)
        vllm_wrong += "".join(texts(vllm_own, tok, later)) != want
    assert primed > 0 and vllm_wrong > 0  # the case is met on this tokenizer
    assert vllm_wrong <= primed  # ... only where the worker primes the stream itself


def test_a_prompt_ending_with_a_whole_character_keeps_vllms_stream(tok: tokenizers.Tokenizer):
    prompt = clean_prompt(tok, random.Random(1))
    assert primed_stream(tok, prompt, skip_special_tokens=True) is None
    assert primed_stream(tok, [], skip_special_tokens=True) is None


def test_vllms_detokenizer_streams_only_the_new_text(tiny_model: Path):
    """Through vLLM's own classes, as its output processor builds them per request."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind
    from vllm.tokenizers import get_tokenizer
    from vllm.v1.engine import EngineCoreRequest
    from vllm.v1.engine.detokenizer import IncrementalDetokenizer

    assert install() and install()  # once, and again a no-op
    tokenizer = get_tokenizer(str(tiny_model))
    raw = tokenizer._tokenizer
    for seed, (prompt, output, uninterrupted) in enumerate(seams(raw)[:60]):
        cut = random.Random(seed).randrange(1, 40)
        request = EngineCoreRequest(
            request_id=f"r{seed}",
            prompt_token_ids=prompt + output[:cut],
            mm_features=None,
            sampling_params=SamplingParams(
                max_tokens=100, output_kind=RequestOutputKind.DELTA, detokenize=True
            ),
            pooling_params=None,
            arrival_time=0.0,
            lora_request=None,
            cache_salt=None,
            data_parallel_rank=None,
        )
        detok = IncrementalDetokenizer.from_new_request(tokenizer, request)
        got = ""
        for t in output[cut:]:
            detok.update([t], stop_terminated=False)
            got += detok.get_next_output_text(finished=False, delta=True)
        assert got == "".join(uninterrupted[cut:]), seed
