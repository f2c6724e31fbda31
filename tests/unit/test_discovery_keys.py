"""The etcd key layout and the records stored under it (pure: no etcd)."""

from __future__ import annotations

import json

import pytest

from kvmesh.discovery.keys import (
    KvManagerRecord,
    Role,
    RouterRecord,
    WorkerId,
    WorkerRecord,
    WorkerState,
    check_name,
    cluster_prefix,
    kvmanager_from_entry,
    kvmanager_id_from_key,
    kvmanager_key,
    kvmanager_records,
    parse_worker_key,
    router_key,
    routers_prefix,
    worker_from_entry,
    worker_id_from_key,
    worker_key,
    worker_records,
    workers_prefix,
)


@pytest.mark.parametrize(
    ("cluster", "role", "worker_id", "key"),
    [
        ("default", Role.BOTH, "w1", "/kvmesh/default/workers/both/w1"),
        ("prod-eu.1", Role.PREFILL, "node-3_gpu0", "/kvmesh/prod-eu.1/workers/prefill/node-3_gpu0"),
        ("c", Role.DECODE, "127.0.0.1-5001", "/kvmesh/c/workers/decode/127.0.0.1-5001"),
        ("c", "decode", "w", "/kvmesh/c/workers/decode/w"),  # a plain string role is accepted
    ],
    ids=["both", "prefill-dotted-cluster", "decode-address-like-id", "role-as-string"],
)
def test_worker_key_layout(cluster: str, role: Role, worker_id: str, key: str) -> None:
    assert worker_key(cluster, role, worker_id) == key
    assert key.startswith(workers_prefix(cluster))
    assert key.startswith(cluster_prefix(cluster))
    assert parse_worker_key(cluster, key) == (Role(role), WorkerId(worker_id))


def test_prefixes_and_router_key() -> None:
    assert cluster_prefix("c") == "/kvmesh/c/"
    assert workers_prefix("c") == "/kvmesh/c/workers/"
    assert routers_prefix("c") == "/kvmesh/c/routers/"
    assert router_key("c", "r-1") == "/kvmesh/c/routers/r-1"
    # Workers and routers do not share a prefix, so a watch on one never sees the other.
    assert not router_key("c", "r-1").startswith(workers_prefix("c"))


@pytest.mark.parametrize(
    "key",
    [
        "/kvmesh/other/workers/both/w1",  # another cluster
        "/kvmesh/c/routers/r1",  # a router, not a worker
        "/kvmesh/c/workers/both/",  # no worker id
        "/kvmesh/c/workers/both",  # no worker segment at all
        "/kvmesh/c/workers/tensor/w1",  # unknown role
        "/kvmesh/c/workers/both/w1/extra",  # too deep
        "/kvmesh/cc/workers/both/w1",  # cluster name that merely starts with "c"
        "",
    ],
    ids=[
        "other-cluster",
        "router-key",
        "empty-id",
        "missing-id",
        "unknown-role",
        "too-deep",
        "prefix-lookalike-cluster",
        "empty",
    ],
)
def test_parse_worker_key_rejects_foreign_keys(key: str) -> None:
    assert parse_worker_key("c", key) is None


@pytest.mark.parametrize(
    "name",
    ["a", "A9", "w.1", "w_1", "w-1", "9lives", "x" * 128],
    ids=["one-letter", "alnum", "dot", "underscore", "dash", "leading-digit", "128-chars"],
)
def test_check_name_accepts(name: str) -> None:
    assert check_name("worker id", name) == name


@pytest.mark.parametrize(
    "name",
    [
        pytest.param("", id="empty"),
        pytest.param("a/b", id="slash"),
        pytest.param("-lead", id="leading-dash"),
        pytest.param(".lead", id="leading-dot"),
        pytest.param("_lead", id="leading-underscore"),
        pytest.param("sp ace", id="space"),
        pytest.param("x" * 129, id="129-chars"),
        pytest.param("ünï", id="non-ascii"),
        pytest.param("a\nb", id="inner-newline"),
        pytest.param("ab\n", id="trailing-newline"),
        pytest.param("a:b", id="colon"),
        pytest.param("*", id="star"),
    ],
)
def test_check_name_rejects(name: str) -> None:
    with pytest.raises(ValueError, match=r"worker id .* is not a valid name"):
        check_name("worker id", name)


@pytest.mark.parametrize(
    ("call", "kind"),
    [
        (lambda: worker_key("bad/cluster", Role.BOTH, "w"), "cluster"),
        (lambda: worker_key("c", Role.BOTH, "bad/id"), "worker id"),
        (lambda: router_key("c", ""), "router id"),
        (lambda: workers_prefix(""), "cluster"),
    ],
    ids=["cluster-in-worker-key", "worker-id", "router-id", "cluster-in-prefix"],
)
def test_key_builders_check_names(call, kind: str) -> None:
    with pytest.raises(ValueError, match=f"^{kind} "):
        call()


def test_worker_key_rejects_unknown_role() -> None:
    with pytest.raises(ValueError, match="'tensor' is not a valid Role"):
        worker_key("c", "tensor", "w")  # type: ignore[arg-type]


FULL = WorkerRecord(
    worker_id=WorkerId("w1"),
    address="10.0.0.5:50051",
    model="tiny",
    model_path="/models/tiny",
    role=Role.PREFILL,
    node="node-a",
    version="0.1.0",
    state=WorkerState.DRAINING,
    max_model_len=2048,
    block_size=16,
    vocab_size=32000,
)
MINIMAL = WorkerRecord(worker_id=WorkerId("w2"), address="h:1", model="m", model_path="/p")


@pytest.mark.parametrize("record", [FULL, MINIMAL], ids=["all-fields", "defaults"])
def test_worker_record_json_round_trip(record: WorkerRecord) -> None:
    raw = record.to_json()
    assert WorkerRecord.from_json(raw) == record
    assert WorkerRecord.from_json(raw.encode()) == record  # etcd hands out bytes
    data = json.loads(raw)
    assert data["role"] == record.role.value and data["state"] == record.state.value


def test_worker_record_from_json_types() -> None:
    back = WorkerRecord.from_json(FULL.to_json())
    assert type(back.role) is Role and type(back.state) is WorkerState


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        ({"gpu": "H100", "kv_tiers": ["gpu", "cpu"]}, FULL),
        ({"future": {"nested": 1}}, FULL),
    ],
    ids=["unknown-scalars-and-lists", "unknown-nested-object"],
)
def test_worker_record_ignores_unknown_fields(extra: dict, expected: WorkerRecord) -> None:
    data = json.loads(FULL.to_json()) | extra
    assert WorkerRecord.from_json(json.dumps(data)) == expected


@pytest.mark.parametrize(
    ("missing", "expected_role", "expected_state"),
    [
        ("role", Role.BOTH, WorkerState.DRAINING),
        ("state", Role.PREFILL, WorkerState.SERVING),
    ],
    ids=["no-role-means-both", "no-state-means-serving"],
)
def test_worker_record_missing_optional_fields_default(
    missing: str, expected_role: Role, expected_state: WorkerState
) -> None:
    data = json.loads(FULL.to_json())
    del data[missing]
    back = WorkerRecord.from_json(json.dumps(data))
    assert (back.role, back.state) == (expected_role, expected_state)


@pytest.mark.parametrize(
    "raw",
    [
        '{"address": "h:1", "model": "m", "model_path": "/p"}',  # no worker_id
        '{"worker_id": "w", "address": "h:1", "model": "m", "model_path": "/p", "role": "x"}',
        "not json",
    ],
    ids=["missing-required", "bad-role", "not-json"],
)
def test_worker_record_rejects_bad_json(raw: str) -> None:
    with pytest.raises((KeyError, TypeError, ValueError)):
        WorkerRecord.from_json(raw)


@pytest.mark.parametrize(
    "record",
    [RouterRecord("r1", "10.0.0.1:50050", "0.1.0"), RouterRecord("r2", "h:2")],
    ids=["with-version", "default-version"],
)
def test_router_record_round_trip(record: RouterRecord) -> None:
    assert RouterRecord.from_json(record.to_json()) == record
    data = json.loads(record.to_json()) | {"extra": True}
    assert RouterRecord.from_json(json.dumps(data)) == record


# ---- etcd entries -> records (what the router's and kvmanager's watchers hand the cores) --------
W = WorkerRecord(WorkerId("w1"), "h:1", "m", "/p", role=Role.PREFILL)
K = KvManagerRecord("k1", "h:2", "n1")


def test_well_formed_entries_become_records() -> None:
    key = worker_key("c", Role.PREFILL, "w1")
    assert worker_from_entry("c", key, W.to_json()) == W
    assert worker_from_entry("c", key, W.to_json().encode()) == W  # etcd hands out bytes
    assert worker_id_from_key("c", key) == "w1"
    assert kvmanager_from_entry("c", kvmanager_key("c", "k1"), K.to_json()) == K
    assert kvmanager_id_from_key("c", kvmanager_key("c", "k1")) == "k1"
    snapshot = {key: W.to_json(), worker_key("c", Role.BOTH, "w2"): "{not json"}
    assert worker_records("c", snapshot) == [W]
    assert kvmanager_records("c", {kvmanager_key("c", "k1"): K.to_json(), "/x": "{}"}) == [K]


@pytest.mark.parametrize(
    ("key", "value", "warned"),
    [
        pytest.param("/kvmesh/c/workers/prefill/w1", "{not json", True, id="bad-json"),
        pytest.param("/kvmesh/c/workers/prefill/w2", W.to_json(), True, id="id-mismatch"),
        pytest.param("/kvmesh/c/workers/decode/w1", W.to_json(), True, id="role-mismatch"),
        pytest.param("/kvmesh/c/workers/prefill/w1", '{"address": "x"}', True, id="missing"),
        pytest.param("/kvmesh/c/workers/gpu/w1", W.to_json(), False, id="not-a-role"),
        pytest.param("/kvmesh/d/workers/prefill/w1", W.to_json(), False, id="other-cluster"),
    ],
)
def test_malformed_worker_entries_are_none_and_warned(key, value, warned, caplog) -> None:
    with caplog.at_level("WARNING", logger="kvmesh.discovery.keys"):
        assert worker_from_entry("c", key, value) is None
    assert bool(caplog.records) is warned, caplog.text


@pytest.mark.parametrize(
    ("key", "value", "warned"),
    [
        pytest.param("/kvmesh/c/kvmanagers/k1", "{not json", True, id="bad-json"),
        pytest.param("/kvmesh/c/kvmanagers/k2", K.to_json(), True, id="id-mismatch"),
        pytest.param("/kvmesh/c/kvmanagers/k1", '{"address": "x"}', True, id="missing"),
        pytest.param("/kvmesh/c/kvmanagers/k1/x", K.to_json(), False, id="too-deep"),
        pytest.param("/kvmesh/c/kvmanagers/", K.to_json(), False, id="no-id"),
        pytest.param("/kvmesh/d/kvmanagers/k1", K.to_json(), False, id="other-cluster"),
    ],
)
def test_malformed_kvmanager_entries_are_none_and_warned(key, value, warned, caplog) -> None:
    with caplog.at_level("WARNING", logger="kvmesh.discovery.keys"):
        assert kvmanager_from_entry("c", key, value) is None
    assert bool(caplog.records) is warned, caplog.text


@pytest.mark.parametrize(
    "key",
    ["/kvmesh/c/workers/gpu/w1", "/kvmesh/d/workers/both/w1", "/kvmesh/c/kvmanagers/w1"],
    ids=["not-a-role", "other-cluster", "kvmanager-key"],
)
def test_worker_id_from_a_foreign_key_is_none(key: str) -> None:
    assert worker_id_from_key("c", key) is None
