"""Block hashing without vLLM: pinned vectors, chain shape, configuration, SessionHasher."""

from __future__ import annotations

import hashlib
import pickle
import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvmesh.kv.events import BlockHash
from kvmesh.kv.hashing import (
    DEFAULT_SEED,
    PICKLE_PROTOCOL,
    HashAlgo,
    HashConfig,
    RequestKeys,
    SessionHasher,
    block_digests,
    block_hashes,
    fingerprint,
    root_digest,
    to_block_hash,
)

PINNED_TOKENS = [(i * 37) % 1000 + 5 for i in range(70)]
"""Two full blocks and 6 tokens: a prompt the golden test also sends to a real engine."""

PINNED_VECTORS: dict[tuple[str, str | None], list[int]] = {
    # What vLLM 0.32 published for PINNED_TOKENS (tests/integration/test_kv_hashing_golden.py
    # checks these against a running engine). A change here is a change of vLLM's algorithm.
    ("sha256", None): [952935967719738998, 220725399452605716],
    ("sha256", "1234"): [15174124923212859039, 10614462531798144098],
    ("sha256_cbor", "1234"): [15550669570979609476, 16428233361765508404],
}

PINNED_ROOTS = {
    # vLLM's NONE_HASH (hex) for each configuration.
    ("sha256", None): "066b1e8987e027138e98701c46128929378935f9b6cd1549105ae6b4f0d71198",
    ("sha256", "1234"): "8a7c43e934778270f0241e4efb933334518a7ad06e0070742b3f802652a2e249",
    ("sha256_cbor", None): "9bd96a485ad84efdafb72ee48a1d7a69bcead0f8f0433173941b276b9581eef0",
    ("sha256_cbor", "1234"): "dfa66c9da4dad0601316e0b63a2909b4068e72830385ddbd16e0c980c76c9e12",
}

PINNED_SALTED = {
    # PINNED_TOKENS with cache_salt="tenant-a" (also sent to the engine by the golden test).
    ("sha256", None): [16888884949800383403, 11271360030058921433],
    ("sha256", "1234"): [6630002344310456765, 13203753425927695835],
}

CFG = HashConfig()
SMALL = HashConfig(block_size=4)


def _tokens(n: int, start: int = 5) -> list[int]:
    return [(start + i * 7919) % 1000 for i in range(n)]


# --- pinned vectors ------------------------------------------------------------------------


@pytest.mark.parametrize(("algo", "seed"), list(PINNED_VECTORS), ids=str)
def test_pinned_vectors(algo: str, seed: str | None) -> None:
    assert (
        block_hashes(PINNED_TOKENS, HashConfig(algo=HashAlgo(algo), seed=seed))
        == (PINNED_VECTORS[(algo, seed)])
    )


@pytest.mark.parametrize(("algo", "seed"), list(PINNED_ROOTS), ids=str)
def test_pinned_roots(algo: str, seed: str | None) -> None:
    assert (
        root_digest(HashConfig(algo=HashAlgo(algo), seed=seed)).hex()
        == (PINNED_ROOTS[(algo, seed)])
    )


@pytest.mark.parametrize(("algo", "seed"), list(PINNED_SALTED), ids=str)
def test_pinned_salted(algo: str, seed: str | None) -> None:
    cfg = HashConfig(algo=HashAlgo(algo), seed=seed)
    keys = RequestKeys(cache_salt="tenant-a")
    assert block_hashes(PINNED_TOKENS, cfg, keys=keys) == PINNED_SALTED[(algo, seed)]


def test_the_algorithm_spelled_out() -> None:
    """The default algorithm, written out with hashlib and pickle alone."""
    root = hashlib.sha256(pickle.dumps(DEFAULT_SEED, protocol=5)).digest()
    first = hashlib.sha256(pickle.dumps((root, tuple(PINNED_TOKENS[:32]), None), 5)).digest()
    second = hashlib.sha256(pickle.dumps((first, tuple(PINNED_TOKENS[32:64]), None), 5)).digest()
    assert block_digests(PINNED_TOKENS, CFG) == [first, second]
    assert block_hashes(PINNED_TOKENS, CFG) == [
        int.from_bytes(d[-8:], "big") for d in (first, second)
    ]


def test_pickle_protocol_is_what_vllm_uses() -> None:
    # vLLM pickles with pickle.HIGHEST_PROTOCOL; if this Python moved it, workers running on it
    # hash differently from PICKLE_PROTOCOL.
    assert pickle.HIGHEST_PROTOCOL == PICKLE_PROTOCOL


def test_published_value_is_the_low_64_bits() -> None:
    digest = bytes(range(32))
    assert to_block_hash(digest) == int.from_bytes(digest[24:], "big")  # type: ignore[arg-type]
    assert to_block_hash(b"\xff" * 32) == 2**64 - 1  # type: ignore[arg-type]


# --- chain shape ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("length", "blocks"),
    [(0, 0), (1, 0), (31, 0), (32, 1), (33, 1), (63, 1), (64, 2), (100, 3)],
    ids=lambda v: str(v),
)
def test_only_full_blocks_are_hashed(length: int, blocks: int) -> None:
    assert len(block_hashes(_tokens(length), CFG)) == blocks


def test_partial_tail_does_not_change_full_blocks() -> None:
    base = _tokens(64)
    assert block_hashes([*base, 1, 2, 3], CFG) == block_hashes(base, CFG)


def test_chain_position_matters() -> None:
    block = _tokens(32)
    first, second = block_hashes(block + block, CFG)
    assert first != second  # same tokens, other parent


def test_parent_continues_a_chain() -> None:
    tokens = _tokens(32 * 5)
    digests = block_digests(tokens, CFG)
    tail = block_hashes(tokens[64:], CFG, parent=digests[1])
    assert tail == block_hashes(tokens, CFG)[2:]


def test_inputs_other_than_lists_hash_the_same() -> None:
    tokens = _tokens(96)
    expected = block_hashes(tokens, CFG)
    assert block_hashes(tuple(tokens), CFG) == expected
    assert block_hashes(range(5, 5 + 96), CFG) == block_hashes(list(range(5, 5 + 96)), CFG)


def test_algorithms_and_seeds_give_other_hashes() -> None:
    tokens = _tokens(64)
    results = {
        tuple(block_hashes(tokens, HashConfig(algo=algo, seed=seed)))
        for algo in (HashAlgo.SHA256, HashAlgo.SHA256_CBOR)
        for seed in (None, "0", "1", "random")
    }
    assert len(results) == 8


def test_default_seed_equals_vllm_default_string() -> None:
    # vLLM falls back to DEFAULT_NONE_HASH_SEED; hashing it equals an unset seed.
    assert root_digest(HashConfig()) == hashlib.sha256(pickle.dumps(DEFAULT_SEED, 5)).digest()


@pytest.mark.parametrize(
    "keys",
    [
        RequestKeys(cache_salt="a"),  # in block 0 only, but every later block chains from it
        RequestKeys(lora_name="x", lora_path="/x"),
        RequestKeys(lora_name="x", lora_path="/y"),
    ],
    ids=["salt", "lora", "lora-other-path"],
)
def test_extra_keys_change_every_block(keys: RequestKeys) -> None:
    tokens = _tokens(96)
    plain = block_hashes(tokens, CFG)
    keyed = block_hashes(tokens, CFG, keys=keys)
    assert all(p != k for p, k in zip(plain, keyed, strict=True))
    other = block_hashes(tokens, CFG, keys=RequestKeys(lora_name="x", lora_path="/x"))
    assert keys == RequestKeys(lora_name="x", lora_path="/x") or other != keyed


def test_extra_keys_layout() -> None:
    keys = RequestKeys(cache_salt="s", lora_name="n", lora_path="/p")
    assert keys.extra_keys(first_block=True) == (("lora", "n", "/p"), ("cache_salt", "s"))
    assert keys.extra_keys(first_block=False) == (("lora", "n", "/p"),)
    assert RequestKeys(cache_salt="").extra_keys(first_block=True) is None  # vLLM: falsy salt
    assert RequestKeys().extra_keys(first_block=True) is None


def test_salt_only_in_the_first_block() -> None:
    tokens = _tokens(96)
    salted = block_digests(tokens, CFG, keys=RequestKeys(cache_salt="s"))
    # Continuing from block 0's digest without the salt gives blocks 1.. of the salted chain.
    assert block_digests(tokens[32:], CFG, parent=salted[0]) == salted[1:]


# --- configuration -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs",
    [
        {"block_size": 0},
        {"seed": "-1"},
        {"seed": "4294967296"},
        {"seed": "abc"},
        {"seed": " 1"},
        {"algo": "md5"},
        {"algo": "xxhash"},  # no seed: vLLM's root would be random per process
        {"algo": "xxhash_cbor"},
    ],
    ids=str,
)
def test_bad_configs(kwargs: dict[str, object]) -> None:
    # Each message names the field it refuses (the value, or the algorithm).
    with pytest.raises(ValueError, match=r"block_size|seed|HashAlgo|without a seed"):
        HashConfig(**kwargs)  # type: ignore[arg-type]


def test_fingerprint() -> None:
    assert fingerprint(HashConfig()) == fingerprint(HashConfig(seed=None))
    assert fingerprint(HashConfig()).startswith("sha256-32-")
    others = {
        HashConfig(seed="1"),
        HashConfig(block_size=64),
        HashConfig(algo=HashAlgo.SHA256_CBOR),
    }
    assert len({fingerprint(c) for c in others | {HashConfig()}}) == 4
    assert "1234" not in fingerprint(HashConfig(seed="1234"))


def test_config_accepts_strings() -> None:
    cfg = HashConfig(algo="sha256_cbor", seed="4294967295")  # type: ignore[arg-type]
    assert cfg.algo is HashAlgo.SHA256_CBOR
    assert HashConfig(seed="random").root_seed == "random"
    assert HashConfig().root_seed == DEFAULT_SEED


def test_xxhash_when_installed() -> None:
    xxhash = pytest.importorskip("xxhash")
    cfg = HashConfig(algo=HashAlgo.XXHASH, seed="7")
    root = xxhash.xxh3_128_digest(pickle.dumps("7", 5))
    first = xxhash.xxh3_128_digest(pickle.dumps((root, tuple(PINNED_TOKENS[:32]), None), 5))
    assert block_digests(PINNED_TOKENS, cfg)[0] == first


# --- SessionHasher -------------------------------------------------------------------------


def test_session_extension_reuses_the_chain() -> None:
    hasher = SessionHasher(CFG)
    first = _tokens(32 * 10 + 5)
    second = first + _tokens(100, start=11)
    r1 = hasher.hash("s", first)
    r2 = hasher.hash("s", second)
    assert (r1.reused_blocks, r1.hashed_blocks) == (0, 10)
    assert r2.reused_blocks == 10
    assert r2.hashed_blocks == len(second) // 32 - 10
    assert list(r2.hashes) == block_hashes(second, CFG)


def test_identical_prompt_hashes_nothing() -> None:
    hasher = SessionHasher(CFG)
    tokens = _tokens(200)
    hasher.hash("s", tokens)
    again = hasher.hash("s", list(tokens))
    assert (again.reused_blocks, again.hashed_blocks) == (6, 0)
    assert list(again.hashes) == block_hashes(tokens, CFG)


@pytest.mark.parametrize(
    ("edit_at", "reused"),
    [(0, 0), (31, 0), (32, 1), (200, 6), (32 * 40 - 1, 39), (32 * 200, 200)],
    ids=lambda v: str(v),
)
def test_edit_reuses_up_to_the_edited_block(edit_at: int, reused: int) -> None:
    hasher = SessionHasher(CFG)
    tokens = _tokens(32 * 300 + 7)
    hasher.hash("s", tokens)
    edited = list(tokens)
    edited[edit_at] += 1
    result = hasher.hash("s", edited)
    assert result.reused_blocks == reused
    assert list(result.hashes) == block_hashes(edited, CFG)


def test_shorter_prompt_reuses_its_blocks() -> None:
    hasher = SessionHasher(CFG)
    tokens = _tokens(32 * 20)
    hasher.hash("s", tokens)
    result = hasher.hash("s", tokens[: 32 * 7 + 3])
    assert (result.reused_blocks, len(result.hashes)) == (7, 7)
    assert list(result.hashes) == block_hashes(tokens, CFG)[:7]


def test_sessions_do_not_share() -> None:
    hasher = SessionHasher(CFG)
    tokens = _tokens(128)
    hasher.hash("a", tokens)
    assert hasher.hash("b", tokens).reused_blocks == 0
    assert hasher.hash(None, tokens).reused_blocks == 0  # no session: nothing kept
    assert len(hasher) == 2


def test_other_request_keys_are_not_reused() -> None:
    hasher = SessionHasher(CFG)
    tokens = _tokens(128)
    hasher.hash("s", tokens)
    salted = hasher.hash("s", tokens, RequestKeys(cache_salt="x"))
    assert salted.reused_blocks == 0
    assert list(salted.hashes) == block_hashes(tokens, CFG, keys=RequestKeys(cache_salt="x"))
    again = hasher.hash("s", tokens + [1] * 32, RequestKeys(cache_salt="x"))
    assert again.reused_blocks == 4
    assert list(again.hashes) == block_hashes(
        tokens + [1] * 32, CFG, keys=RequestKeys(cache_salt="x")
    )


def test_lru_bound_on_sessions() -> None:
    hasher = SessionHasher(SMALL, max_sessions=2)
    tokens = _tokens(8)
    hasher.hash("a", tokens)
    hasher.hash("b", tokens)
    hasher.hash("a", tokens)  # a is now the most recent
    hasher.hash("c", tokens)  # evicts b
    assert len(hasher) == 2
    assert hasher.hash("a", tokens).reused_blocks == 2
    assert hasher.hash("b", tokens).reused_blocks == 0


def test_token_budget() -> None:
    hasher = SessionHasher(SMALL, max_tokens=20)
    hasher.hash("a", _tokens(8))
    hasher.hash("b", _tokens(8))
    assert hasher.cached_tokens == 16
    hasher.hash("c", _tokens(9))  # 8 full-block tokens kept: a goes
    assert (len(hasher), hasher.cached_tokens) == (2, 16)
    hasher.hash("d", _tokens(40))  # over the budget alone: not kept, nothing else dropped
    assert (len(hasher), hasher.cached_tokens) == (2, 16)
    assert hasher.forget("b") and not hasher.forget("b")
    assert hasher.cached_tokens == 8


def test_ids_beyond_32_bits_hash_without_reuse() -> None:
    hasher = SessionHasher(SMALL)
    tokens = [2**33, 1, 2, 3, 4]
    first = hasher.hash("s", tokens)
    assert list(first.hashes) == block_hashes(tokens, SMALL)
    assert hasher.hash("s", tokens).reused_blocks == 0


def test_bad_bounds() -> None:
    with pytest.raises(ValueError, match="must be positive"):
        SessionHasher(CFG, max_sessions=0)


def test_concurrent_sessions() -> None:
    hasher = SessionHasher(CFG)
    prompts = {f"s{i}": _tokens(32 * 30, start=i) for i in range(8)}
    expected = {s: block_hashes(t, CFG) for s, t in prompts.items()}
    errors: list[BaseException] = []

    def work(session: str) -> None:
        try:
            for n in (10, 20, 30):
                got = hasher.hash(session, prompts[session][: 32 * n])
                assert list(got.hashes) == expected[session][:n]
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(s,)) for s in prompts]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors


# --- properties ----------------------------------------------------------------------------

token_lists = st.lists(st.integers(min_value=0, max_value=2**32 - 1), max_size=40)


@settings(max_examples=60, deadline=None)
@given(a=token_lists, b=token_lists)
def test_prefix_property(a: list[int], b: list[int]) -> None:
    a = a[: len(a) - len(a) % SMALL.block_size]
    whole = block_hashes(a + b, SMALL)
    assert whole[: len(a) // SMALL.block_size] == block_hashes(a, SMALL)
    assert len(whole) == (len(a) + len(b)) // SMALL.block_size


@settings(max_examples=60, deadline=None)
@given(turns=st.lists(token_lists, min_size=1, max_size=4), base=token_lists)
def test_session_hasher_equals_plain_hashing(turns: list[list[int]], base: list[int]) -> None:
    hasher = SessionHasher(SMALL)
    for turn in turns:
        for prompt in (base + turn, turn):
            got = hasher.hash("s", prompt)
            assert list(got.hashes) == block_hashes(prompt, SMALL)
            assert 0 <= got.reused_blocks <= len(got.hashes)


@settings(max_examples=40, deadline=None)
@given(tokens=token_lists)
def test_published_hashes_fit_64_bits(tokens: list[int]) -> None:
    for h in block_hashes(tokens, SMALL):
        assert isinstance(h, int) and 0 <= h < 2**64
        assert BlockHash(h) == h
