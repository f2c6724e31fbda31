"""kvmesh/cpus.py: how engines and services share the machine's cores."""

from __future__ import annotations

import os
import threading

import pytest

from kvmesh.cpus import (
    CpuPlan,
    engine_environment,
    format_cpu_list,
    omp_environment,
    parse_cpu_list,
    pin_threads,
    plan_cpus,
)


@pytest.mark.parametrize(
    ("cpus", "engines", "want"),
    [
        # vllm serve's own split on 2 cores: the engine on one, the rest on the other
        ((0, 1), 1, CpuPlan(((0,),), (1,))),
        # 2 engines on 2 cores: a core each, nothing left to reserve
        ((0, 1), 2, CpuPlan(((0,), (1,)), ())),
        # more engines than cores: shared round robin
        ((0, 1), 3, CpuPlan(((0,), (1,), (0,)), ())),
        # 16 cores, 2 engines: 15 split 8 + 7, one core for the services
        (tuple(range(16)), 2, CpuPlan((tuple(range(8)), tuple(range(8, 15))), (15,))),
        # an affinity mask with holes (a container's cpuset)
        ((2, 3, 5, 9), 1, CpuPlan(((2, 3, 5),), (9,))),
        ((0, 1, 2, 3), 0, CpuPlan((), ())),
        ((), 2, CpuPlan((), ())),
        ((4,), 1, CpuPlan(((4,),), ())),
    ],
    ids=["vllm-split", "two-on-two", "shared", "16-cores", "holes", "no-engines", "no-cpus", "one"],
)
def test_plan(cpus, engines, want):
    plan = plan_cpus(cpus, engines)
    assert plan == want
    if plan.services:  # an engine never shares a core with the services when some are kept
        assert not set(plan.services) & {c for e in plan.engines for c in e}


@pytest.mark.parametrize(
    ("text", "cpus"),
    [("0-3,6", (0, 1, 2, 3, 6)), ("7", (7,)), ("", ()), ("3,1,1", (1, 3)), (" 0 - 1", (0, 1))],
)
def test_cpu_lists_round_trip(text, cpus):
    assert parse_cpu_list(text) == cpus
    assert parse_cpu_list(format_cpu_list(cpus)) == cpus


@pytest.mark.parametrize("bad", ["a", "3-1", "-2", "1-x"])
def test_bad_cpu_lists_say_what_is_wrong(bad):
    with pytest.raises(ValueError, match="core"):
        parse_cpu_list(bad)


def test_format():
    assert format_cpu_list([5, 0, 1, 2]) == "0-2,5"


def test_omp_environment_binds_one_thread_per_core():
    assert omp_environment((0, 2)) == {
        "OMP_NUM_THREADS": "2",
        "OMP_PLACES": "{0},{2}",
        "OMP_PROC_BIND": "true",
    }


def test_pin_threads_moves_every_thread_but_the_kept_ones():
    mine = sorted(os.sched_getaffinity(0))
    if len(mine) < 2:
        pytest.skip("needs 2 cores")
    started, stop = threading.Event(), threading.Event()
    tids: list[int] = []

    def run() -> None:
        tids.append(threading.get_native_id())
        started.set()
        stop.wait(10)

    t = threading.Thread(target=run)
    t.start()
    started.wait(5)
    main = threading.get_native_id()
    try:
        moved = pin_threads([mine[-1]], keep=[main])
        assert moved >= 1
        assert os.sched_getaffinity(tids[0]) == {mine[-1]}
        assert os.sched_getaffinity(main) == set(mine)
    finally:
        stop.set()
        t.join()
        pin_threads(mine)


def test_engine_environment_keeps_the_model_in_the_engine_core():
    assert engine_environment((0, 1)) == {
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "OMP_NUM_THREADS": "2",
        "OMP_PLACES": "{0},{1}",
        "OMP_PROC_BIND": "true",
    }
    assert engine_environment(()) == {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
