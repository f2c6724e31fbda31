"""`kvmesh up --prefill N --decode M`: which workers start with which role; `kvmesh up` alone is
unchanged (two workers of role both)."""

from __future__ import annotations

import argparse
from pathlib import Path
from types import SimpleNamespace

import pytest

from kvmesh.cli import _both_workers
from kvmesh.launcher import Mesh, MeshSpec


def ns(workers=None, prefill=0, decode=0, kvm=1 << 30) -> argparse.Namespace:
    return argparse.Namespace(
        workers=workers, prefill=prefill, decode=decode, kvmanager_cpu_bytes=kvm
    )


@pytest.mark.parametrize(
    ("args", "both"),
    [
        (ns(), 2),
        (ns(workers=3), 3),
        (ns(prefill=1, decode=2), 0),
        (ns(workers=1, prefill=1, decode=1), 1),
        (ns(decode=1), 0),
    ],
    ids=["default", "workers", "pd", "pd-plus-both", "decode-only"],
)
def test_worker_counts(args, both):
    assert _both_workers(args) == both


@pytest.mark.parametrize(
    "args",
    [ns(prefill=1), ns(prefill=1, decode=1, kvm=0), ns(workers=0), ns(prefill=-1)],
    ids=["prefill-alone", "no-kvmanager", "none", "negative"],
)
def test_bad_counts_exit_with_a_message(args):
    with pytest.raises(SystemExit) as info:
        _both_workers(args)
    assert "kvmesh:" in str(info.value.code)


def test_roles_and_names():
    spec = MeshSpec(model_path=Path("/m"), workers=1, prefill_workers=1, decode_workers=2)
    roles = Mesh.worker_roles(SimpleNamespace(spec=spec))  # type: ignore[arg-type]
    assert roles == [
        ("worker-0", "both"),
        ("prefill-0", "prefill"),
        ("decode-0", "decode"),
        ("decode-1", "decode"),
    ]
    assert Mesh._role_args("both") == [] and Mesh._role_args("decode") == ["--role", "decode"]
    assert Mesh.worker_roles(SimpleNamespace(spec=MeshSpec(model_path=Path("/m")))) == [  # type: ignore[arg-type]
        ("worker-0", "both"),
        ("worker-1", "both"),
    ]
