"""Runs the router requests of ``choices.plan`` and merges their streams (asyncio).

A prompt's first request starts at once (every prompt of a batch in parallel); its other ``n - 1``
start when it has sent its first message: the prompt has then been computed and its KV sits in
that worker's prefix cache (and, a save later, its node kvmanager, when there is one), so the
router, routing them like any request whose prefix is cached, sends them there or to a worker
that loads the prefix, waiting for that save when it has not landed yet (``core/peers.py``,
``core/recent_prefills.py``): the prompt is computed once. The first message is yielded only once every prompt's
first request has sent one, so a request the router refuses (a prompt too long, a value out
of range) fails the whole answer before any byte of it is sent. Any error ends the whole
answer: it is raised at once, and closing the fan-out (``aclose``, or cancelling the consumer:
a client that went away) cancels every request still running, which aborts them in the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence

from kvmesh import errors
from kvmesh.v1 import router_pb2

from .backend import RouterBackend
from .choices import SubRequest

Item = tuple[int, router_pb2.GenerateResponse]
_END = object()


class FanOut:
    """An async iterator of ``(choice index, GenerateResponse)`` over ``subs`` on ``backend``,
    all within ``timeout_s`` from construction. Create it on the loop that will use it."""

    def __init__(
        self, backend: RouterBackend, subs: Sequence[SubRequest], timeout_s: float
    ) -> None:
        loop = asyncio.get_running_loop()
        self._loop = loop
        self._backend = backend
        self._deadline = loop.time() + timeout_s
        self._subs = list(subs)
        self._queue: asyncio.Queue[tuple[int, object]] = asyncio.Queue()
        self._tasks: list[asyncio.Task[None]] = []
        self._ended = 0
        self._failure: BaseException | None = None
        self._unstarted = {s.prompt for s in subs}  # prompts whose first request sent nothing yet
        self._ready = asyncio.Event()  # every prompt started, or something failed
        for sub in self._subs:
            if sub.sample == 0:
                self._start(sub)

    def _start(self, sub: SubRequest) -> None:
        self._tasks.append(asyncio.create_task(self._run(sub), name=sub.generate.request_id))

    def _started(self, prompt: int) -> None:
        for sub in self._subs:
            if sub.prompt == prompt and sub.sample > 0:
                self._start(sub)
        self._unstarted.discard(prompt)
        if not self._unstarted:
            self._ready.set()

    async def _run(self, sub: SubRequest) -> None:
        try:
            sent = False
            timeout_s = max(self._deadline - self._loop.time(), 0.001)
            async with contextlib.aclosing(self._backend.generate(sub.generate, timeout_s)) as s:
                async for msg in s:
                    self._queue.put_nowait((sub.index, msg))
                    if not sent and sub.sample == 0:
                        self._started(sub.prompt)
                    sent = True
            if not sent:
                raise errors.Unavailable("the router ended the stream without an answer")
            self._queue.put_nowait((sub.index, _END))
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            if self._failure is None:
                self._failure = exc
            self._ready.set()
            self._queue.put_nowait((sub.index, _END))

    def __aiter__(self) -> FanOut:
        return self

    async def __anext__(self) -> Item:
        await self._ready.wait()
        while True:
            if self._failure is not None:
                raise self._failure
            if self._ended == len(self._subs):
                raise StopAsyncIteration
            index, item = await self._queue.get()
            if item is _END:
                self._ended += 1
                continue
            assert isinstance(item, router_pb2.GenerateResponse)
            return index, item

    async def aclose(self) -> None:
        """Cancels the requests still running (their engine requests are aborted)."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
