"""A node mesh of kvmesh/netns.py (``MeshSpec.node``, ``bind_host``, ``netns``): its children's
flags parse with the services' own parsers to the node's name and address, its workers are
named after the node, its children run under ``ip netns exec``; the machine's own node keeps
the flags it had. No process is started (``subprocess.Popen`` is replaced)."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest

from kvmesh import launcher
from kvmesh.launcher import Mesh, MeshSpec
from services.kvmanager.main import parse_args as kvmanager_args
from services.worker.main import parse_args as worker_args


def node_spec(tmp_path: Path, **kw: Any) -> MeshSpec:
    return MeshSpec(
        model_path=tmp_path,
        workers=1,
        etcd_endpoints=("10.77.3.1:2379",),
        bind_cpus=False,
        log_dir=tmp_path / "logs",
        **kw,
    )


class FakePopen:
    argv: list[str] = []

    def __init__(self, argv: list[str], **kw: Any) -> None:
        FakePopen.argv = list(argv)
        self.pid = 0
        self.stdout = iter(())


def test_a_node_meshs_children_listen_on_its_address_in_its_name(tmp_path, monkeypatch):
    mesh = Mesh(node_spec(tmp_path, node="kvmn9-n1", bind_host="10.77.3.11", netns="kvmn9-n1"))
    assert [n for n, _ in mesh.worker_roles()] == ["kvmn9-n1-worker-0"]
    kvm = kvmanager_args(["--etcd", "10.77.3.1:2379", *mesh.node_args(kvmanager=True)])
    assert (kvm.host, kvm.node, kvm.kvmanager_id, kvm.metrics_host) == (
        "10.77.3.11",
        "kvmn9-n1",
        "kvmn9-n1",
        "10.77.3.11",
    )
    w = worker_args(mesh._worker_argv("kvmn9-n1-worker-0", ()))
    assert (w.host, w.node, w.worker_id, w.metrics_host) == (
        "10.77.3.11",
        "kvmn9-n1",
        "kvmn9-n1-worker-0",
        "10.77.3.11",
    )
    monkeypatch.setattr(subprocess, "Popen", FakePopen)
    monkeypatch.setattr(launcher, "_pump", lambda children, logf: logf.close())
    mesh.start_kvmanager()
    assert FakePopen.argv[:4] == ["ip", "netns", "exec", "kvmn9-n1"]


def test_the_machines_own_node_keeps_its_flags(tmp_path):
    mesh = Mesh(node_spec(tmp_path))
    assert mesh.node_args(kvmanager=True) == []
    assert [n for n, _ in mesh.worker_roles()] == ["worker-0"]


@pytest.mark.parametrize("nodes", [0, 3])
def test_kvmesh_up_takes_nodes(tmp_path, nodes):
    from kvmesh.cli import parse_args

    (tmp_path / "config.json").write_text("{}")
    a = parse_args(["up", "--model", str(tmp_path), "--nodes", str(nodes)])
    assert a.nodes == nodes
