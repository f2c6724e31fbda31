"""``kvmesh status`` output: the table (columns, unreachable services, problems) and the JSON."""

from __future__ import annotations

import json

import pytest

from kvmesh.status import (
    ClusterStatus,
    KvManagerStatus,
    RouterStatus,
    TierFill,
    WorkerStatus,
    format_table,
    human_bytes,
)

MIB = 1 << 20

STATUS = ClusterStatus(
    cluster="prod",
    etcd="127.0.0.1:2379",
    workers=(
        WorkerStatus(
            worker_id="gpu0-50061",
            role="prefill",
            node="node-a",
            state="serving",
            address="10.0.0.1:50061",
            model="smollm2",
            reachable=True,
            running=3,
            waiting=12,
            in_flight=15,
            kv_cache_usage=0.4567,
            cache_hit_rate=0.75,
        ),
        WorkerStatus(
            worker_id="gpu1-50062",
            role="decode",
            node="node-b",
            state="draining",
            address="10.0.0.2:50062",
            model="smollm2",
            error="UNAVAILABLE: failed to connect",
        ),
    ),
    kvmanagers=(
        KvManagerStatus(
            kvmanager_id="node-a",
            node="node-a",
            address="10.0.0.1:50070",
            reachable=True,
            tiers=(TierFill("cpu", 512 * MIB, 1024 * MIB, 100), TierFill("disk", 0, 0, 0)),
        ),
    ),
    routers=(
        RouterStatus("r1", "10.0.0.9:50051", "0.1.0", reachable=True, serving=True),
        RouterStatus("r2", "10.0.0.8:50051", "", error="DEADLINE_EXCEEDED: no answer in time"),
    ),
    bad_records=("/kvmesh/prod/workers/both/x",),
)


def rows(text: str, section: str) -> list[str]:
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(section))
    out = []
    for line in lines[start + 1 :]:
        if not line:
            break
        out.append(line)
    return out


def test_table_sections_columns_and_problems():
    text = format_table(STATUS)
    assert text.startswith("cluster prod (etcd 127.0.0.1:2379)\n")
    header, up, down = rows(text, "WORKERS (2)")
    assert header.split() == ["ID", "ROLE", "NODE", "STATE", "ADDRESS", "MODEL", "RUN", "WAIT", "KV", "HIT"]  # fmt: skip
    assert up.split() == ["gpu0-50061", "prefill", "node-a", "serving", "10.0.0.1:50061", "smollm2", "3", "12", "45.7%", "75.0%"]  # fmt: skip
    assert down.split()[3] == "unreachable" and down.split()[6:] == ["-", "-", "-", "-"]
    # Columns line up: each column starts at the same offset on every row.
    assert up.index("serving") == down.index("unreachable") == header.index("STATE")
    assert header.rindex("HIT") + 3 == len(up)  # numbers are right-aligned

    _, kvm = rows(text, "KVMANAGERS (1)")
    assert "512.0 MiB / 1.0 GiB (50%)" in kvm and kvm.endswith("100")
    assert "0 B / 0 B" in kvm

    _, r1, r2 = rows(text, "ROUTERS (2)")
    assert r1.split() == ["r1", "serving", "10.0.0.9:50051", "0.1.0"]
    assert r2.split() == ["r2", "unreachable", "10.0.0.8:50051", "-"]

    problems = rows(text, "PROBLEMS")
    assert problems == [
        "  worker gpu1-50062: UNAVAILABLE: failed to connect",
        "  router r2: DEADLINE_EXCEEDED: no answer in time",
        "  unreadable etcd record /kvmesh/prod/workers/both/x",
    ]


def test_empty_cluster_has_empty_sections_and_no_problems():
    text = format_table(ClusterStatus(cluster="empty", etcd="e:2379"))
    assert "WORKERS (0)" in text and "KVMANAGERS (0)" in text and "ROUTERS (0)" in text
    assert "PROBLEMS" not in text


def test_json_round_trips_every_field():
    data = json.loads(json.dumps(STATUS.to_dict()))
    assert data["workers"][0]["cache_hit_rate"] == 0.75
    assert data["workers"][1]["running"] is None and data["workers"][1]["reachable"] is False
    assert data["kvmanagers"][0]["tiers"][0] == {
        "tier": "cpu",
        "used_bytes": 512 * MIB,
        "capacity_bytes": 1024 * MIB,
        "blocks": 100,
    }
    assert data["routers"][1]["error"].startswith("DEADLINE_EXCEEDED")


@pytest.mark.parametrize(
    ("n", "text"),
    [(0, "0 B"), (1023, "1023 B"), (1024, "1.0 KiB"), (1536, "1.5 KiB"), (3 * MIB, "3.0 MiB")],
    ids=["zero", "below-kib", "kib", "fraction", "mib"],
)
def test_human_bytes(n, text):
    assert human_bytes(n) == text


def test_tenants_are_summed_over_routers_models_and_bands():
    from kvmesh.status import tenant_samples, tenants_of

    router_a = """# TYPE kvmesh_router_admission_admitted counter
kvmesh_router_admission_admitted_total{model="m",band="10",tenant="web",how="immediate"} 5.0
kvmesh_router_admission_admitted_total{model="m",band="10",tenant="web",how="queued"} 2.0
kvmesh_router_admission_admitted_created{model="m",band="10",tenant="web",how="queued"} 1.7e9
# TYPE kvmesh_router_admission_rejected counter
kvmesh_router_admission_rejected_total{model="m",band="0",tenant="batch",reason="queue-full"} 3.0
# TYPE kvmesh_router_admission_queue_depth gauge
kvmesh_router_admission_queue_depth{model="m",band="0",tenant="batch"} 4.0
# TYPE kvmesh_router_tenant_tokens counter
kvmesh_router_tenant_tokens_total{model="m",tenant="web",kind="prompt-uncached"} 100.0
kvmesh_router_tenant_tokens_total{model="m",tenant="web",kind="prompt-cached"} 900.0
kvmesh_router_tenant_tokens_total{model="m",tenant="web",kind="output"} 30.0
# TYPE other_total counter
other_total 1.0
"""
    router_b = """# TYPE kvmesh_router_admission_rejected counter
kvmesh_router_admission_rejected_total{model="m",band="0",tenant="batch",reason="rate-limit"} 1.0
kvmesh_router_admission_rejected_total{model="m",band="0",tenant="batch",reason="queue-full"} 2.0
kvmesh_router_admission_rejected_total{model="m",band="0",tenant="idle",reason="queue-full"} 0.0
"""
    batch, web = tenants_of(tenant_samples(router_a) + tenant_samples(router_b))  # by name
    assert (batch.tenant, batch.queued, batch.admitted, batch.rejected) == ("batch", 4, 0, 6)
    assert batch.rejected_by == (("queue-full", 5), ("rate-limit", 1))
    assert (web.tenant, web.admitted, web.uncached_tokens, web.output_tokens) == ("web", 7, 100, 30)
