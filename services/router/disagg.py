"""The prefill half of a disaggregated request, over gRPC: the prefill worker computes the
prompt's KV (one token, which nobody sees) and its KV connector saves the blocks to its node's
kvmanager; the servicer then calls the decode worker with ``kv_source`` naming that kvmanager
(``handoff_source``). Any failure here is a fallback, never an error: the decode worker serves
the request aggregated (recomputing). The decision itself is ``core/disagg.py``.

The decode half's failures: before the first token another decode worker takes the request
(the servicer's retry); after it, ``core.lifecycle.decode_failed`` is what the client gets.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum

import grpc

from kvmesh.discovery.keys import WorkerId
from kvmesh.v1 import common_pb2, worker_pb2, worker_pb2_grpc

from .core.index_types import StoreId, store_parts
from .core.types import RouteRequest

log = logging.getLogger(__name__)


class Fallback(StrEnum):
    """Why a disaggregated request was served aggregated after all (a metric label)."""

    PREFILL_GONE = "prefill-gone"  # the prefill worker left between the pick and the call
    PREFILL_UNAVAILABLE = "prefill-unavailable"  # UNAVAILABLE (died, draining, unreachable)
    PREFILL_TIMEOUT = "prefill-timeout"  # the prefill call ran out of its deadline
    PREFILL_FAILED = "prefill-failed"  # any other error, or the prefill was aborted
    NO_KVMANAGER = "no-kvmanager"  # the prefill worker's node store vanished meanwhile


@dataclass(frozen=True, slots=True)
class PrefillResult:
    fallback: Fallback | None  # None: the prompt's KV was computed (and is being saved)
    seconds: float
    cached_tokens: int = 0  # prompt tokens the prefill worker served from its caches
    detail: str = ""


def one_token(sampling: common_pb2.SamplingParams) -> common_pb2.SamplingParams:
    """The request's sampling, stopped after the first token: the prefill's output is dropped
    (so are logprobs: the decode worker computes those it returns)."""
    out = common_pb2.SamplingParams()
    out.CopyFrom(sampling)
    out.max_tokens = 1
    out.ClearField("structured_output")  # the token is dropped: no grammar to compile for it
    out.ClearField("logprobs")
    out.ClearField("prompt_logprobs")
    return out


async def run_prefill(
    stub: worker_pb2_grpc.WorkerStub,
    route: RouteRequest,
    sampling: common_pb2.SamplingParams,
    timeout_s: float,
) -> PrefillResult:
    """Calls ``Worker.Generate`` with the prompt and one token; drains the stream. Never raises
    for a worker failure (cancellation propagates)."""
    started = time.monotonic()
    call = stub.Generate(
        worker_pb2.WorkerGenerateRequest(
            request_id=route.request_id,
            prompt_token_ids=route.prompt_token_ids,
            sampling=one_token(sampling),
        ),
        timeout=max(timeout_s, 0.001),
    )
    try:
        async for msg in call:
            if msg.HasField("finished"):
                f = msg.finished
                took = time.monotonic() - started
                if f.reason == common_pb2.FINISH_REASON_ABORT:
                    return PrefillResult(Fallback.PREFILL_FAILED, took, detail="aborted")
                return PrefillResult(None, took, f.usage.cached_prompt_tokens)
        return PrefillResult(
            Fallback.PREFILL_FAILED, time.monotonic() - started, detail="no final message"
        )
    except grpc.aio.AioRpcError as exc:
        took = time.monotonic() - started
        code = exc.code()
        if code is grpc.StatusCode.UNAVAILABLE:
            return PrefillResult(Fallback.PREFILL_UNAVAILABLE, took, detail=exc.details() or "")
        if code is grpc.StatusCode.DEADLINE_EXCEEDED:
            return PrefillResult(Fallback.PREFILL_TIMEOUT, took, detail=exc.details() or "")
        return PrefillResult(Fallback.PREFILL_FAILED, took, detail=f"{code.name}: {exc.details()}")
    finally:
        call.cancel()  # no-op when finished; aborts the engine request otherwise


def handoff_source(
    route: RouteRequest, prefill_worker: WorkerId, linked: Callable[[WorkerId], StoreId | None]
) -> worker_pb2.KvSource | None:
    """``kv_source`` for the decode call: the prefill worker's node kvmanager, which will hold
    every full block of the prompt. None when the worker has no node store (no hand-off)."""
    store = linked(prefill_worker)
    if store is None or not route.block_hashes:
        return None
    return worker_pb2.KvSource(kvmanager_id=store_parts(store)[0], blocks=len(route.block_hashes))
