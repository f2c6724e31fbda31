"""The whole mesh, as real processes: a local etcd, two vLLM workers on the tiny model, and a
router. Started once per session (engine start-up dominates) and shared by the e2e tests."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kvmesh.launcher import Mesh, MeshSpec

MAX_MODEL_LEN = 2048


@pytest.fixture(scope="session")
def mesh(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    spec = MeshSpec(
        model_path=tiny_model,
        served_model_name="tiny",
        workers=2,
        max_model_len=MAX_MODEL_LEN,
        kv_cache_bytes=64 << 20,
        log_dir=tmp_path_factory.mktemp("mesh"),
        worker_args=("--trace-exporter", "console"),
        router_args=("--trace-exporter", "console"),
    )
    with Mesh(spec) as m:
        yield m
