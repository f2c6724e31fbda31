"""The committed stubs in kvmesh/v1 are exactly what `python -m kvmesh.protogen` makes now."""

from __future__ import annotations

from pathlib import Path

from kvmesh import protogen


def test_stubs_match_protos(tmp_path: Path):
    protogen.generate(tmp_path)
    fresh = {p.name: p.read_bytes() for p in (tmp_path / "kvmesh" / "v1").iterdir()}
    committed_dir = protogen.REPO / "kvmesh" / "v1"
    committed = {
        p.name: p.read_bytes()
        for p in committed_dir.iterdir()
        if p.name in fresh or "_pb2" in p.name
    }
    stale = sorted(n for n in fresh.keys() | committed.keys() if fresh.get(n) != committed.get(n))
    assert not stale, (
        f"stale stubs {stale}: run `make protos` (python -m kvmesh.protogen) and commit"
    )
    assert len(fresh) == 3 * len(protogen.proto_files())  # _pb2.py, _pb2.pyi, _pb2_grpc.py each
