"""``kvmesh auth hash-key`` / ``new-key`` / ``new-seed``: what goes in the router's API key file
(``--api-keys-file``, docs/tenants.md). The file holds digests only; the key itself goes to the
client.

``kvmesh.cli`` calls ``register(subparsers)``; each handler returns the process exit code."""

from __future__ import annotations

import argparse
import secrets
import sys
from typing import Any

from .core.auth import HASH_PREFIX, hash_key

KEY_PREFIX = "sk-kvmesh-"


def _hash(args: argparse.Namespace) -> int:
    key = args.key if args.key is not None else sys.stdin.readline().strip()
    if not key:
        print("kvmesh auth hash-key: no key (give it, or one line on stdin)", file=sys.stderr)
        return 1
    print(HASH_PREFIX + hash_key(key))
    return 0


def _new(args: argparse.Namespace) -> int:
    key = KEY_PREFIX + secrets.token_urlsafe(32)
    print(f"key:    {key}")
    print(f"digest: {HASH_PREFIX}{hash_key(key)}")
    print("give the key to the client; put the digest under its tenant's keys", file=sys.stderr)
    return 0


def _new_seed(args: argparse.Namespace) -> int:
    print(secrets.token_urlsafe(32))
    print(
        "put it in the key file as cache_salt_seed: (changing it empties every cache)",
        file=sys.stderr,
    )
    return 0


def register(subparsers: Any) -> argparse.ArgumentParser:
    """Adds ``auth`` (with ``hash-key``, ``new-key`` and ``new-seed``) to an argparse subparsers object."""
    auth = subparsers.add_parser("auth", help="API keys for the router's key file")
    sub = auth.add_subparsers(dest="auth_command", required=True)
    hash_p = sub.add_parser(
        "hash-key",
        help="print the digest of an API key, as the key file stores it (sha256:<hex>)",
    )
    hash_p.add_argument(
        "key", nargs="?", default=None, help="the key; omitted: one line on stdin (no history)"
    )
    hash_p.set_defaults(func=_hash)
    new_p = sub.add_parser("new-key", help="make a random API key and print it with its digest")
    new_p.set_defaults(func=_new)
    seed_p = sub.add_parser(
        "new-seed", help="make a random cache_salt_seed (the key file's secret for cache salts)"
    )
    seed_p.set_defaults(func=_new_seed)
    return auth
