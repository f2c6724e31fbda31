"""Profile a whole service process with cProfile, for finding where a benchmark's time goes.

Set ``KVMESH_PROFILE_DIR`` in a service's environment (``kvmesh bench serve|streams
--profile-dir DIR`` sets it for every child) and the process runs under ``cProfile``; at exit it
writes ``DIR/<service>-<pid>.pstats``. Read one with ``python -m kvmesh.profiling FILE``
(the top functions by own and by cumulative time) or any pstats viewer (snakeviz, gprof2dot).
cProfile costs the profiled process roughly 1.5-2x its CPU: compare shares inside a profile,
never a profiled run's latency with an unprofiled one's.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import gc
import json
import os
import pstats
import sys
import time
from collections.abc import Iterator
from pathlib import Path

ENV = "KVMESH_PROFILE_DIR"


@contextlib.contextmanager
def profiled(service: str) -> Iterator[None]:
    """Run the body under cProfile when ``KVMESH_PROFILE_DIR`` is set, else do nothing."""
    out_dir = os.environ.get(ENV, "")
    if not out_dir:
        yield
        return
    gc_clock = _GcClock()
    gc.callbacks.append(gc_clock)
    profile = cProfile.Profile()
    profile.enable()
    try:
        yield
    finally:
        profile.disable()
        gc.callbacks.remove(gc_clock)
        path = Path(out_dir) / f"{service}-{os.getpid()}.pstats"
        path.parent.mkdir(parents=True, exist_ok=True)
        profile.dump_stats(path)
        path.with_suffix(".gc.json").write_text(json.dumps(gc_clock.report()))


class _GcClock:
    """Wall time of the garbage collector's passes, per generation: cProfile charges a pass to
    whichever function's allocation set it off, so the profile alone cannot show it."""

    def __init__(self) -> None:
        self.seconds = [0.0, 0.0, 0.0]
        self.passes = [0, 0, 0]
        self._started = 0.0
        self.full: list[tuple[float, float]] = []  # (seconds since start, duration) of gen 2
        self._t0 = time.perf_counter()

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        else:
            took = time.perf_counter() - self._started
            self.seconds[info["generation"]] += took
            self.passes[info["generation"]] += 1
            if info["generation"] == 2:
                self.full.append((round(self._started - self._t0, 3), round(took, 4)))

    def report(self) -> dict[str, object]:
        return {"gc_seconds": self.seconds, "gc_passes": self.passes, "full": self.full}


def summary(path: Path, top: int = 25) -> str:
    """The ``top`` functions by own time and by cumulative time, as text."""
    import io

    out = io.StringIO()
    stats = pstats.Stats(str(path), stream=out)
    stats.strip_dirs()
    total = stats.total_tt  # type: ignore[attr-defined]
    out.write(f"{path.name}: {total:.2f} s profiled\n")
    gc_file = path.with_suffix(".gc.json")
    if gc_file.exists():
        g = json.loads(gc_file.read_text())
        out.write(
            f"garbage collector: {g['gc_seconds']} s in {g['gc_passes']} passes (gen 0/1/2)\n"
        )
    out.write("\n")
    for key in ("tottime", "cumulative"):
        out.write(f"## by {key}\n")
        stats.sort_stats(key).print_stats(top)
    return out.getvalue()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="summarise a kvmesh service profile (.pstats)")
    p.add_argument("files", nargs="+", type=Path)
    p.add_argument("--top", type=int, default=25)
    a = p.parse_args(argv)
    for f in a.files:
        sys.stdout.write(summary(f, a.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
