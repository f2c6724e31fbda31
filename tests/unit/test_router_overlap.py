"""The overlapped prefill/decode hand-off's stream logic (``services/router/decode.py``) against a
fake decode call and prefill task, and the router flag that turns the overlap off."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from kvmesh.v1 import worker_pb2
from services.router.core.placement import Placement
from services.router.decode import HandoffLost, NoFirstToken, Overlap, decode_stream
from services.router.main import parse_args

SOURCE = worker_pb2.KvSource(kvmanager_id="kvm-a", blocks=4)


def msg(token: int) -> worker_pb2.WorkerGenerateResponse:
    return worker_pb2.WorkerGenerateResponse(request_id="r", token_ids=[token])


async def decode_call(
    gate: asyncio.Event | None = None, n: int = 3
) -> AsyncIterator[worker_pb2.WorkerGenerateResponse]:
    """The decode worker's stream: its first message once ``gate`` opens (None: at once)."""
    if gate is not None:
        await gate.wait()
    for i in range(n):
        yield msg(i)


async def prefill(
    gate: asyncio.Event, result: worker_pb2.KvSource | None
) -> worker_pb2.KvSource | None:
    """The overlapped prefill: ends with ``result`` (None: fell back) once ``gate`` opens."""
    await gate.wait()
    return result


def opened() -> asyncio.Event:
    gate = asyncio.Event()
    gate.set()
    return gate


async def collect(
    overlap: Overlap,
    call: AsyncIterator[worker_pb2.WorkerGenerateResponse],
    first_token_timeout_s: float = 30.0,
) -> list[int]:
    return [m.token_ids[0] async for m in decode_stream(call, overlap, first_token_timeout_s)]


async def test_prefill_done_first_then_thedecode_streams() -> None:
    task = asyncio.create_task(prefill(opened(), SOURCE))
    decoded = asyncio.Event()  # the decode worker answers once the prefill handed off
    task.add_done_callback(lambda _: decoded.set())
    assert await collect(Overlap(task), decode_call(decoded)) == [0, 1, 2]
    assert task.result() == SOURCE


async def test_a_prefill_falling_back_first_withdraws_the_decode_call() -> None:
    overlap = Overlap(asyncio.create_task(prefill(opened(), None)))
    with pytest.raises(HandoffLost):
        await collect(overlap, decode_call(asyncio.Event()))  # would wait out its hand-off


async def test_the_first_token_makes_the_prefill_unneeded() -> None:
    task = asyncio.create_task(prefill(asyncio.Event(), None))  # would fall back, too late
    overlap = Overlap(task)
    assert await collect(overlap, decode_call()) == [0, 1, 2]
    await asyncio.sleep(0)
    assert task.cancelled()


async def test_a_decode_error_propagates_while_the_prefill_runs() -> None:
    async def failing() -> AsyncIterator[worker_pb2.WorkerGenerateResponse]:
        await asyncio.sleep(0)
        raise RuntimeError("decode worker gone")
        yield msg(0)  # pragma: no cover

    task = asyncio.create_task(prefill(asyncio.Event(), SOURCE))  # still running
    with pytest.raises(RuntimeError, match="decode worker gone"):
        await collect(Overlap(task), failing())
    assert not task.done()  # a retry on another decode worker still wants its blocks
    task.cancel()


async def test_without_an_overlapped_prefill_it_is_the_call() -> None:
    assert await collect(Overlap(), decode_call()) == [0, 1, 2]


@pytest.mark.parametrize("overlapped", [False, True])
async def test_a_worker_silent_past_the_first_token_timeout_is_given_up(overlapped: bool) -> None:
    task = asyncio.create_task(prefill(opened(), SOURCE)) if overlapped else None  # handed off
    started = asyncio.get_running_loop().time()
    with pytest.raises(NoFirstToken):
        await collect(Overlap(task), decode_call(asyncio.Event()), first_token_timeout_s=0.2)
    assert 0.15 < asyncio.get_running_loop().time() - started < 2.0


async def test_tokens_after_the_first_are_not_timed() -> None:
    async def slow() -> AsyncIterator[worker_pb2.WorkerGenerateResponse]:
        yield msg(0)
        await asyncio.sleep(0.3)
        yield msg(1)

    assert await collect(Overlap(), slow(), first_token_timeout_s=0.1) == [0, 1]


def test_overlap_is_on_by_default_and_can_be_turned_off() -> None:
    assert parse_args([]).disagg.overlap
    assert not parse_args(["--no-disagg-overlap"]).disagg.overlap


def test_placement_is_independent_by_default_and_joint_on_request() -> None:
    assert parse_args([]).disagg.placement.mode is Placement.INDEPENDENT
    joint = parse_args(["--disagg-placement", "joint", "--disagg-network-gbps", "25"])
    assert joint.disagg.placement.mode is Placement.JOINT
    assert joint.disagg.placement.network_gbps == 25.0
