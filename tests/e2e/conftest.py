"""The whole mesh, as real processes: a local etcd, two vLLM workers on the tiny model, and a
router. Started once per session (engine start-up dominates) and shared by the e2e tests; a
module that restarts the mesh's processes starts its own from the same spec (``mesh_spec``)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kvmesh.launcher import Mesh, MeshSpec

MAX_MODEL_LEN = 2048


def mesh_spec(tiny_model: Path, log_dir: Path) -> MeshSpec:
    return MeshSpec(
        model_path=tiny_model,
        served_model_name="tiny",
        workers=2,
        max_model_len=MAX_MODEL_LEN,
        kv_cache_bytes=64 << 20,
        log_dir=log_dir,
        worker_args=("--trace-exporter", "console"),
        router_args=("--trace-exporter", "console"),
    )


@pytest.fixture(scope="session")
def mesh(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    with Mesh(mesh_spec(tiny_model, tmp_path_factory.mktemp("mesh"))) as m:
        yield m
