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
    first_after_s: float, n: int = 3
) -> AsyncIterator[worker_pb2.WorkerGenerateResponse]:
    await asyncio.sleep(first_after_s)
    for i in range(n):
        yield msg(i)


async def prefill(after_s: float, result: worker_pb2.KvSource | None) -> worker_pb2.KvSource | None:
    await asyncio.sleep(after_s)
    return result


async def collect(
    overlap: Overlap,
    call: AsyncIterator[worker_pb2.WorkerGenerateResponse],
    first_token_timeout_s: float = 30.0,
) -> list[int]:
    return [m.token_ids[0] async for m in decode_stream(call, overlap, first_token_timeout_s)]


async def test_prefill_done_first_then_thedecode_streams() -> None:
    overlap = Overlap(asyncio.create_task(prefill(0.01, SOURCE)))
    assert await collect(overlap, decode_call(0.05)) == [0, 1, 2]


async def test_a_prefill_falling_back_first_withdraws_the_decode_call() -> None:
    overlap = Overlap(asyncio.create_task(prefill(0.01, None)))
    started = asyncio.get_running_loop().time()
    with pytest.raises(HandoffLost):
        await collect(overlap, decode_call(5.0))  # would wait out its hand-off
    assert asyncio.get_running_loop().time() - started < 1.0


async def test_the_first_token_makes_the_prefill_unneeded() -> None:
    task = asyncio.create_task(prefill(5.0, None))  # would fall back, but too late to matter
    overlap = Overlap(task)
    assert await collect(overlap, decode_call(0.01)) == [0, 1, 2]
    await asyncio.sleep(0)
    assert task.cancelled()


async def test_a_decode_error_propagates_while_the_prefill_runs() -> None:
    async def failing() -> AsyncIterator[worker_pb2.WorkerGenerateResponse]:
        await asyncio.sleep(0.01)
        raise RuntimeError("decode worker gone")
        yield msg(0)  # pragma: no cover

    task = asyncio.create_task(prefill(5.0, SOURCE))
    with pytest.raises(RuntimeError, match="decode worker gone"):
        await collect(Overlap(task), failing())
    assert not task.done()  # a retry on another decode worker still wants its blocks
    task.cancel()


async def test_without_an_overlapped_prefill_it_is_the_call() -> None:
    assert await collect(Overlap(), decode_call(0.0)) == [0, 1, 2]


@pytest.mark.parametrize("overlapped", [False, True])
async def test_a_worker_silent_past_the_first_token_timeout_is_given_up(overlapped: bool) -> None:
    task = asyncio.create_task(prefill(0.01, SOURCE)) if overlapped else None
    started = asyncio.get_running_loop().time()
    with pytest.raises(NoFirstToken):
        await collect(Overlap(task), decode_call(30.0), first_token_timeout_s=0.2)
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
