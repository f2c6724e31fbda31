"""vLLM's prefix-cache block hashes, computed in the router without vLLM.

vLLM (v1, 0.32) gives every *full* block of ``block_size`` tokens a hash that chains over the
whole prefix (``vllm/v1/core/kv_cache_utils.py``: ``hash_block_tokens``,
``get_request_block_hasher``)::

    root     = H(seed)                                    # NONE_HASH, a str hashed like a block
    digest_i = H((digest_{i-1} or root, tuple(block_i token ids), extra_keys_i or None))

``H`` is ``prefix_caching_hash_algo`` (``vllm/utils/hashing.py``): ``sha256`` (the default) is
SHA-256 over ``pickle.dumps(obj, protocol=HIGHEST_PROTOCOL)``, ``sha256_cbor`` SHA-256 over
``cbor2.dumps(obj, canonical=True)``, ``xxhash``/``xxhash_cbor`` the same serializations under
XXH3-128. ``seed`` is the engine process's ``PYTHONHASHSEED`` string when set, else the fixed
``"vllm-none-hash"`` for the sha256 algorithms (the xxhash ones draw a random seed per process:
unreproducible). KV events publish each digest as ``int.from_bytes(digest, "big") & (2**64 - 1)``
(its last 8 bytes), while the chain itself runs on the full digests.

We serialize with the same libraries and arguments vLLM uses, so the bytes are the same by
construction; ``tests/integration/test_kv_hashing_golden.py`` proves it against a running engine.
See docs/hashing.md.

Pure and synchronous: hashing a long prompt takes milliseconds, so async callers run it in a
thread. Token ids must be Python ints (``ndarray.tolist()`` first): pickle serializes a numpy
integer differently.
"""

from __future__ import annotations

import hashlib
import logging
import pickle
import re
import threading
from array import array
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from functools import cache
from typing import Any, NewType, cast

from kvmesh.errors import InvalidArgument
from kvmesh.kv.events import BlockHash

log = logging.getLogger(__name__)

Digest = NewType("Digest", bytes)
"""A block's full hash as vLLM chains it (32 bytes for sha256, 16 for xxhash)."""

DEFAULT_SEED = "vllm-none-hash"
"""vLLM's ``DEFAULT_NONE_HASH_SEED``: the root seed of sha256 algorithms without PYTHONHASHSEED."""

PICKLE_PROTOCOL = 5
"""What vLLM's ``pickle.HIGHEST_PROTOCOL`` is on CPython 3.8 to 3.13. Pinned here so that a
router on a newer Python keeps matching; a unit test fails if the running Python's highest
protocol moves (then workers on that Python would hash differently)."""

_MASK64 = (1 << 64) - 1
_MAX_PYTHONHASHSEED = 4_294_967_295
_SEED_RE = re.compile(r"random|[0-9]+")
_TOKEN_TYPECODE = "I"  # unsigned 32-bit: every real vocabulary fits


class HashAlgo(StrEnum):
    """vLLM's ``prefix_caching_hash_algo`` values."""

    SHA256 = "sha256"
    SHA256_CBOR = "sha256_cbor"
    XXHASH = "xxhash"
    XXHASH_CBOR = "xxhash_cbor"


_NON_CRYPTO = frozenset({HashAlgo.XXHASH, HashAlgo.XXHASH_CBOR})


@dataclass(frozen=True, slots=True)
class HashConfig:
    """How the mesh's workers hash blocks; every router and worker must agree on all three."""

    algo: HashAlgo = HashAlgo.SHA256
    """The workers' ``prefix_caching_hash_algo``."""
    block_size: int = 32
    """Tokens per block: the workers' ``block_size`` (vLLM hashes only full blocks)."""
    seed: str | None = None
    """The workers' ``PYTHONHASHSEED``, exactly as the string in their environment; None: unset
    (then vLLM uses ``DEFAULT_SEED`` for the sha256 algorithms)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "algo", HashAlgo(self.algo))  # a plain str is accepted too
        if self.block_size <= 0:
            raise ValueError(f"block_size must be positive, got {self.block_size}")
        if self.seed is not None and not _valid_pythonhashseed(self.seed):
            raise ValueError(
                f"seed {self.seed!r} is not a valid PYTHONHASHSEED (Python refuses to start with "
                f"it): use 'random' or an integer 0..{_MAX_PYTHONHASHSEED}"
            )
        if self.seed is None and self.algo in _NON_CRYPTO:
            raise ValueError(
                f"{self.algo} without a seed: vLLM draws a random root hash per process, so no "
                "one can reproduce its hashes; set PYTHONHASHSEED on the workers and the same "
                "seed here"
            )

    @property
    def root_seed(self) -> str:
        """The string vLLM hashes into its root hash (``NONE_HASH``)."""
        return DEFAULT_SEED if self.seed is None else self.seed


def _valid_pythonhashseed(text: str) -> bool:
    if not _SEED_RE.fullmatch(text):
        return False
    return text == "random" or int(text) <= _MAX_PYTHONHASHSEED


@dataclass(frozen=True, slots=True)
class RequestKeys:
    """A request's inputs to the block hash besides its tokens (vLLM's
    ``generate_block_hash_extra_keys``). Multimodal inputs and prompt embeddings are not
    modelled. The default (no salt, no LoRA) is what plain requests use."""

    cache_salt: str | None = None
    """The request's ``cache_salt``; goes into the first block of the prompt only."""
    lora_name: str | None = None
    """``LoRARequest.lora_name``; goes into every block."""
    lora_path: str = ""
    """``LoRARequest.lora_path``; hashed with the name."""

    def extra_keys(self, first_block: bool) -> tuple[tuple[str, ...], ...] | None:
        """The ``extra_keys`` vLLM hashes with a block: LoRA first, then the salt."""
        keys: list[tuple[str, ...]] = []
        if self.lora_name:
            keys.append(("lora", self.lora_name, self.lora_path))
        if first_block and self.cache_salt:
            keys.append(("cache_salt", self.cache_salt))
        return tuple(keys) if keys else None


NO_KEYS = RequestKeys()

MAX_CACHE_SALT_CHARS = 128  # vLLM's rule for cache_salt (validate_cache_salt)
_CACHE_SALT_FORBIDDEN = frozenset("@/\\\0")


def salt_keys(cache_salt: str) -> RequestKeys:
    """The keys of a request salted with ``cache_salt`` ("": unsalted, ``NO_KEYS``)."""
    return RequestKeys(cache_salt=cache_salt) if cache_salt else NO_KEYS


def check_cache_salt(cache_salt: str, field_name: str = "cache_salt") -> None:
    """vLLM's rule for a cache salt (at most 128 characters, no '@', '/', '\\' or NUL; empty:
    none): ``InvalidArgument`` naming ``field_name`` otherwise."""
    if len(cache_salt) > MAX_CACHE_SALT_CHARS:
        raise InvalidArgument(
            f"{field_name} has {len(cache_salt)} characters; use at most "
            f"{MAX_CACHE_SALT_CHARS} (or leave it unset)",
            field_name,
        )
    if not _CACHE_SALT_FORBIDDEN.isdisjoint(cache_salt):
        raise InvalidArgument(
            f"{field_name} contains '@', '/', '\\' or NUL; use other characters", field_name
        )


# --- vLLM's hash functions (vllm/utils/hashing.py), same libraries, same arguments ----------


def _sha256_pickle(obj: Any) -> bytes:
    return hashlib.sha256(pickle.dumps(obj, protocol=PICKLE_PROTOCOL)).digest()


def _sha256_cbor(obj: Any) -> bytes:
    import cbor2  # only needed for this algorithm

    return hashlib.sha256(cbor2.dumps(obj, canonical=True)).digest()


def _xxh3_128(data: bytes) -> bytes:
    try:
        import xxhash
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ModuleNotFoundError("the xxhash algorithms need the 'xxhash' package") from exc
    return bytes(xxhash.xxh3_128_digest(data))


def _xxhash_pickle(obj: Any) -> bytes:
    return _xxh3_128(pickle.dumps(obj, protocol=PICKLE_PROTOCOL))


def _xxhash_cbor(obj: Any) -> bytes:
    import cbor2

    return _xxh3_128(cbor2.dumps(obj, canonical=True))


_HASH_FUNCTIONS: dict[HashAlgo, Callable[[Any], bytes]] = {
    HashAlgo.SHA256: _sha256_pickle,
    HashAlgo.SHA256_CBOR: _sha256_cbor,
    HashAlgo.XXHASH: _xxhash_pickle,
    HashAlgo.XXHASH_CBOR: _xxhash_cbor,
}


@cache
def _root(algo: HashAlgo, root_seed: str) -> Digest:
    return Digest(_HASH_FUNCTIONS[algo](root_seed))


def root_digest(cfg: HashConfig) -> Digest:
    """vLLM's ``NONE_HASH``: the parent of every prompt's first block."""
    return _root(cfg.algo, cfg.root_seed)


def fingerprint(cfg: HashConfig) -> str:
    """A short id of everything that determines the hashes (algorithm, block size, root), safe
    to publish (it does not reveal the seed). Workers and routers that show the same
    fingerprint hash alike; compare them at discovery to catch a mis-set PYTHONHASHSEED."""
    material = f"{cfg.algo}/{cfg.block_size}/".encode() + root_digest(cfg)
    return f"{cfg.algo}-{cfg.block_size}-{hashlib.sha256(material).hexdigest()[:16]}"


def to_block_hash(digest: Digest) -> BlockHash:
    """The 64-bit value KV events publish for ``digest`` (vLLM's ``maybe_convert_block_hash``)."""
    return BlockHash(int.from_bytes(digest, "big") & _MASK64)


def _as_ints(token_ids: Sequence[int]) -> Sequence[int]:
    """``token_ids`` as a sequence whose slices hold Python ints (pickle's view of them)."""
    if isinstance(token_ids, list | tuple) and (not token_ids or type(token_ids[0]) is int):
        return token_ids
    return [int(t) for t in token_ids]


def _extend_chain(
    digests: list[bytes],
    token_ids: Sequence[int],
    start: int,
    parent: bytes | None,
    cfg: HashConfig,
    keys: RequestKeys,
) -> None:
    """Appends to ``digests`` the digests of the full blocks of ``token_ids`` from offset
    ``start``, chaining from ``parent`` (None: the root, so the block at ``start`` is a prompt's
    first block and carries the cache salt)."""
    bs = cfg.block_size
    end = len(token_ids) - len(token_ids) % bs
    prev = parent or root_digest(cfg)  # vLLM: ``if not parent_block_hash: NONE_HASH``
    append = digests.append
    if keys == NO_KEYS and cfg.algo is HashAlgo.SHA256:
        # The common case, with _sha256_pickle inlined: about 15% faster on long prompts.
        sha256, dumps = hashlib.sha256, pickle.dumps
        for i in range(start, end, bs):
            prev = sha256(
                dumps((prev, tuple(token_ids[i : i + bs]), None), PICKLE_PROTOCOL)
            ).digest()
            append(prev)
        return
    fn = _HASH_FUNCTIONS[cfg.algo]
    first = parent is None
    for i in range(start, end, bs):
        prev = fn((prev, tuple(token_ids[i : i + bs]), keys.extra_keys(first and i == start)))
        append(prev)


def block_digests(
    token_ids: Sequence[int],
    cfg: HashConfig,
    *,
    parent: Digest | None = None,
    keys: RequestKeys = NO_KEYS,
) -> list[Digest]:
    """Full digests of every full block of ``token_ids`` (a trailing partial block is not
    hashed). ``parent``: the digest of the block before ``token_ids[0]``; None: ``token_ids``
    start a prompt."""
    out: list[bytes] = []
    _extend_chain(out, _as_ints(token_ids), 0, parent, cfg, keys)
    return cast(list[Digest], out)


def block_hashes(
    token_ids: Sequence[int],
    cfg: HashConfig,
    *,
    parent: Digest | None = None,
    keys: RequestKeys = NO_KEYS,
) -> list[BlockHash]:
    """The hashes vLLM's KV events publish for every full block of ``token_ids``, in order.
    ``parent`` as for ``block_digests`` (a full digest: the published 64 bits cannot chain)."""
    return _published(block_digests(token_ids, cfg, parent=parent, keys=keys))


def _published(digests: Sequence[bytes]) -> list[BlockHash]:
    mask, from_bytes = _MASK64, int.from_bytes
    return cast(list[BlockHash], [from_bytes(d, "big") & mask for d in digests])


# --- per-session reuse --------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SessionHashes:
    """One prompt's block hashes, and how many of them came from the session's previous turn."""

    hashes: tuple[BlockHash, ...]
    reused_blocks: int

    @property
    def hashed_blocks(self) -> int:
        """Blocks hashed for this call."""
        return len(self.hashes) - self.reused_blocks


@dataclass(frozen=True, slots=True)
class _Turn:
    """What a session keeps of its latest prompt: its full blocks only."""

    tokens: bytes  # the full blocks' token ids, as array('I') bytes
    digests: bytes  # the full digests, concatenated
    hashes: tuple[BlockHash, ...]
    keys: RequestKeys

    @property
    def num_tokens(self) -> int:
        return len(self.tokens) // 4


def _pack_tokens(token_ids: Sequence[int], num_tokens: int) -> bytes | None:
    """The first ``num_tokens`` ids as ``array('I')`` bytes; None if an id does not fit."""
    packed = array(_TOKEN_TYPECODE)
    try:
        if isinstance(token_ids, list):
            packed.fromlist(token_ids)
        else:
            packed.extend(token_ids)
    except (OverflowError, TypeError):
        return None
    return memoryview(packed)[:num_tokens].tobytes()


_CHUNK_BLOCKS = 256


def _common_blocks(old: bytes, new: bytes, block_bytes: int) -> int:
    """How many leading whole blocks ``old`` and ``new`` share (both block-aligned bytes).
    Compares with memcmp and stops in the first chunk that differs."""
    if len(old) <= len(new) and new.startswith(old):
        return len(old) // block_bytes
    limit = min(len(old), len(new))
    chunk = block_bytes * _CHUNK_BLOCKS
    pos = 0
    while pos < limit and old[pos : pos + chunk] == new[pos : pos + chunk]:
        pos += chunk
    stop = min(pos + chunk, limit)
    while pos < stop and old[pos : pos + block_bytes] == new[pos : pos + block_bytes]:
        pos += block_bytes
    return pos // block_bytes


class SessionHasher:
    """Block hashes of multi-turn prompts that rehash only what changed since the last turn.

    Keeps each session's latest prompt (its full blocks' tokens and digests). A new prompt of
    the same session reuses the chain up to the first block whose tokens differ, verified by
    comparing token bytes (about 1 ms for 195K tokens), and hashes the rest. Bounded: least
    recently used sessions go first when ``max_sessions`` or ``max_tokens`` (tokens kept over
    all sessions; about 6.5 bytes per token with sha256) is exceeded.

    Thread-safe: calls for different sessions hash concurrently (the lock covers only the
    table); two concurrent calls of one session both work, the later one's prompt is kept.
    """

    def __init__(
        self, cfg: HashConfig, *, max_sessions: int = 4096, max_tokens: int = 8_000_000
    ) -> None:
        if max_sessions <= 0 or max_tokens <= 0:
            raise ValueError("max_sessions and max_tokens must be positive")
        self._cfg = cfg
        self._max_sessions = max_sessions
        self._max_tokens = max_tokens
        self._turns: OrderedDict[str, _Turn] = OrderedDict()
        self._tokens = 0
        self._lock = threading.Lock()

    @property
    def config(self) -> HashConfig:
        return self._cfg

    def __len__(self) -> int:
        return len(self._turns)

    @property
    def cached_tokens(self) -> int:
        """Tokens kept over all sessions."""
        return self._tokens

    def forget(self, session_id: str) -> bool:
        """Drops a session; False if it was not kept."""
        with self._lock:
            turn = self._turns.pop(session_id, None)
            if turn is not None:
                self._tokens -= turn.num_tokens
            return turn is not None

    def hash(
        self,
        session_id: str | None,
        token_ids: Sequence[int],
        keys: RequestKeys = NO_KEYS,
    ) -> SessionHashes:
        """The published hashes of every full block of ``token_ids`` (as ``block_hashes``),
        reusing the session's previous turn where its tokens agree. ``session_id`` None:
        hash without a session."""
        cfg = self._cfg
        token_ids = _as_ints(token_ids)
        if session_id is None:
            return SessionHashes(tuple(block_hashes(token_ids, cfg, keys=keys)), 0)
        full = len(token_ids) - len(token_ids) % cfg.block_size
        packed = _pack_tokens(token_ids, full)
        if packed is None:
            log.debug("session %s: token ids do not fit 32 bits; hashing without reuse", session_id)
            return SessionHashes(tuple(block_hashes(token_ids, cfg, keys=keys)), 0)

        with self._lock:
            prev = self._turns.get(session_id)
            if prev is not None:
                self._turns.move_to_end(session_id)
        reused = 0
        if prev is not None and prev.keys == keys:
            reused = _common_blocks(prev.tokens, packed, cfg.block_size * 4)
        turn = self._extend(prev, reused, token_ids, packed, keys)
        self._store(session_id, turn)
        return SessionHashes(turn.hashes, reused)

    def _extend(
        self,
        prev: _Turn | None,
        reused: int,
        token_ids: Sequence[int],
        packed: bytes,
        keys: RequestKeys,
    ) -> _Turn:
        cfg = self._cfg
        new: list[bytes] = []
        if prev is None or reused == 0:
            _extend_chain(new, token_ids, 0, None, cfg, keys)
            return _Turn(packed, b"".join(new), tuple(_published(new)), keys)
        size = len(prev.digests) // len(prev.hashes)
        parent = prev.digests[(reused - 1) * size : reused * size]
        _extend_chain(new, token_ids, reused * cfg.block_size, parent, cfg, keys)
        return _Turn(
            packed,
            prev.digests[: reused * size] + b"".join(new),
            prev.hashes[:reused] + tuple(_published(new)),
            keys,
        )

    def _store(self, session_id: str, turn: _Turn) -> None:
        with self._lock:
            old = self._turns.pop(session_id, None)
            if old is not None:
                self._tokens -= old.num_tokens
            if turn.num_tokens > self._max_tokens:
                log.debug(
                    "session %s: %d tokens exceed max_tokens; not kept", session_id, turn.num_tokens
                )
                return
            self._turns[session_id] = turn
            self._tokens += turn.num_tokens
            while len(self._turns) > self._max_sessions or self._tokens > self._max_tokens:
                _, evicted = self._turns.popitem(last=False)
                self._tokens -= evicted.num_tokens
