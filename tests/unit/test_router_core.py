"""The router's pure core: worker set, routing policies, request validation."""

from __future__ import annotations

import random

import pytest

from kvmesh.discovery.keys import (
    Role,
    WorkerId,
    WorkerRecord,
    WorkerState,
    worker_from_entry,
    worker_key,
    worker_records,
)
from kvmesh.errors import InvalidArgument, NotFound, Unavailable
from services.router.core import validation
from services.router.core.routing import make_policy
from services.router.core.types import ChatMessage, LoadSnapshot, RouteRequest
from services.router.core.workers import WorkerSet

CLUSTER = "test"


def record(
    wid: str, model: str = "tiny", state: WorkerState = WorkerState.SERVING, **kw
) -> WorkerRecord:
    return WorkerRecord(
        worker_id=WorkerId(wid),
        address=f"127.0.0.1:{1000 + len(wid)}",
        model=model,
        model_path="/m",
        state=state,
        max_model_len=2048,
        block_size=32,
        vocab_size=1024,
        **kw,
    )


def put(ws: WorkerSet, rec: WorkerRecord):
    return ws.apply_put(rec)


REQ = RouteRequest(request_id="r", model="tiny", prompt_token_ids=(1, 2, 3))


class TestWorkerSet:
    def test_put_then_delete(self):
        ws = WorkerSet()
        change = put(ws, record("a"))
        assert [r.worker_id for r in change.added] == ["a"]
        assert [v.record.worker_id for v in ws.candidates("tiny")] == ["a"]
        change = put(ws, record("a", state=WorkerState.DRAINING))
        assert change.updated and not change.added
        assert ws.candidates("tiny") == []  # draining workers get no new work
        change = ws.apply_delete(WorkerId("a"))
        assert change.removed == ("a",)
        assert len(ws) == 0

    def test_snapshot_replaces_everything(self):
        ws = WorkerSet()
        put(ws, record("a"))
        put(ws, record("b"))
        c = record("c")
        change = ws.apply_snapshot(
            worker_records(
                CLUSTER,
                {
                    worker_key(CLUSTER, Role.BOTH, "b"): record("b").to_json(),
                    worker_key(CLUSTER, Role.BOTH, "c"): c.to_json(),
                },
            )
        )
        assert change.removed == ("a",)
        assert [r.worker_id for r in change.added] == ["c"]
        assert [r.worker_id for r in change.updated] == ["b"]
        assert sorted(v.record.worker_id for v in ws.all()) == ["b", "c"]

    @pytest.mark.parametrize(
        ("key", "value"),
        [
            pytest.param("/kvmesh/test/workers/both/a", "{not json", id="bad-json"),
            pytest.param("/kvmesh/test/workers/both/a", record("b").to_json(), id="id-mismatch"),
            pytest.param("/kvmesh/test/workers/gpu/a", record("a").to_json(), id="bad-role"),
            pytest.param("/kvmesh/other/workers/both/a", record("a").to_json(), id="other-cluster"),
            pytest.param("/kvmesh/test/workers/both/a", '{"address": "x"}', id="missing-fields"),
        ],
    )
    def test_malformed_records_are_skipped(self, key, value):
        """The etcd adapter parses entries (kvmesh/discovery/keys.py); a bad one never reaches
        the set, in a snapshot or as a put."""
        ws = WorkerSet()
        assert worker_from_entry(CLUSTER, key, value) is None
        assert ws.apply_snapshot(worker_records(CLUSTER, {key: value})).added == ()
        assert len(ws) == 0

    def test_models_summarises_serving_workers(self):
        ws = WorkerSet()
        put(ws, record("a"))
        put(ws, record("b"))
        put(ws, record("c", model="other"))
        put(ws, record("d", model="gone", state=WorkerState.DRAINING))
        models = {m.name: m for m in ws.models()}
        assert set(models) == {"tiny", "other"}
        assert models["tiny"].workers == 2
        assert models["tiny"].max_model_len == 2048

    @pytest.mark.parametrize(
        ("served", "name", "want"),
        [
            pytest.param(["tiny"], "", "tiny", id="the-only-model-unnamed"),
            pytest.param(["tiny", "other"], "other", "other", id="named"),
            pytest.param([], "tiny", Unavailable, id="nothing-served"),
            pytest.param(["tiny", "other"], "", InvalidArgument, id="several-unnamed"),
            pytest.param(["tiny"], "big", NotFound, id="not-served"),
        ],
    )
    def test_model_resolves_the_requests_model(self, served, name, want):
        ws = WorkerSet()
        for i, model in enumerate(served):
            put(ws, record(f"w{i}", model=model))
        if isinstance(want, str):
            assert ws.model(name).name == want
        else:
            with pytest.raises(want) as info:
                ws.model(name)
            if want is InvalidArgument:
                assert info.value.field == "model"

    def test_in_flight_never_negative(self):
        ws = WorkerSet()
        put(ws, record("a"))
        ws.finished(WorkerId("a"))
        ws.started(WorkerId("a"))
        ws.finished(WorkerId("a"))
        ws.finished(WorkerId("a"))
        assert ws.get(WorkerId("a")).router_in_flight == 0  # type: ignore[union-attr]


class TestRouting:
    def _set(self) -> WorkerSet:
        ws = WorkerSet()
        for w in ("a", "b", "c"):
            put(ws, record(w))
        return ws

    def test_least_loaded_prefers_fewest_outstanding(self):
        ws = self._set()
        ws.started(WorkerId("a"))
        ws.set_load(WorkerId("b"), LoadSnapshot(in_flight_requests=3))
        d = make_policy("least-loaded", rng=random.Random(0)).pick(REQ, ws.candidates("tiny"))
        assert d.worker_id == "c"
        assert d.policy == "least-loaded"

    def test_least_loaded_counts_other_routers_requests(self):
        ws = self._set()
        ws.set_load(WorkerId("a"), LoadSnapshot(in_flight_requests=2))
        ws.set_load(WorkerId("c"), LoadSnapshot(in_flight_requests=2))
        assert make_policy("least-loaded").pick(REQ, ws.candidates("tiny")).worker_id == "b"

    def test_least_loaded_breaks_ties_on_kv_usage_then_randomly(self):
        ws = self._set()
        ws.set_load(WorkerId("a"), LoadSnapshot(kv_cache_usage=0.5))
        picks = {
            make_policy("least-loaded", rng=random.Random(s))
            .pick(REQ, ws.candidates("tiny"))
            .worker_id
            for s in range(40)
        }
        assert picks == {"b", "c"}

    def test_round_robin_cycles(self):
        ws = self._set()
        rr = make_policy("round-robin")
        assert [rr.pick(REQ, ws.candidates("tiny")).worker_id for _ in range(4)] == [
            "a",
            "b",
            "c",
            "a",
        ]

    @pytest.mark.parametrize("name", ["least-loaded", "round-robin", "random"])
    def test_no_candidates_is_unavailable(self, name):
        with pytest.raises(Unavailable, match="no serving worker for model 'tiny'"):
            make_policy(name).pick(REQ, [])

    def test_unknown_policy(self):
        with pytest.raises(InvalidArgument, match="unknown routing policy"):
            make_policy("fastest")


class TestValidation:
    @pytest.mark.parametrize(
        ("messages", "match"),
        [
            pytest.param([], "messages is empty", id="empty"),
            pytest.param([ChatMessage("robot", "hi")], r"messages\[0\].role is 'robot'", id="role"),
            pytest.param([ChatMessage("tool", "42")], "no tool_call_id", id="tool-id"),
            pytest.param(
                [ChatMessage("user", ""), ChatMessage("system", "")],
                "empty content",
                id="all-empty",
            ),
        ],
    )
    def test_bad_chat(self, messages, match):
        with pytest.raises(InvalidArgument, match=match):
            validation.check_chat(messages)

    def test_good_chat(self):
        validation.check_chat(
            [
                ChatMessage("system", "be brief"),
                ChatMessage("user", "run ls"),
                ChatMessage("assistant", ""),
                ChatMessage("tool", "a.txt", tool_call_id="call_1"),
            ]
        )

    def test_empty_text(self):
        with pytest.raises(InvalidArgument, match="text is empty"):
            validation.check_text("")
