"""The free ports a worker with data-parallel ranks gives vLLM's KV event publishers."""

from __future__ import annotations

import socket
from pathlib import Path

from services.worker import dp


def test_the_run_is_drawn_below_the_ephemeral_range(tmp_path: Path) -> None:
    ranges = tmp_path / "ip_local_port_range"
    ranges.write_text("32768\t60999\n")
    assert dp._unraced_range(4, str(ranges)) == (10000, 32768)
    ranges.write_text("10010 60999\n")  # no room below: above it
    assert dp._unraced_range(4, str(ranges)) == (61000, 65536)
    assert dp._unraced_range(4, str(tmp_path / "missing")) == (10000, 32768)
    ranges.write_text("1024 65535\n")  # nothing outside it: any port past the well-known ones
    assert dp._unraced_range(4, str(ranges)) == (10000, 65536)


def test_a_run_is_free_on_every_address_and_outside_the_ephemeral_range() -> None:
    low, high = dp._unraced_range(4)
    base = dp.free_port_run(4)
    assert low <= base and base + 4 <= high
    for port in range(base, base + 4):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("", port))  # what vLLM's publishers do (tcp://*:PORT)


def test_a_port_held_on_another_loopback_address_is_not_free() -> None:
    """vLLM binds every address, so a socket on any one of them takes the port (checking only
    127.0.0.1 missed these)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as held:
        held.bind(("127.0.0.2", 0))
        port = held.getsockname()[1]
        assert not dp._free(port)
    assert dp._free(port)
