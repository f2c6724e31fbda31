"""Prompt block hashing for routing, with session-turn reuse.

Hashes are computed exactly as the workers' vLLM engines compute them (``kvmesh.kv.hashing``);
the algorithm and the root seed are mesh-wide settings, the block size comes from the model's
workers. A session's next turn that extends its previous prompt reuses that prompt's hash chain.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvmesh.kv.hashing import HashAlgo, HashConfig, SessionHasher, SessionHashes, salt_keys


class PromptHasher:
    def __init__(
        self,
        algo: HashAlgo | str = HashAlgo.SHA256,
        seed: str | None = None,
        max_sessions: int = 4096,
    ) -> None:
        self._algo = HashAlgo(algo)
        self._seed = seed
        self._max_sessions = max_sessions
        self._by_block_size: dict[int, SessionHasher] = {}

    def _hasher(self, block_size: int) -> SessionHasher:
        hasher = self._by_block_size.get(block_size)
        if hasher is None:
            cfg = HashConfig(algo=self._algo, block_size=block_size, seed=self._seed)
            hasher = SessionHasher(cfg, max_sessions=self._max_sessions)
            self._by_block_size[block_size] = hasher
        return hasher

    def hash(
        self, block_size: int, session_id: str, token_ids: Sequence[int], cache_salt: str = ""
    ) -> SessionHashes:
        """The prompt's block hashes, on the calling thread (``prompt.PromptBuilder`` decides
        which: the loop for a short prompt, the executor for a long one). ``cache_salt``: the
        request's (its tenant's), hashed into the first block as the engine does, so the
        hashes are the ones its engine publishes. Thread-safe."""
        return self._hasher(block_size).hash(session_id or None, token_ids, salt_keys(cache_salt))
