"""Fixtures shared by every test layer."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import settings

# Property tests explore the same examples on every run, so CI is deterministic; run with
# HYPOTHESIS_PROFILE=explore (a random seed each run) to look for new counterexamples.
settings.register_profile("ci", derandomize=True, deadline=None)
settings.register_profile("explore", deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny random-weight test model, built once per test session (seconds)."""
    from kvmesh.models.tiny import ensure_tiny

    return ensure_tiny(tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="session")
def pki(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    """A private CA and a node certificate (server and client use, for localhost, 127.0.0.1
    and ::1) made by the test session itself (``kvmesh/tlsgen.py``)."""
    from kvmesh.tlsgen import make_pki

    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="session")
def other_pki(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    """Another CA with its own node certificate: what the mesh's CA must refuse."""
    from kvmesh.tlsgen import make_pki

    return make_pki(tmp_path_factory.mktemp("other-pki"), ca_name="another CA")
