"""A service's start-up heap is frozen out of the garbage collector's reach once it has
started in a process of its own (kvmesh.service.freeze_heap; never inside another process, a
test run's), and a whole process can run under cProfile with
``KVMESH_PROFILE_DIR`` (kvmesh.profiling), writing a profile and its collector's times."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
from pathlib import Path

from kvmesh.profiling import ENV, summary
from kvmesh.service import Bind, ServiceHost

REPO = Path(__file__).resolve().parents[2]


def test_a_service_run_as_its_process_has_its_start_up_heap_frozen() -> None:
    code = (
        "import gc\n"
        "from kvmesh.service import Bind, ServiceHost, run\n"
        "async def serve():\n"
        "    host = ServiceHost(('t.T',), Bind('127.0.0.1', 0), drain_grace_s=0.1)\n"
        "    async with host.starting():\n"
        "        await host.start_server()\n"
        "        print('before', gc.get_freeze_count())\n"
        "    print('after', gc.get_freeze_count())\n"
        "    await host.stop()\n"
        "raise SystemExit(run(serve(), 'probe'))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run(
        [sys.executable, "-c", code],
        check=True,
        env=env,
        timeout=60,
        capture_output=True,
        text=True,
    ).stdout.split()
    assert out[0:2] == ["before", "0"]  # not before the start has succeeded
    assert out[2] == "after" and int(out[3]) > 0


async def test_a_service_started_inside_another_process_freezes_nothing() -> None:
    """A test run starts and stops many services in one process: frozen objects that later
    become cyclic garbage would never be collected."""
    gc.unfreeze()
    host = ServiceHost(("t.T",), Bind("127.0.0.1", 0), drain_grace_s=0.1)
    try:
        async with host.starting():
            await host.start_server()
        assert gc.get_freeze_count() == 0
    finally:
        await host.stop()


def test_a_process_run_with_the_profile_dir_writes_its_profile(tmp_path: Path) -> None:
    code = (
        "import gc, sys\n"
        "from kvmesh.profiling import profiled\n"
        "def busy():\n"
        "    for _ in range(3): gc.collect()\n"
        "    return sum(i * i for i in range(200_000))\n"
        "with profiled('probe'):\n"
        "    busy()\n"
    )
    env = {**os.environ, ENV: str(tmp_path), "PYTHONPATH": str(REPO)}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=60)
    (profile,) = tmp_path.glob("probe-*.pstats")
    collector = json.loads(profile.with_suffix(".gc.json").read_text())
    assert collector["gc_passes"][2] >= 3  # the three full collections, timed
    assert len(collector["full"]) == collector["gc_passes"][2]
    text = summary(profile, top=5)
    assert "busy" in text
    assert "garbage collector:" in text


def test_without_the_profile_dir_nothing_is_written(tmp_path: Path) -> None:
    code = "from kvmesh.profiling import profiled\nwith profiled('probe'):\n    pass\n"
    env = {k: v for k, v in os.environ.items() if k != ENV} | {"PYTHONPATH": str(REPO)}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, cwd=tmp_path, timeout=60)
    assert not list(tmp_path.rglob("*.pstats"))
