"""What this router has sent each worker and not yet seen finish: requests, prompt tokens, and
prompt tokens still to prefill (the uncached part, until the first token comes back).

The scheduler keeps one ledger and updates it from its feedback hooks; load scorers and the cost
model read it. Other routers' requests show up only in the workers' own load reports.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvmesh.discovery.keys import WorkerId


@dataclass(slots=True)
class _Entry:
    worker_id: WorkerId
    prompt_tokens: int
    prefill_tokens: int  # uncached tokens still to prefill; 0 after the first token
    priority: int = 0


@dataclass(slots=True)
class WorkerTally:
    requests: int = 0
    prompt_tokens: int = 0
    prefill_tokens: int = 0
    # prefill_tokens by the requests' priority (only bands with tokens to prefill)
    prefill_by_band: dict[int, int] = field(default_factory=dict)

    def prefill_tokens_from(self, priority: int) -> int:
        """Tokens still to prefill of requests of at least ``priority``: what a request of that
        band waits for on an engine that schedules by priority."""
        return sum(n for p, n in self.prefill_by_band.items() if p >= priority)

    def _add_prefill(self, priority: int, n: int) -> None:
        self.prefill_tokens += n
        left = self.prefill_by_band.get(priority, 0) + n
        if left:
            self.prefill_by_band[priority] = left
        else:
            self.prefill_by_band.pop(priority, None)


_ZERO = WorkerTally()


class InFlightLedger:
    def __init__(self) -> None:
        self._requests: dict[str, _Entry] = {}
        self._workers: dict[WorkerId, WorkerTally] = {}

    def routed(
        self,
        request_id: str,
        worker_id: WorkerId,
        prompt_tokens: int,
        uncached_tokens: int,
        priority: int = 0,
    ) -> None:
        self.finished(request_id, None)  # a retry replaces the earlier attempt
        prompt_tokens = max(prompt_tokens, 0)
        uncached = min(max(uncached_tokens, 0), prompt_tokens)
        self._requests[request_id] = _Entry(worker_id, prompt_tokens, uncached, priority)
        t = self._workers.get(worker_id)
        if t is None:
            t = self._workers[worker_id] = WorkerTally()
        t.requests += 1
        t.prompt_tokens += prompt_tokens
        t._add_prefill(priority, uncached)

    def first_token(self, request_id: str) -> None:
        e = self._requests.get(request_id)
        if e is None or not e.prefill_tokens:
            return
        self._workers[e.worker_id]._add_prefill(e.priority, -e.prefill_tokens)
        e.prefill_tokens = 0

    def finished(self, request_id: str, worker_id: WorkerId | None) -> None:
        """Forget a request; ``worker_id`` (when given) must match the recorded attempt."""
        e = self._requests.get(request_id)
        if e is None or (worker_id is not None and e.worker_id != worker_id):
            return
        del self._requests[request_id]
        t = self._workers[e.worker_id]
        t.requests -= 1
        t.prompt_tokens -= e.prompt_tokens
        t._add_prefill(e.priority, -e.prefill_tokens)
        if not t.requests:
            del self._workers[e.worker_id]

    def tally(self, worker_id: WorkerId) -> WorkerTally:
        """The worker's totals (a shared zero tally when nothing is in flight: do not mutate)."""
        return self._workers.get(worker_id, _ZERO)

    def __len__(self) -> int:
        return len(self._requests)
