"""Who is calling: API keys -> tenants, and what a caller may claim. Pure: no file, socket or
clock; the key file's text is decoded by the adapter (``services/router/keyfile.py``) and the
key comes from the HTTP header or gRPC metadata (``http/auth.py``, ``auth.py``).

A key file maps tenants to the SHA-256 hex digests of their API keys (never the keys), each
tenant with a priority class: the highest priority its requests may ask for, and the priority
of those that ask none (0 means "none asked": proto3 cannot tell it from unset)::

    tenants:
      search:
        priority: 10
        keys: [sha256:9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08]
      batch:
        keys: [...]            # priority 0

``authorize`` is the one decision: no key or an unknown one -> ``Unauthenticated``; a known key
naming another tenant, or asking more priority than its tenant holds -> ``PermissionDenied``;
else the ``Identity`` the rest of the router sees (``request.tenant``, ``request.priority``,
``request.cache_salt``).

Caches never leak between tenants: each tenant has its own vLLM ``cache_salt``, derived here
(``derive_cache_salt``: HMAC-SHA256 keyed by the file's ``cache_salt_seed`` over the tenant's name, or
over its ``cache_group`` when it shares one), so the same prompt from two tenants hashes to
different blocks in every engine, kvmanager tier and KV event. Tenants naming the same
``cache_group`` get the same salt and share their prefix cache (a team's system prompt)::

    cache_salt_seed: <a long random string, kvmesh auth new-seed>
    tenants:
      alice: {keys: [...], cache_group: team-a}
      bob:   {keys: [...], cache_group: team-a}   # shares alice's cache
      eve:   {keys: [...]}                        # her own
"""

from __future__ import annotations

import hashlib
import hmac
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import NewType

from kvmesh.errors import InvalidArgument, PermissionDenied, Unauthenticated

from .ratelimit import Limits

KeyHash = NewType("KeyHash", str)  # SHA-256 hex digest (64 lower-case hex) of an API key

INT32_MAX = 2**31 - 1
INT32_MIN = -(2**31)
HASH_PREFIX = "sha256:"
_HEX64 = re.compile(r"[0-9a-f]{64}")
_TENANT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
_FILE_FIELDS = frozenset({"tenants", "cache_salt_seed"})
_TENANT_FIELDS = frozenset(
    {"priority", "keys", "cache_group", "requests_per_minute", "tokens_per_minute"}
)
# The seed of a file that sets none (and of ``--api-key`` tables): salts then follow from
# tenant and group names alone, which is isolation still (the router sets every salt; a client
# can neither send one nor read one), but not secret from whoever knows the names and reaches
# an engine directly. ``keyfile`` warns about it.
DEFAULT_SALT_SEED = "kvmesh-cache-salt-v1"
MIN_SALT_SEED_CHARS = 16


def hash_key(key: str) -> KeyHash:
    """The digest a key file stores for ``key`` (what ``kvmesh auth hash-key`` prints)."""
    return KeyHash(hashlib.sha256(key.encode()).hexdigest())


def derive_cache_salt(seed: str, tenant: str, group: str = "") -> str:
    """The vLLM ``cache_salt`` of ``tenant``'s requests: 64 hex digits of HMAC-SHA256 keyed by
    ``seed`` over the tenant's name, or over ``group`` when it shares one (tenant and group
    names are kept apart: a tenant named like a group does not join it). Without the seed it
    cannot be guessed from the names; it fits vLLM's rule (at most 128 characters, no
    '@', '/', '\\' or NUL)."""
    scope = f"group:{group}" if group else f"tenant:{tenant}"
    return hmac.new(seed.encode(), scope.encode(), hashlib.sha256).hexdigest()


@dataclass(frozen=True, slots=True)
class Tenant:
    name: str
    priority: int = 0  # the class: the most its requests may ask, and what they get by default
    cache_group: str = ""  # tenants naming the same group share their prefix cache
    # Its requests' vLLM cache_salt (``derive_cache_salt``); "": none (a table built by hand).
    cache_salt: str = field(default="", repr=False)
    # Its rate limits (``ratelimit.py``; enforced with --admission): requests and tokens per
    # minute, 0: unlimited.
    limits: Limits = field(default_factory=Limits)


@dataclass(frozen=True, slots=True)
class Identity:
    """Who a request is from, as the router sees it once the key was checked."""

    tenant: str
    priority: int
    # The salt every block of its requests is hashed with (vLLM's cache_salt): the tenant's,
    # whatever the client sent. "": unsalted.
    cache_salt: str = field(default="", repr=False)


@dataclass(frozen=True, slots=True)
class Claims:
    """What a request asks for beside its key, and where it said so (for the messages)."""

    tenant: str = ""  # empty: its key's tenant
    priority: int = 0  # 0: its tenant's class
    tenant_source: str = "tenant"  # the field or header a client fixes: "header x-kvmesh-tenant"
    priority_source: str = "priority"


@dataclass(frozen=True, slots=True)
class KeyTable:
    """The accepted keys: digest -> tenant. Immutable; a reload builds a new one."""

    by_hash: Mapping[KeyHash, Tenant]
    source: str = ""  # where it came from (the file), for logs
    seeded: bool = False  # the salts come from a cache_salt_seed (not DEFAULT_SALT_SEED)

    def limits(self) -> dict[str, Limits]:
        """Each limited tenant's rate limits, by name."""
        return {t.name: t.limits for t in self.by_hash.values() if t.limits.limited}

    @property
    def tenants(self) -> tuple[Tenant, ...]:
        """The tenants holding at least one key, by name."""
        return tuple(sorted(set(self.by_hash.values()), key=lambda t: t.name))

    def lookup(self, key: str) -> Tenant | None:
        """The tenant of ``key`` (a dict lookup on its digest: no comparison of secrets)."""
        return self.by_hash.get(hash_key(key)) if key else None


def tenant_of_key(key: str) -> str:
    """A stable tenant name for a key that names none (``--api-key``; an open router's
    caller): never the secret itself."""
    return "key-" + hash_key(key)[:12]


def static_table(keys: Mapping[str, str] | Iterable[str]) -> KeyTable:
    """Plain keys (-> tenant names; just keys: each its own ``tenant_of_key``) as a table
    (``--api-key``, ``OpenAIServer(api_keys=...)``): any priority may be asked, as before
    there were key files."""
    pairs = keys.items() if isinstance(keys, Mapping) else ((k, tenant_of_key(k)) for k in keys)
    # Each tenant its own cache salt. A ``tenant_of_key`` name is itself derived from the
    # secret key, so no other client can work the salt out from it.
    return KeyTable(
        {
            hash_key(k): Tenant(t, INT32_MAX, cache_salt=derive_cache_salt(DEFAULT_SALT_SEED, t))
            for k, t in pairs
        },
        "--api-key",
    )


def authorize(table: KeyTable, key: str, claims: Claims = Claims()) -> Identity:
    """The one decision (module docstring). Messages say what to fix, never echo the key."""
    if not key:
        raise Unauthenticated(
            "no API key: send it as 'Authorization: Bearer <key>' (HTTP, also x-api-key; "
            "gRPC metadata 'authorization'); OpenAI clients: api_key="
        )
    tenant = table.lookup(key)
    if tenant is None:
        raise Unauthenticated("the API key is not valid for this router")
    if claims.tenant and claims.tenant != tenant.name:
        raise PermissionDenied(
            f"this API key belongs to tenant {tenant.name!r}, not {claims.tenant!r}: leave "
            f"{claims.tenant_source} unset (or {tenant.name!r}), or use {claims.tenant!r}'s key"
        )
    if claims.priority and claims.priority > tenant.priority:
        raise PermissionDenied(
            f"tenant {tenant.name!r} may ask priority at most {tenant.priority}, not "
            f"{claims.priority}: lower {claims.priority_source} or leave it unset"
        )
    return Identity(tenant.name, claims.priority or tenant.priority, tenant.cache_salt)


# ---- the key file ---------------------------------------------------------------------------
def parse_key_table(tree: object, source: str) -> KeyTable:
    """A decoded key file (YAML or TOML: the same tree) as a table; every mistake is an
    ``InvalidArgument`` naming the file and the entry. Unknown fields are errors (a typo of
    ``priority`` must not silently mean 0)."""
    if not isinstance(tree, Mapping):
        raise InvalidArgument(f"{source}: want a mapping with 'tenants', got {_kind(tree)}")
    _no_unknown(tree, _FILE_FIELDS, source)
    tenants = tree.get("tenants")
    if not isinstance(tenants, Mapping) or not tenants:
        raise InvalidArgument(f"{source}: 'tenants' must map tenant names to {{priority, keys}}")
    seed = _seed(tree.get("cache_salt_seed"), source)
    by_hash: dict[KeyHash, Tenant] = {}
    for name, spec in tenants.items():
        where = f"{source}: tenants.{name}"
        if not isinstance(name, str) or not _TENANT_NAME.fullmatch(name):
            raise InvalidArgument(
                f"{where}: a tenant name is 1-64 letters, digits, '.', '_' or '-', starting "
                "with a letter or digit"
            )
        if not isinstance(spec, Mapping):
            raise InvalidArgument(f"{where}: want a mapping with keys and priority")
        _no_unknown(spec, _TENANT_FIELDS, where)
        group = _group(spec.get("cache_group"), where)
        tenant = Tenant(
            name,
            _priority(spec.get("priority", 0), where),
            group,
            derive_cache_salt(seed or DEFAULT_SALT_SEED, name, group),
            Limits(
                _per_minute(spec.get("requests_per_minute", 0), f"{where}.requests_per_minute"),
                _per_minute(spec.get("tokens_per_minute", 0), f"{where}.tokens_per_minute"),
            ),
        )
        for digest in _digests(spec.get("keys"), where):
            other = by_hash.get(digest)
            if other is not None:
                raise InvalidArgument(
                    f"{where}: key {digest[:12]}... is also tenant {other.name!r}'s; a key "
                    "names one tenant"
                )
            by_hash[digest] = tenant
    return KeyTable(by_hash, source, seeded=seed is not None)


def _seed(value: object, source: str) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or len(value.strip()) < MIN_SALT_SEED_CHARS:
        raise InvalidArgument(
            f"{source}: cache_salt_seed: want a secret string of at least {MIN_SALT_SEED_CHARS} "
            "characters ('kvmesh auth new-seed' makes one), or leave it out"
        )
    return value.strip()


def _group(value: object, where: str) -> str:
    if value is None:
        return ""
    if not isinstance(value, str) or not _TENANT_NAME.fullmatch(value):
        raise InvalidArgument(
            f"{where}.cache_group: a group name is 1-64 letters, digits, '.', '_' or '-', "
            "starting with a letter or digit; tenants naming the same group share their "
            "prefix cache"
        )
    return value


def _digests(keys: object, where: str) -> Iterable[KeyHash]:
    if not isinstance(keys, list):  # empty: a tenant with no key (yet, or any more)
        raise InvalidArgument(f"{where}.keys: want a list of key digests (kvmesh auth hash-key)")
    for i, entry in enumerate(keys):
        text = entry.strip().lower() if isinstance(entry, str) else ""
        text = text.removeprefix(HASH_PREFIX)
        if not _HEX64.fullmatch(text):
            raise InvalidArgument(
                f"{where}.keys[{i}]: not a SHA-256 hex digest; store what "
                "'kvmesh auth hash-key' prints for the key, never the key itself"
            )
        yield KeyHash(text)


def _priority(value: object, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidArgument(f"{where}.priority: want an integer, got {value!r}")
    if not INT32_MIN <= value <= INT32_MAX:
        raise InvalidArgument(f"{where}.priority: {value} is outside the int32 range")
    return value


def _per_minute(value: object, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InvalidArgument(f"{where}: want a whole number >= 0 (0: unlimited), got {value!r}")
    return value


def _no_unknown(tree: Mapping[object, object], known: frozenset[str], where: str) -> None:
    unknown = sorted(str(k) for k in tree if k not in known)
    if unknown:
        raise InvalidArgument(
            f"{where}: unknown field(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}"
        )


def _kind(value: object) -> str:
    return "nothing" if value is None else type(value).__name__
