"""Runs real vLLM engines and records the KV events they publish: the evidence for
``test_kv_hashing_golden.py``. A separate process, because vLLM reads its environment at import
and ``PYTHONHASHSEED`` when each engine starts:

    python tests/integration/kv_hashing_engine.py < spec.json

``spec``: ``{"model": DIR, "runs": [{"algo": ..., "seed": str | null}], "prompts": [{"tokens":
[...], "cache_salt": str | null}]}``. For each run, one engine (in this process, one after the
other) with prefix caching, block size 32 and a ZMQ event publisher; the prompts go in one at a
time (1 output token each). Prints one line ``GOLDEN {json}``: per run, the prompts actually sent
(warm-up prompts first) and every event batch received, decoded from msgpack.

Also prints vLLM's own ``hash_block_tokens`` on a few hand-made blocks (token ids beyond the
tiny model's vocabulary, LoRA and salt extra keys) as ``direct`` vectors.
"""

from __future__ import annotations

import gc
import json
import os
import random
import sys
import time
from typing import Any

BLOCK_SIZE = 32
IDLE_S = 0.5  # a quiet SUB socket for this long after the last prompt: all events are in
WARMUP_TRIES = 10


def _environment() -> None:
    for key, value in {
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_LOGGING_STREAM": "ext://sys.stderr",
    }.items():
        os.environ.setdefault(key, value)


def _set_seed(seed: str | None) -> None:
    """vLLM reads PYTHONHASHSEED when an engine starts (``init_none_hash``)."""
    if seed is None:
        os.environ.pop("PYTHONHASHSEED", None)
    else:
        os.environ["PYTHONHASHSEED"] = seed


def _receive(sub: Any, timeout_s: float) -> list[Any]:
    """Event batches until the socket has been quiet for ``timeout_s``."""
    import msgspec
    import zmq

    batches = []
    while sub.poll(int(timeout_s * 1000), zmq.POLLIN):
        _topic, seq, payload = sub.recv_multipart()
        _ts, events, *rest = msgspec.msgpack.decode(payload)
        batches.append({"seq": int.from_bytes(seq, "big"), "events": events, "rest": rest})
    return batches


def _run(model: str, algo: str, seed: str | None, prompts: list[dict[str, Any]]) -> dict[str, Any]:
    import zmq
    from vllm import LLM
    from vllm.config import KVEventsConfig

    _set_seed(seed)
    sub: Any = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    # tcp://127.0.0.1:P makes vLLM's publisher connect, so the subscriber binds.
    port = sub.bind_to_random_port("tcp://127.0.0.1")
    llm = LLM(
        model=model,
        dtype="float32",
        block_size=BLOCK_SIZE,
        max_model_len=1024,
        enforce_eager=True,
        enable_prefix_caching=True,
        prefix_caching_hash_algo=algo,
        kv_cache_memory_bytes=64 << 20,
        kv_events_config=KVEventsConfig(
            enable_kv_cache_events=True,
            publisher="zmq",
            endpoint=f"tcp://127.0.0.1:{port}",
        ),
    )
    rng = random.Random(f"warmup-{algo}-{seed}")
    sent: list[dict[str, Any]] = []
    batches: list[Any] = []
    # A PUB socket drops what it sends before the subscription reached it (ZMQ's "slow
    # joiner"): send unique warm-up prompts until one's events arrive.
    for _ in range(WARMUP_TRIES):
        warmup = {"tokens": [rng.randrange(5, 1000) for _ in range(2 * BLOCK_SIZE)]}
        sent.append(_send(llm, warmup, warmup=True))
        got = _receive(sub, 1.0)
        batches += got
        if got:
            break
    sent += [_send(llm, prompt, warmup=False) for prompt in prompts]
    batches += _receive(sub, IDLE_S)

    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()
    sub.close(linger=0)
    return {"algo": algo, "seed": seed, "prompts": sent, "batches": batches}


def _send(llm: Any, prompt: dict[str, Any], warmup: bool) -> dict[str, Any]:
    """Runs ``prompt`` to completion (one greedy token); returns it as sent."""
    from vllm import SamplingParams, TokensPrompt

    tp = TokensPrompt(prompt_token_ids=prompt["tokens"])
    if prompt.get("cache_salt"):
        tp["cache_salt"] = prompt["cache_salt"]
    llm.generate([tp], SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
    return {**prompt, "warmup": warmup}


def _direct() -> list[dict[str, Any]]:
    """vLLM's hash function on blocks the engine cannot take (ids beyond the vocabulary)."""
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core import kv_cache_utils as kcu

    rng = random.Random(7)
    tokens = [0, 23, 24, 255, 256, 65535, 65536, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**40]
    tokens += [rng.randrange(0, 200_000) for _ in range(2 * BLOCK_SIZE - len(tokens))]
    extra = (("lora", "adapter-a", "/loras/a"), ("cache_salt", "tenant-1"))
    out = []
    for algo in ("sha256", "sha256_cbor"):
        for seed in (None, "4242"):
            _set_seed(seed)
            fn = get_hash_fn_by_name(algo)
            kcu.init_none_hash(fn)
            first = kcu.hash_block_tokens(fn, None, tokens[:BLOCK_SIZE], extra)
            second = kcu.hash_block_tokens(fn, first, tokens[BLOCK_SIZE:], extra[:1])
            out.append(
                {
                    "algo": algo,
                    "seed": seed,
                    "tokens": tokens,
                    "root": kcu.NONE_HASH.hex(),
                    "digests": [first.hex(), second.hex()],
                    "published": [kcu.maybe_convert_block_hash(d) for d in (first, second)],
                }
            )
    return out


def main() -> None:
    _environment()
    spec = json.load(sys.stdin)
    started = time.monotonic()
    runs = [_run(spec["model"], r["algo"], r["seed"], spec["prompts"]) for r in spec["runs"]]
    result = {"runs": runs, "direct": _direct(), "seconds": time.monotonic() - started}
    print("GOLDEN " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
