"""Which cores the engines compute on, and which the mesh's own processes run on.

vLLM on CPU binds its compute threads itself when it starts its model in a worker process of its
own (``vllm serve``: one OpenMP thread per core of the engine's, one core left to the scheduler
and the API server). kvmesh's workers run the model in the engine-core process, where vLLM binds
nothing: torch then starts one busy OpenMP thread per core in every engine, and the engines, the
router, the kvmanager and the workers' gRPC front ends all compete for the same cores (an OpenMP
step stalls whenever one of its threads is preempted). ``plan_cpus`` gives each engine cores of
its own and keeps the rest for everything else; ``omp_environment`` is what binds an engine's
compute threads (set only while its process starts); ``pin_threads`` moves a process's other
threads off the engines' cores.

The planning is pure; ``pin_threads`` and ``available_cpus`` are the only calls into the OS.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class CpuPlan:
    """``engines[i]``: the cores engine i's compute threads are bound to; ``services``: the cores
    left for everything else (empty: nothing is reserved, services run anywhere)."""

    engines: tuple[tuple[int, ...], ...]
    services: tuple[int, ...]


def plan_cpus(cpus: Sequence[int], engines: int, reserved: int = 1) -> CpuPlan:
    """Splits ``cpus`` among ``engines`` engines, keeping the last ``reserved`` cores for the
    services when every engine can still have a core of its own; with fewer cores than that,
    each engine gets one core (round robin) and nothing is reserved. No engines: no plan."""
    cpus = sorted(set(cpus))
    if engines <= 0 or not cpus:
        return CpuPlan((), ())
    reserved = max(0, min(reserved, len(cpus) - engines))
    compute, services = cpus[: len(cpus) - reserved], cpus[len(cpus) - reserved :]
    if len(compute) < engines:  # fewer cores than engines: share, one core each
        return CpuPlan(tuple((cpus[i % len(cpus)],) for i in range(engines)), ())
    per, extra = divmod(len(compute), engines)
    out, start = [], 0
    for i in range(engines):
        n = per + (1 if i < extra else 0)
        out.append(tuple(compute[start : start + n]))
        start += n
    return CpuPlan(tuple(out), tuple(services))


def parse_cpu_list(text: str) -> tuple[int, ...]:
    """``"0-3,6"`` -> (0, 1, 2, 3, 6); empty -> (). Raises ValueError saying what is wrong."""
    out: list[int] = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        lo, sep, hi = part.partition("-")
        try:
            first, last = int(lo), int(hi) if sep else int(lo)
        except ValueError:
            raise ValueError(f"{part!r} is not a core number or range (like 0-3)") from None
        if first < 0 or last < first:
            raise ValueError(f"{part!r} is not a range of core numbers")
        out.extend(range(first, last + 1))
    return tuple(sorted(set(out)))


def format_cpu_list(cpus: Iterable[int]) -> str:
    """(0, 1, 2, 5) -> ``"0-2,5"`` (what ``parse_cpu_list`` reads)."""
    ordered = sorted(set(cpus))
    parts: list[str] = []
    i = 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
            j += 1
        parts.append(str(ordered[i]) if i == j else f"{ordered[i]}-{ordered[j]}")
        i = j + 1
    return ",".join(parts)


def omp_environment(cpus: Sequence[int]) -> dict[str, str]:
    """The OpenMP settings that bind an engine's compute threads one per core of ``cpus`` (as
    vLLM's own CPU worker launcher does with GNU OpenMP)."""
    return {
        "OMP_NUM_THREADS": str(len(cpus)),
        "OMP_PLACES": ",".join(f"{{{c}}}" for c in cpus),
        "OMP_PROC_BIND": "true",
    }


def engine_environment(compute_cpus: Sequence[int]) -> dict[str, str]:
    """The environment a vLLM engine core process starts with: the model in that process
    (vLLM's single-process executor, whatever the caller's environment says: the engine's
    die-with-parent guard expects it there), its OpenMP threads bound to ``compute_cpus`` (none:
    no binding). vLLM's multiprocessing layout (the model in a process of its own, as ``vllm
    serve`` runs it) was measured on this machine and dropped (docs/serving-cost.md)."""
    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    if compute_cpus:
        env.update(omp_environment(compute_cpus))
    return env


def available_cpus() -> tuple[int, ...]:
    """The cores this process may run on."""
    return tuple(sorted(os.sched_getaffinity(0)))


def pin_threads(cpus: Sequence[int], keep: Sequence[int] = ()) -> int:
    """Moves every thread of this process to ``cpus`` (threads started later inherit it from
    their creator), except the thread ids in ``keep``. Returns how many threads moved."""
    moved = 0
    for entry in os.listdir("/proc/self/task"):
        tid = int(entry)
        if tid in keep:
            continue
        try:
            os.sched_setaffinity(tid, cpus)
            moved += 1
        except (ProcessLookupError, PermissionError):  # ended meanwhile
            continue
    return moved
