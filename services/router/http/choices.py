"""Several choices (``n``) and several prompts (a completions ``prompt`` list) in one OpenAI
request. Pure: no sockets, no event loop (``fanout`` runs the plan).

Each choice is a router request of its own (``plan``): the router routes, queues, accounts and
aborts it like any other, and each prompt of a batch is routed on its own, so different prompts
may be served by different workers. A prompt's ``n`` requests share its text, so the ones after
the first (``fanout`` starts them once it has computed the prompt) find its KV cached: in the
prefix cache of the worker that computed it, or loaded from the node's kvmanager. Choice ``index`` is
``prompt * n + sample``, as in OpenAI's and vLLM's answers; with a ``seed``, sample ``j`` is
sampled with ``seed + j`` (vLLM's rule for its own ``n``), so the choices differ and are
reproducible.

``Choices`` merges the requests' streams: one ``ResponseTranslator`` per choice, its chunks
carrying its index and ending with its own ``finish_reason``; the usage counts each prompt once
(its first request's prompt and cached tokens, as OpenAI counts a prompt once whatever ``n``)
and adds up the completion tokens of every choice.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvmesh.v1 import common_pb2, router_pb2

from .parsing import Kind, ParsedRequest
from .rendering import ResponseTranslator, kvmesh_json, new_call_id, usage_json

_INT64 = 2**64
_CHUNK_OBJECT = {Kind.CHAT: "chat.completion.chunk", Kind.COMPLETION: "text_completion"}


@dataclass(frozen=True, slots=True)
class SubRequest:
    """One choice's router request."""

    index: int  # the choice's index in the answer: prompt * n + sample
    prompt: int  # which prompt of the batch (0 for one prompt)
    sample: int  # which of the prompt's n choices
    generate: router_pb2.GenerateRequest


def count(parsed: ParsedRequest) -> int:
    """How many choices (router requests) ``parsed`` asks for."""
    return max(len(parsed.batch), 1) * parsed.n


def _seed_plus(seed: int, j: int) -> int:
    """``seed + j``, wrapped into int64 (the proto's type) as two's complement."""
    return (seed + j + 2**63) % _INT64 - 2**63


def plan(parsed: ParsedRequest) -> tuple[SubRequest, ...]:
    """The router requests of ``parsed``, by index. One choice: the request itself (its id is
    the response's). Several: ids ``<response id>-<index>``, so ``Router.Abort`` can name each."""
    if count(parsed) == 1:
        return (SubRequest(0, 0, 0, parsed.generate),)
    prompts = parsed.batch or (parsed.generate,)
    out = []
    for i, prompt in enumerate(prompts):
        for j in range(parsed.n):
            index = i * parsed.n + j
            g = router_pb2.GenerateRequest()
            g.CopyFrom(prompt)
            g.request_id = f"{parsed.id}-{index}"
            if j and g.sampling.HasField("seed"):
                g.sampling.seed = _seed_plus(g.sampling.seed, j)
            out.append(SubRequest(index, i, j, g))
    return tuple(out)


def merge_usage(
    subs: tuple[SubRequest, ...], usages: dict[int, common_pb2.Usage]
) -> common_pb2.Usage:
    """The usage of the whole answer: each prompt's prompt and cached tokens once (from its
    first choice's request, the one that computed the prompt), every choice's completion
    tokens; the workers that served, in choice order, comma-separated; the earliest time to first
    token."""
    total = common_pb2.Usage()
    workers: list[str] = []
    ttfts = []
    for sub in subs:
        u = usages[sub.index]
        total.completion_tokens += u.completion_tokens
        if u.worker_id and u.worker_id not in workers:
            workers.append(u.worker_id)
        if sub.sample:
            continue
        total.prompt_tokens += u.prompt_tokens
        total.cached_prompt_tokens += u.cached_prompt_tokens
        total.cached_gpu_tokens += u.cached_gpu_tokens
        total.cached_cpu_tokens += u.cached_cpu_tokens
        total.cached_disk_tokens += u.cached_disk_tokens
        total.cached_peer_tokens += u.cached_peer_tokens
        ttfts.append(u.time_to_first_token_s)
    total.worker_id = ",".join(workers)
    total.time_to_first_token_s = min(ttfts, default=0.0)
    return total


class Choices:
    """Feeds on ``(index, GenerateResponse)`` pairs from the requests of ``plan``, in any
    interleaving; ``feed`` returns the SSE payloads (chunks carry their choice's index; each
    choice's finish chunk has its own ``kvmesh`` object, naming its request), ``response()``
    the non-streaming body once every choice has finished. The same interface as
    ``ResponseTranslator``, so the server streams and collects both alike."""

    def __init__(
        self,
        request: ParsedRequest,
        subs: tuple[SubRequest, ...],
        created: int,
        call_id: Callable[[], str] = new_call_id,
    ) -> None:
        self.request = request
        self.created = created
        self._subs = subs
        self._out = {
            s.index: ResponseTranslator(request, created, call_id, index=s.index, usage_tail=False)
            for s in subs
        }
        self._ids = {s.index: s.generate.request_id for s in subs}
        self._usages: dict[int, common_pb2.Usage] = {}
        self.usage: common_pb2.Usage | None = None  # the merged usage, once all finished

    @property
    def finished(self) -> bool:
        return self.usage is not None

    def feed(self, item: tuple[int, router_pb2.GenerateResponse]) -> list[dict[str, Any]]:
        index, msg = item
        out = self._out[index]
        payloads = out.feed(msg)
        if out.usage is None:
            return payloads
        self._usages[index] = out.usage
        for p in payloads:
            if "kvmesh" in p:  # the finish chunk: which request (and worker) served the choice
                p["kvmesh"]["request_id"] = self._ids[index]
        if len(self._usages) < len(self._subs):
            return payloads
        self.usage = merge_usage(self._subs, self._usages)
        if self.request.include_usage:
            payloads.append(
                {
                    "id": self.request.id,
                    "object": _CHUNK_OBJECT[self.request.kind],
                    "created": self.created,
                    "model": self.request.model,
                    "choices": [],
                    "usage": usage_json(self.usage),
                }
            )
        return payloads

    def response(self) -> dict[str, Any]:
        if self.usage is None:
            raise RuntimeError("the streams have not finished")
        choices = [self._out[s.index].response()["choices"][0] for s in self._subs]
        per_choice = [
            {"index": s.index, **kvmesh_json(self._ids[s.index], self._usages[s.index])}
            for s in self._subs
        ]
        return {
            "id": self.request.id,
            "object": self.request.kind.value,
            "created": self.created,
            "model": self.request.model,
            "choices": choices,
            "usage": usage_json(self.usage),
            "kvmesh": {**kvmesh_json(self.request.id, self.usage), "choices": per_choice},
        }
