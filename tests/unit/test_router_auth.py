"""The auth core (services/router/core/auth.py), table-driven: key file trees -> tables or the
error naming the entry, and the one decision: who a request is from, or 401 / 403 saying what
to fix. Plus the small pure edges: the gRPC metadata reader and the key file reader."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import yaml

from kvmesh.errors import InvalidArgument, PermissionDenied, Unauthenticated
from kvmesh.kv.hashing import check_cache_salt
from services.router.auth import key_of
from services.router.core.auth import (
    DEFAULT_SALT_SEED,
    INT32_MAX,
    Claims,
    Identity,
    KeyTable,
    Tenant,
    authorize,
    derive_cache_salt,
    hash_key,
    parse_key_table,
    static_table,
    tenant_of_key,
)
from services.router.core.ratelimit import Limits
from services.router.keyfile import read_key_file

SEARCH_KEY, BATCH_KEY = "sk-search-1", "sk-batch-1"
TREE = {
    "tenants": {
        "search": {"priority": 10, "keys": [f"sha256:{hash_key(SEARCH_KEY)}"]},
        "batch": {"keys": [hash_key(BATCH_KEY).upper()]},  # bare, any case; priority 0
        "retired": {"priority": 5, "keys": []},
    }
}


def salt(tenant: str, group: str = "", seed: str = DEFAULT_SALT_SEED) -> str:
    return derive_cache_salt(seed, tenant, group)


@pytest.fixture
def table() -> KeyTable:
    return parse_key_table(TREE, "keys.yaml")


def test_hash_key_is_sha256_hex():
    assert hash_key("abc") == hashlib.sha256(b"abc").hexdigest()
    assert tenant_of_key("abc") == "key-" + hashlib.sha256(b"abc").hexdigest()[:12]


def test_parsed_table(table: KeyTable):
    assert table.lookup(SEARCH_KEY) == Tenant("search", 10, cache_salt=salt("search"))
    assert table.lookup(BATCH_KEY) == Tenant("batch", 0, cache_salt=salt("batch"))
    assert not table.seeded
    assert table.lookup("sk-other") is None and table.lookup("") is None
    assert [t.name for t in table.tenants] == ["batch", "search"]  # retired holds no key
    assert SEARCH_KEY not in repr(table)  # the digests only, never a key


def test_rate_limits_per_tenant():
    tree = {
        "tenants": {
            "batch": {
                "keys": [hash_key(BATCH_KEY)],
                "requests_per_minute": 60,
                "tokens_per_minute": 100_000,
            },
            "search": {"keys": [hash_key(SEARCH_KEY)]},
        }
    }
    table = parse_key_table(tree, "keys.yaml")
    assert table.limits() == {"batch": Limits(60, 100_000)}  # search: unlimited
    tenant = table.lookup(BATCH_KEY)
    assert tenant is not None and tenant.limits == Limits(60, 100_000)


BAD_TREES = [
    pytest.param([], "want a mapping with 'tenants'", id="not-a-mapping"),
    pytest.param(None, "got nothing", id="empty-file"),
    pytest.param({"tenant": {}}, "unknown field(s) tenant", id="typo-top"),
    pytest.param({"tenants": {}}, "'tenants' must map", id="no-tenants"),
    pytest.param({"tenants": {"a b": {"keys": []}}}, "tenants.a b: a tenant name", id="name"),
    pytest.param({"tenants": {"a": ["k"]}}, "tenants.a: want a mapping", id="tenant-list"),
    pytest.param(
        {"tenants": {"a": {"keys": [], "prio": 1}}}, "tenants.a: unknown field(s) prio", id="typo"
    ),
    pytest.param({"tenants": {"a": {}}}, "tenants.a.keys: want a list", id="no-keys"),
    pytest.param(
        {"tenants": {"a": {"keys": ["sk-plain-key"]}}},
        "tenants.a.keys[0]: not a SHA-256 hex digest",
        id="plain-key",
    ),
    pytest.param(
        {"tenants": {"a": {"keys": [], "priority": "high"}}},
        "tenants.a.priority: want an integer",
        id="priority-text",
    ),
    pytest.param(
        {"tenants": {"a": {"keys": [], "priority": True}}},
        "tenants.a.priority: want an integer",
        id="priority-bool",
    ),
    pytest.param(
        {"tenants": {"a": {"keys": [], "priority": 2**31}}}, "int32 range", id="priority-big"
    ),
    pytest.param(
        {
            "tenants": {
                "a": {"keys": [hash_key("k")]},
                "b": {"keys": [f"sha256:{hash_key('k')}"]},
            }
        },
        "tenants.b: key",
        id="one-key-two-tenants",
    ),
    pytest.param(
        {"tenants": {"a": {"keys": [], "requests_per_minute": -1}}},
        "tenants.a.requests_per_minute: want a whole number >= 0",
        id="rpm-negative",
    ),
    pytest.param(
        {"tenants": {"a": {"keys": [], "tokens_per_minute": 1.5}}},
        "tenants.a.tokens_per_minute: want a whole number",
        id="tpm-float",
    ),
]


@pytest.mark.parametrize(("tree", "says"), BAD_TREES)
def test_bad_key_files(tree: object, says: str):
    with pytest.raises(InvalidArgument) as bad:
        parse_key_table(tree, "keys.yaml")
    assert str(bad.value).startswith("keys.yaml"), bad.value
    assert says in str(bad.value), bad.value
    assert "sk-plain-key" not in str(bad.value)  # a key pasted by mistake is not echoed


DECISIONS = [
    pytest.param(
        SEARCH_KEY, Claims(), Identity("search", 10, salt("search")), id="class-by-default"
    ),
    pytest.param(
        SEARCH_KEY,
        Claims("search", 10),
        Identity("search", 10, salt("search")),
        id="own-name-and-max",
    ),
    pytest.param(
        SEARCH_KEY, Claims(priority=3), Identity("search", 3, salt("search")), id="lower-priority"
    ),
    pytest.param(
        SEARCH_KEY,
        Claims(priority=-7),
        Identity("search", -7, salt("search")),
        id="negative-priority",
    ),
    pytest.param(BATCH_KEY, Claims(), Identity("batch", 0, salt("batch")), id="class-zero"),
    pytest.param(
        BATCH_KEY, Claims(priority=-1), Identity("batch", -1, salt("batch")), id="below-class-zero"
    ),
]


@pytest.mark.parametrize(("key", "claims", "want"), DECISIONS)
def test_authorize(table: KeyTable, key: str, claims: Claims, want: Identity):
    assert authorize(table, key, claims) == want


REFUSALS = [
    pytest.param("", Claims(), Unauthenticated, "no API key", id="no-key"),
    pytest.param("sk-wrong", Claims(), Unauthenticated, "not valid", id="wrong-key"),
    pytest.param(
        BATCH_KEY,
        Claims("search", tenant_source="header x-kvmesh-tenant"),
        PermissionDenied,
        "belongs to tenant 'batch', not 'search': leave header x-kvmesh-tenant unset",
        id="other-tenant",
    ),
    pytest.param(
        BATCH_KEY,
        Claims(priority=1),
        PermissionDenied,
        "tenant 'batch' may ask priority at most 0, not 1: lower priority",
        id="priority-above-class",
    ),
    pytest.param(
        SEARCH_KEY,
        Claims(priority=11, priority_source="header x-kvmesh-priority"),
        PermissionDenied,
        "at most 10, not 11: lower header x-kvmesh-priority",
        id="priority-above-class-header",
    ),
]


@pytest.mark.parametrize(("key", "claims", "exc", "says"), REFUSALS)
def test_refused(table: KeyTable, key: str, claims: Claims, exc: type[Exception], says: str):
    with pytest.raises(exc) as refused:
        authorize(table, key, claims)
    assert says in str(refused.value)
    assert not key or key not in str(refused.value)  # never echoes the key


def test_static_table_any_priority():
    table = static_table(["sk-1"])
    tenant = tenant_of_key("sk-1")
    assert authorize(table, "sk-1", Claims(priority=INT32_MAX)) == Identity(
        tenant, INT32_MAX, salt(tenant)
    )
    named = static_table({"sk-1": "team-a"})
    assert authorize(named, "sk-1") == Identity("team-a", INT32_MAX, salt("team-a"))
    two = static_table(["sk-1", "sk-2"])  # each key its own tenant, its own cache
    assert two.lookup("sk-1").cache_salt != two.lookup("sk-2").cache_salt  # type: ignore[union-attr]
    with pytest.raises(PermissionDenied):
        authorize(named, "sk-1", Claims("team-b"))


@pytest.mark.parametrize(
    ("metadata", "key"),
    [
        pytest.param((), "", id="none"),
        pytest.param((("authorization", "Bearer sk-1"),), "sk-1", id="bearer"),
        pytest.param((("authorization", "bearer  sk-1 "),), "sk-1", id="bearer-any-case"),
        pytest.param((("authorization", "Basic abc"),), "", id="basic-is-not-a-key"),
        pytest.param((("x-api-key", "sk-2"),), "sk-2", id="x-api-key"),
        pytest.param(
            (("x-api-key", "sk-2"), ("authorization", "Bearer sk-1")), "sk-1", id="bearer-first"
        ),
        pytest.param((("authorization-bin", b"x"),), "", id="binary-ignored"),
    ],
)
def test_grpc_metadata_key(metadata: tuple[tuple[str, str | bytes], ...], key: str):
    assert key_of(metadata) == key


def test_key_file_yaml_and_toml(tmp_path: Path):
    digest = hash_key(SEARCH_KEY)
    as_yaml = tmp_path / "keys.yaml"
    as_yaml.write_text(yaml.safe_dump({"tenants": {"search": {"priority": 4, "keys": [digest]}}}))
    as_toml = tmp_path / "keys.toml"
    as_toml.write_text(f'[tenants.search]\npriority = 4\nkeys = ["sha256:{digest}"]\n')
    for path in (as_yaml, as_toml):
        assert read_key_file(path).lookup(SEARCH_KEY) == Tenant(
            "search", 4, cache_salt=salt("search")
        ), path
    broken = tmp_path / "broken.toml"
    broken.write_text("[tenants.search\n")
    with pytest.raises(InvalidArgument, match=f"--api-keys-file {broken}"):
        read_key_file(broken)
    with pytest.raises(InvalidArgument, match="No such file"):
        read_key_file(tmp_path / "missing.yaml")


def test_cli_hash_key(capsys: pytest.CaptureFixture[str]):
    from kvmesh.cli import main

    assert main(["auth", "hash-key", SEARCH_KEY]) == 0
    digest = capsys.readouterr().out.strip()
    assert parse_key_table({"tenants": {"s": {"keys": [digest]}}}, "f").lookup(SEARCH_KEY)
    assert main(["auth", "new-key"]) == 0
    key_line, digest_line = capsys.readouterr().out.splitlines()
    key = key_line.split()[-1]
    assert digest_line.split()[-1] == f"sha256:{hash_key(key)}" and key.startswith("sk-kvmesh-")


# ---- cache salts (issue 15 section 2) ---------------------------------------------------------
SEED = "s3cret-seed-of-the-mesh"
KEYS = {name: f"sk-{name}" for name in ("alice", "bob", "carol", "dave", "team-a")}
SALTED_TREE = {
    "cache_salt_seed": SEED,
    "tenants": {
        "alice": {"keys": [hash_key(KEYS["alice"])]},
        "bob": {"keys": [hash_key(KEYS["bob"])]},
        "carol": {"keys": [hash_key(KEYS["carol"])], "cache_group": "team-a"},
        "dave": {"keys": [hash_key(KEYS["dave"])], "cache_group": "team-a"},
        # a tenant named like the group does not join it
        "team-a": {"keys": [hash_key(KEYS["team-a"])]},
    },
}


def salt_of(table: KeyTable, tenant: str) -> str:
    return authorize(table, KEYS[tenant]).cache_salt


def test_each_tenant_its_own_salt_groups_share():
    table = parse_key_table(SALTED_TREE, "keys.yaml")
    assert table.seeded
    salts = {t: salt_of(table, t) for t in KEYS}
    assert salts["carol"] == salts["dave"] == salt("", "team-a", SEED)
    assert salts["alice"] == salt("alice", seed=SEED)
    assert len({salts["alice"], salts["bob"], salts["carol"], salts["team-a"]}) == 4
    for value in salts.values():
        check_cache_salt(value)  # what vLLM accepts
        assert len(value) == 64 and value == value.lower()
    # Not guessable from the name alone: not the name, not its digest, not the unseeded salt.
    assert salts["alice"] not in ("alice", hashlib.sha256(b"alice").hexdigest(), salt("alice"))
    assert salts["alice"] not in repr(table.lookup(KEYS["alice"]))  # kept out of logs


def test_salt_follows_the_seed_and_nothing_else():
    a = parse_key_table(SALTED_TREE, "a.yaml")
    reordered = {"tenants": dict(reversed(SALTED_TREE["tenants"].items())), "cache_salt_seed": SEED}
    b = parse_key_table(reordered, "b.yaml")  # another router reading the same file: same salts
    assert all(salt_of(a, t) == salt_of(b, t) for t in KEYS)
    other = parse_key_table({**SALTED_TREE, "cache_salt_seed": SEED + "-2"}, "c.yaml")
    assert all(salt_of(a, t) != salt_of(other, t) for t in KEYS)
    assert derive_cache_salt(SEED, "x", "g") == derive_cache_salt(SEED, "y", "g")
    assert derive_cache_salt(SEED, "g") != derive_cache_salt(SEED, "other", "g")


@pytest.mark.parametrize(
    ("tree", "says"),
    [
        pytest.param(
            {**TREE, "cache_salt_seed": "short"}, "cache_salt_seed: want", id="seed-short"
        ),
        pytest.param({**TREE, "cache_salt_seed": 12345}, "cache_salt_seed: want", id="seed-int"),
        pytest.param(
            {"tenants": {"a": {"keys": [], "cache_group": "a/b"}}},
            "tenants.a.cache_group: a group name",
            id="group-chars",
        ),
        pytest.param(
            {"tenants": {"a": {"keys": [], "cache_group": 3}}},
            "tenants.a.cache_group",
            id="group-int",
        ),
        pytest.param(
            {"tenants": {"a": {"keys": [], "cache_grp": "g"}}},
            "unknown field(s) cache_grp",
            id="group-typo",
        ),
    ],
)
def test_bad_salt_settings(tree: object, says: str):
    with pytest.raises(InvalidArgument, match=r"^keys\.yaml") as bad:
        parse_key_table(tree, "keys.yaml")
    assert says in str(bad.value), bad.value


def test_cli_new_seed(capsys: pytest.CaptureFixture[str]):
    from kvmesh.cli import main

    assert main(["auth", "new-seed"]) == 0
    seed = capsys.readouterr().out.strip()
    assert parse_key_table({**TREE, "cache_salt_seed": seed}, "f").seeded
