"""Fixtures shared by every test layer."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny random-weight test model, built once per test session (seconds)."""
    from kvmesh.models.tiny import ensure_tiny

    return ensure_tiny(tmp_path_factory.mktemp("models"))
