"""kvmesh/lifetime.py: which environments start a watch of the launcher (the watch itself, on
real processes: tests/integration/test_startup.py and test_router_processes.py)."""

from __future__ import annotations

import os

from kvmesh.lifetime import PARENT_PID_ENV, stop_with_parent


def test_no_launcher_named_no_watch():
    assert stop_with_parent({}) is False
    assert stop_with_parent({PARENT_PID_ENV: ""}) is False
    assert stop_with_parent({PARENT_PID_ENV: "not-a-pid"}) is False
    assert stop_with_parent({PARENT_PID_ENV: str(os.getpid())}) is False  # itself
