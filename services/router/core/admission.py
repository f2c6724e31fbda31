"""Flow control in front of the scheduler: who goes first while the fleet is saturated. Pure: a
state machine over tickets with an injected clock; ``services/router/admission.py`` is its thin
asyncio adapter (it wakes the waiting requests) and ``saturation.py`` says how many more
requests the workers can take now.

Per model, one queue per **priority band** (``request.priority``; higher first, strictly: a
band is served only while every band above it is empty). Within a band, tenants share by
**virtual token counters** (after VTC, Sheng et al., "Fairness in Serving Large Language
Models", OSDI 2024): each tenant's counter grows by the *cost* of each request it is granted,
and the backlogged tenant with the smallest counter goes next; within a tenant, first come
first served. The cost is what the request puts on the fleet::

    cost = uncached prompt tokens (the KV index's best match, known before placement)
           + decode_token_weight * expected output tokens (max_tokens; corrected at the end)

so a tenant resending a 195K-token context that is cached pays for its new suffix only, and a
tenant flooding cold prompts pays for every token. A tenant that becomes backlogged is lifted to
the smallest counter of those waiting (or the level of the last grant), so idle time earns no
credit. Requests are charged when granted, fast path included, so shares hold from the first
queued request on.

Nothing waits while the fleet has room (``free_slots`` > 0) and no request of the same or a
higher band waits: the fast path. Otherwise a request waits in its band's bounded queue, at
most ``queue_ttl_s`` (or its deadline); a full queue's room is shared by tenants too (an
arrival of a tenant holding fewer places takes the newest place of the largest holder). Refusals carry a ``retry_after_s`` from the queue's
measured drain rate: (requests ahead + 1) / completions per second. A higher band's request
may pre-empt a lower band's that has not started: one granted but not yet running goes back to
its queue (at its place); when every queue together is full, the newest waiting request of the
lowest band is refused (``PREEMPTED``, with a retry-after) to make room.
"""

from __future__ import annotations

import heapq
import math
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from enum import StrEnum

from kvmesh.errors import InvalidArgument
from kvmesh.settings import setting


@dataclass(frozen=True, slots=True)
class AdmissionConfig:
    enabled: bool = setting(
        False,
        "flow control in front of the scheduler: priority bands, per-tenant fairness by "
        "uncached tokens, bounded queues while the workers are saturated (docs/tenants.md); "
        "off: every request is routed at once, as before",
        flag="--admission",
    )
    max_waiting: int = setting(
        2,
        "a worker is saturated when this many requests wait in its engine's queue (its report, "
        "or what this router sent beyond its max running requests); 0: not a signal",
    )
    max_kv_usage: float = setting(
        0.95, "a worker is saturated at this KV cache usage, fraction; 1: not a signal"
    )
    max_prefill_backlog_s: float = setting(
        0.0,
        "a worker is saturated when the prompt tokens this router sent it that are not yet "
        "prefilled would take this long at its measured prefill rate (the wait before a new "
        "request's prefill starts), seconds; 0: not a signal",
    )
    engines_by_priority: bool = setting(
        False,
        "the workers schedule by priority (kvmesh worker --scheduling-policy priority): a "
        "request's prefill waits only for the prefills of its band and higher there, so the "
        "prefill-backlog limit counts only those (a lower band's long prefill does not hold a "
        "higher band's request in the router)",
    )
    prefill_s_per_token: float = setting(
        5e-5, "prefill time per token until the workers have reported their own, seconds"
    )
    queue_max_requests: int = setting(
        256, "requests waiting per priority band; more: RESOURCE_EXHAUSTED / 429, Retry-After"
    )
    queue_max_total: int = setting(
        1024,
        "requests waiting over every band of a model; a higher band's request past it pre-empts "
        "the newest waiting request of the lowest band (refused with Retry-After)",
    )
    queue_ttl_s: float = setting(
        30.0, "longest wait in a queue, seconds; then RESOURCE_EXHAUSTED / 429 with Retry-After"
    )
    reject_predicted_wait: bool = setting(
        True,
        "refuse at once (429, Retry-After) a request whose predicted wait (requests ahead / "
        "measured drain rate) is past queue-ttl-s, instead of holding it until then",
    )
    decode_token_weight: float = setting(
        1.0, "fairness cost of one expected output token, in uncached prompt tokens"
    )
    drain_window_s: float = setting(
        10.0, "the drain rate (completions per second) behind Retry-After is measured over this"
    )
    retry_after_min_s: float = setting(1.0, "smallest Retry-After sent, seconds")
    retry_after_max_s: float = setting(60.0, "largest Retry-After sent, seconds")
    unavailable_retry_after_s: float = setting(
        2.0, "Retry-After of UNAVAILABLE / 503 (no worker serves the model), seconds"
    )
    reserve: float = setting(
        0.0,
        "fraction of every saturation limit (waiting, KV usage, prefill backlog) only requests "
        "of at least --admission-reserve-priority may use: the others find the workers "
        "saturated at (1 - reserve) x each limit, so a higher band is let through at once; "
        "0: none",
    )
    reserve_priority: int = setting(
        1, "requests of at least this priority may use the --admission-reserve"
    )
    redis_url: str = setting(
        "",
        "Redis shared by every router of the cluster, redis://[:password@]host:port/db, "
        "rediss:// or unix:// (a password: set it in the environment, not a flag): per-tenant "
        "rate limits hold over all routers together; empty: each router over its own requests "
        "(docs/tenants.md)",
    )
    redis_timeout_s: float = setting(
        0.5, "deadline of one shared rate-limit call, seconds (then the router's own buckets)"
    )
    pump_interval_s: float = setting(
        0.02,
        "while requests wait, how often the workers' state is looked at again (beside every "
        "request that ends), seconds",
    )

    def __post_init__(self) -> None:
        ints = {
            "max-waiting": (self.max_waiting, 0),
            "queue-max-requests": (self.queue_max_requests, 0),
            "queue-max-total": (self.queue_max_total, 0),
        }
        for name, (value, least) in ints.items():
            if value < least:
                raise InvalidArgument(f"--admission-{name} is {value}; use {least} or more")
        if not 0.0 < self.max_kv_usage <= 1.0:
            raise InvalidArgument(
                f"--admission-max-kv-usage is {self.max_kv_usage}; use a fraction in (0, 1]"
            )
        positive = {
            "queue-ttl-s": self.queue_ttl_s,
            "drain-window-s": self.drain_window_s,
            "pump-interval-s": self.pump_interval_s,
            "prefill-s-per-token": self.prefill_s_per_token,
            "redis-timeout-s": self.redis_timeout_s,
        }
        for name, v in positive.items():
            if not v > 0.0:
                raise InvalidArgument(f"--admission-{name} is {v}; use a number > 0")
        at_least_zero = {
            "max-prefill-backlog-s": self.max_prefill_backlog_s,
            "decode-token-weight": self.decode_token_weight,
            "retry-after-min-s": self.retry_after_min_s,
            "unavailable-retry-after-s": self.unavailable_retry_after_s,
        }
        for name, v in at_least_zero.items():
            if not v >= 0.0:
                raise InvalidArgument(f"--admission-{name} is {v}; use a number >= 0")
        if not 0.0 <= self.reserve < 1.0:
            raise InvalidArgument(
                f"--admission-reserve is {self.reserve}; use a fraction in [0, 1)"
            )
        if self.redis_url and not self.redis_url.startswith(("redis://", "rediss://", "unix://")):
            raise InvalidArgument(
                "--admission-redis-url does not start with redis://, rediss:// or unix://"
            )
        if not self.retry_after_max_s >= self.retry_after_min_s:
            raise InvalidArgument(
                f"--admission-retry-after-max-s is {self.retry_after_max_s}; use at least "
                f"--admission-retry-after-min-s ({self.retry_after_min_s})"
            )


class State(StrEnum):
    QUEUED = "queued"  # waiting in its band's queue
    GRANTED = "granted"  # may go; its request has not started yet (may be pre-empted)
    RUNNING = "running"  # started: routed to a worker
    REJECTED = "rejected"  # refused (``Ticket.rejection`` says why)
    DONE = "done"  # left: finished, or its client went away


class Reason(StrEnum):
    """Why a request was refused (a closed set: metric labels)."""

    QUEUE_FULL = "queue-full"
    QUEUE_TTL = "queue-ttl"
    PREDICTED_WAIT = "predicted-wait"
    PREEMPTED = "preempted"
    RATE_LIMIT = "rate-limit"
    NO_WORKER = "no-worker"
    DEADLINE = "deadline"
    DRAINING = "draining"


@dataclass(frozen=True, slots=True)
class Rejection:
    reason: Reason
    message: str  # says what happened and what to do
    retry_after_s: float | None = None  # None: do not retry as is (a deadline passed)


@dataclass(eq=False, slots=True)
class Ticket:
    """One request's place in flow control, from arrival until it leaves."""

    request_id: str
    model: str
    tenant: str
    band: int  # the request's priority
    prefill_cost: float  # uncached prompt tokens
    decode_cost: float  # expected output tokens x decode_token_weight
    arrived_s: float
    expires_s: float  # refused past this while queued (TTL or deadline)
    deadline_s: float
    seq: int  # arrival order (FCFS within a tenant; ties between tenants)
    state: State = State.QUEUED
    waited: bool = False  # it was queued (not the fast path)
    granted_s: float = 0.0
    preemptions: int = 0  # times its grant was taken back for a higher band
    rejection: Rejection | None = None

    @property
    def cost(self) -> float:
        return self.prefill_cost + self.decode_cost

    @property
    def wait_s(self) -> float:
        """Time from arrival to the grant (0 on the fast path)."""
        return self.granted_s - self.arrived_s if self.granted_s else 0.0


class DrainRate:
    """Completions per second over the last ``window_s`` (0: too few to say)."""

    MIN_SAMPLES = 4

    def __init__(self, window_s: float) -> None:
        self._window = window_s
        self._times: deque[float] = deque()

    def record(self, now: float) -> None:
        self._times.append(now)
        self._trim(now)

    def rate(self, now: float) -> float:
        self._trim(now)
        n = len(self._times)
        if n < self.MIN_SAMPLES:
            return 0.0
        return (n - 1) / max(now - self._times[0], 1e-3)

    def _trim(self, now: float) -> None:
        times, oldest = self._times, now - self._window
        while times and times[0] < oldest:
            times.popleft()


MAX_IDLE_TENANTS = 4096  # counters kept per band for tenants that wait for and run nothing
# How many more requests the fleet can take now: one number, or one per band (a band at or
# above ``reserve_priority`` may use the reserve the others may not).
FreeSlots = int | Callable[[int], int]


def _free(free_slots: FreeSlots, band: int) -> int:
    return free_slots if isinstance(free_slots, int) else free_slots(band)


@dataclass(slots=True)
class _Band:
    priority: int
    queues: dict[str, deque[Ticket]] = field(default_factory=dict)  # backlogged tenants, FIFO
    counters: dict[str, float] = field(default_factory=dict)  # virtual token counters
    active: dict[str, int] = field(default_factory=dict)  # granted + running per tenant
    ref: float = 0.0  # counter level of the last grant
    queued: int = 0

    def level(self) -> float:
        """Where a tenant becoming backlogged starts: the least counter of those waiting, or
        the level of the last grant when nobody waits."""
        if self.queues:
            return min(self.counters[t] for t in self.queues)
        return self.ref

    def next_tenant(self) -> str:
        """The backlogged tenant with the least counter (ties: the earliest head)."""
        return min(self.queues, key=lambda t: (self.counters[t], self.queues[t][0].seq))

    def idle(self) -> bool:
        return not self.queues and not self.active and not self.counters

    def forget_if_idle(self, tenant: str, slack: float = 0.0) -> None:
        """Drops a tenant's counter once it waits for nothing and runs nothing, unless it is
        more than ``slack`` (the cost of its last request: the unfairness VTC allows anyway)
        above the level: it was served more than the others lately, which must stay. Past
        ``MAX_IDLE_TENANTS`` the idle ones least ahead go first, so memory stays bounded."""
        if tenant in self.queues or self.active.get(tenant, 0) > 0:
            return
        c = self.counters.get(tenant)
        if c is not None and c <= self.level() + slack:
            del self.counters[tenant]
        if len(self.counters) > MAX_IDLE_TENANTS + len(self.queues) + len(self.active):
            idle = [t for t in self.counters if t not in self.queues and t not in self.active]
            for t in sorted(idle, key=self.counters.__getitem__)[: len(idle) - MAX_IDLE_TENANTS]:
                del self.counters[t]


@dataclass(slots=True)
class _Flow:
    """One model's bands, grants not yet started, and drain rate (kept while the router runs:
    one per served model)."""

    drain: DrainRate
    bands: dict[int, _Band] = field(default_factory=dict)
    granted: list[Ticket] = field(default_factory=list)  # GRANTED, not yet RUNNING
    queued: int = 0

    def band(self, priority: int) -> _Band:
        b = self.bands.get(priority)
        if b is None:
            b = self.bands[priority] = _Band(priority)
        return b

    def queued_at_or_above(self, priority: int) -> int:
        return sum(b.queued for p, b in self.bands.items() if p >= priority)

    def top_queued(self) -> _Band | None:
        """The highest band with a waiting request."""
        best: _Band | None = None
        for b in self.bands.values():
            if b.queued and (best is None or b.priority > best.priority):
                best = b
        return best


class FlowControl:
    """Every model's queues (module doc). Each call that changes other tickets' states returns
    those tickets (granted, rejected, or put back in their queue) for the adapter to wake."""

    def __init__(
        self, config: AdmissionConfig, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.config = config
        self._clock = clock
        self._flows: dict[str, _Flow] = {}
        self._expiry: list[tuple[float, int, Ticket]] = []  # heap; stale entries skipped
        self._seq = 0

    # ---- arrivals --------------------------------------------------------------------------
    def precheck(
        self, model: str, tenant: str, priority: int, free_slots: FreeSlots
    ) -> Rejection | None:
        """The refusal a request of this band would get now for a full queue or a predicted
        wait past the TTL, before its prompt is tokenized and hashed (cheap: neither needs its
        cost; under a burst most refusals are decided here, so the prompts of requests that
        are refused anyway take no CPU from the others); None: it may come in."""
        flow = self._flows.get(model)
        if flow is None:
            return None
        if _free(free_slots, priority) - len(flow.granted) > 0 and not flow.queued_at_or_above(
            priority
        ):
            return None
        band = flow.bands.get(priority)
        if band is not None and band.queued >= self.config.queue_max_requests:
            if self._hog(band, tenant) is None:
                return self._full(flow, priority)
            return None
        return self._predicted_wait(flow, band, tenant, priority, self.config.queue_ttl_s)

    def _predicted_wait(
        self, flow: _Flow, band: _Band | None, tenant: str, priority: int, left_s: float
    ) -> Rejection | None:
        """The refusal of a request whose predicted wait is past ``left_s`` (its TTL or
        deadline); None: it may wait."""
        cfg = self.config
        if not cfg.reject_predicted_wait:
            return None
        rate = flow.drain.rate(self._clock())
        if rate <= 0.0:
            return None
        if band is None:
            ahead = flow.queued_at_or_above(priority + 1) + len(flow.granted)
        else:
            ahead = self._ahead_of(flow, band, tenant)
        if (ahead + 1) / rate <= left_s:
            return None
        return Rejection(
            Reason.PREDICTED_WAIT,
            f"the fleet is saturated and {ahead} request(s) wait ahead of this one at "
            f"{rate:.1f}/s: it would not start within its queue TTL "
            f"({cfg.queue_ttl_s:g} s); retry after the Retry-After",
            self._clamp((ahead + 1) / rate),
        )

    @staticmethod
    def _hog(band: _Band, tenant: str) -> str | None:
        """The tenant whose newest waiting request ``tenant``'s arrival may take the place of
        in a full band: the largest holder, when it holds more than ``tenant`` would."""
        hog = max(band.queues, key=lambda n: (len(band.queues[n]), n))
        mine = len(band.queues.get(tenant, ()))
        return hog if len(band.queues[hog]) > mine + 1 else None

    def arrive(
        self,
        model: str,
        request_id: str,
        tenant: str,
        priority: int,
        uncached_tokens: int,
        expected_output_tokens: int,
        free_slots: FreeSlots,
        deadline_s: float = math.inf,
    ) -> tuple[Ticket, list[Ticket]]:
        """A request that may be scheduled: its ticket RUNNING (go now), QUEUED (wait for a
        wake) or REJECTED; and the other tickets this changed."""
        cfg = self.config
        now = self._clock()
        flow = self._flows.get(model)
        if flow is None:
            flow = self._flows[model] = _Flow(DrainRate(cfg.drain_window_s))
        self._seq += 1
        t = Ticket(
            request_id,
            model,
            tenant,
            priority,
            float(max(uncached_tokens, 0)),
            max(expected_output_tokens, 0) * cfg.decode_token_weight,
            now,
            min(now + cfg.queue_ttl_s, deadline_s),
            deadline_s,
            self._seq,
        )
        band = flow.band(priority)
        if tenant not in band.queues:  # becoming backlogged: no credit for idle time
            band.counters[tenant] = max(band.counters.get(tenant, -math.inf), band.level())
        if _free(free_slots, priority) - len(flow.granted) > 0 and not flow.queued_at_or_above(
            priority
        ):
            self._grant(flow, band, t, now)
            t.state = State.RUNNING  # nothing else runs before it starts: no pre-emption window
            return t, []
        changed: list[Ticket] = []
        if band.queued >= cfg.queue_max_requests:
            # The queue's room is shared fairly too: a tenant holding fewer of its places than
            # the largest holder takes that one's newest (longest queue drop); else refused.
            hog = self._hog(band, tenant)
            if hog is None:
                return self._refuse(flow, band, t, self._full(flow, priority)), changed
            displaced = band.queues[hog][-1]
            self._dequeue(flow, displaced)
            self._reject(
                displaced,
                Reason.QUEUE_FULL,
                f"the queue of priority {priority} is full ({cfg.queue_max_requests} waiting) "
                f"and tenant {hog!r} held the most of it: its newest request made room for "
                "another tenant's; retry after the Retry-After",
                self._retry_after(flow, priority, now),
            )
            changed.append(displaced)
        if flow.queued >= cfg.queue_max_total:
            victim = self._newest_below(flow, priority)
            if victim is None:
                return self._refuse(flow, band, t, self._full(flow, priority)), changed
            self._dequeue(flow, victim)
            self._reject(
                victim,
                Reason.PREEMPTED,
                f"pre-empted while queued by a request of priority {priority} (the queues are "
                f"full: {cfg.queue_max_total} waiting); retry later or with a higher priority",
                self._retry_after(flow, victim.band, now),
            )
            changed.append(victim)
        rejection = self._predicted_wait(flow, band, tenant, priority, t.expires_s - now)
        if rejection is not None:
            return self._refuse(flow, band, t, rejection), changed
        self._enqueue(flow, band, t)
        t.waited = True
        changed += self.pump(model, free_slots)
        return t, [c for c in changed if c is not t]

    # ---- grants ----------------------------------------------------------------------------
    def pump(self, model: str, free_slots: FreeSlots) -> list[Ticket]:
        """Grants waiting requests while the fleet has ``free_slots`` (for the band) beyond the
        grants not yet started, best band first; when full, a waiting band above a granted, not
        yet started request takes its place (that one goes back to its queue)."""
        flow = self._flows.get(model)
        if flow is None or not flow.queued:
            return []
        now = self._clock()
        changed: list[Ticket] = []
        while flow.queued:
            top = flow.top_queued()
            assert top is not None
            if _free(free_slots, top.priority) - len(flow.granted) <= 0:
                victim = self._lowest_granted(flow)
                if victim is None or victim.band >= top.priority:
                    break
                self._revoke(flow, victim)
                changed.append(victim)
                continue
            tenant = top.next_tenant()
            t = top.queues[tenant][0]
            self._dequeue(flow, t)
            self._grant(flow, top, t, now)
            flow.granted.append(t)
            changed.append(t)
        # A ticket revoked and granted again in one pump is reported once, as it is now.
        out: list[Ticket] = []
        for c in changed:
            if all(c is not o for o in out):
                out.append(c)
        return out

    def started(self, ticket: Ticket) -> bool:
        """A granted request's task resumed: it runs now (True). False: it was put back in its
        queue meanwhile (wait again); a rejected one stays rejected (False)."""
        if ticket.state is not State.GRANTED:
            return ticket.state is State.RUNNING
        flow = self._flows[ticket.model]
        flow.granted.remove(ticket)
        ticket.state = State.RUNNING
        return True

    def leave(self, ticket: Ticket, output_tokens: int | None = None) -> None:
        """The request is over (``output_tokens``: what it generated; None when it never ran
        or its count is unknown), or its client went away while it waited."""
        flow = self._flows.get(ticket.model)
        state = ticket.state
        ticket.state = State.DONE
        if flow is None or state in (State.DONE, State.REJECTED):
            return
        band = flow.bands.get(ticket.band)
        if state is State.QUEUED:
            self._dequeue(flow, ticket)
        else:
            if state is State.GRANTED:  # it never ran: its charge back
                flow.granted.remove(ticket)
                if band is not None and ticket.tenant in band.counters:
                    band.counters[ticket.tenant] -= ticket.cost
            if band is not None:
                n = band.active.get(ticket.tenant, 0) - 1
                if n > 0:
                    band.active[ticket.tenant] = n
                else:
                    band.active.pop(ticket.tenant, None)
            if state is State.RUNNING:
                flow.drain.record(self._clock())
                if band is not None and output_tokens is not None:
                    c = band.counters.get(ticket.tenant)
                    if c is not None:  # charge what it really generated
                        actual = output_tokens * self.config.decode_token_weight
                        band.counters[ticket.tenant] = c + actual - ticket.decode_cost
        if band is not None:
            band.forget_if_idle(ticket.tenant, ticket.cost)
            if band.idle():
                del flow.bands[ticket.band]

    # ---- time ------------------------------------------------------------------------------
    def expire(self) -> list[Ticket]:
        """Refuses the waiting requests past their TTL or deadline."""
        now = self._clock()
        out: list[Ticket] = []
        heap = self._expiry
        while heap and heap[0][0] <= now:
            _, _, t = heapq.heappop(heap)
            if t.state is not State.QUEUED or t.expires_s > now:
                continue
            flow = self._flows[t.model]
            self._dequeue(flow, t)
            if t.deadline_s <= t.expires_s:
                self._reject(
                    t, Reason.DEADLINE, "the request's deadline passed while it was queued"
                )
            else:
                self._reject(
                    t,
                    Reason.QUEUE_TTL,
                    f"queued {self.config.queue_ttl_s:g} s (the queue TTL) while the fleet "
                    "was saturated; retry after the Retry-After",
                    self._retry_after(flow, t.band, now),
                )
            self._cleanup(flow, t)
            out.append(t)
        return out

    def next_expiry_s(self) -> float | None:
        heap = self._expiry
        while heap and heap[0][2].state is not State.QUEUED:
            heapq.heappop(heap)
        return heap[0][0] if heap else None

    def reject_all(self, model: str | None, reason: Reason, message: str) -> list[Ticket]:
        """Refuses every waiting request (of ``model``; None: all): no worker left, draining."""
        out: list[Ticket] = []
        for name, flow in list(self._flows.items()):
            if model is not None and name != model:
                continue
            retry = self.config.unavailable_retry_after_s
            for t in [t for b in flow.bands.values() for q in b.queues.values() for t in q]:
                self._dequeue(flow, t)
                self._reject(t, reason, message, retry)
                self._cleanup(flow, t)
                out.append(t)
        return out

    # ---- what it holds ---------------------------------------------------------------------
    def waiting(self) -> Iterator[Ticket]:
        for flow in self._flows.values():
            for b in flow.bands.values():
                for q in b.queues.values():
                    yield from q

    def queued(self, model: str | None = None) -> int:
        if model is not None:
            flow = self._flows.get(model)
            return flow.queued if flow is not None else 0
        return sum(f.queued for f in self._flows.values())

    def models_waiting(self) -> list[str]:
        return [m for m, f in self._flows.items() if f.queued]

    def counter(self, model: str, priority: int, tenant: str) -> float | None:
        """A tenant's virtual token counter in a band (None: none kept)."""
        flow = self._flows.get(model)
        band = flow.bands.get(priority) if flow is not None else None
        return band.counters.get(tenant) if band is not None else None

    def drain_rate(self, model: str) -> float:
        flow = self._flows.get(model)
        return flow.drain.rate(self._clock()) if flow is not None else 0.0

    def retry_after_s(self, model: str, priority: int) -> float:
        """What a request of this band refused now would be told to wait."""
        flow = self._flows.get(model)
        if flow is None:
            return self._clamp(0.0)
        return self._retry_after(flow, priority, self._clock())

    # ---- internals -------------------------------------------------------------------------
    def _grant(self, flow: _Flow, band: _Band, t: Ticket, now: float) -> None:
        c = band.counters.get(t.tenant)
        if c is None:
            c = band.counters[t.tenant] = band.level()
        band.ref = c
        band.counters[t.tenant] = c + t.cost
        band.active[t.tenant] = band.active.get(t.tenant, 0) + 1
        t.state = State.GRANTED
        t.granted_s = now

    def _revoke(self, flow: _Flow, t: Ticket) -> None:
        """A granted, not yet started request back to the head of its tenant's queue, its
        charge refunded."""
        flow.granted.remove(t)
        band = flow.band(t.band)
        n = band.active.get(t.tenant, 0) - 1
        if n > 0:
            band.active[t.tenant] = n
        else:
            band.active.pop(t.tenant, None)
        if t.tenant in band.counters:
            band.counters[t.tenant] -= t.cost
        else:
            band.counters[t.tenant] = band.level()
        q = band.queues.get(t.tenant)
        if q is None:
            q = band.queues[t.tenant] = deque()
        q.appendleft(t)
        band.queued += 1
        flow.queued += 1
        t.state = State.QUEUED
        t.granted_s = 0.0
        t.preemptions += 1
        heapq.heappush(self._expiry, (t.expires_s, t.seq, t))

    def _enqueue(self, flow: _Flow, band: _Band, t: Ticket) -> None:
        q = band.queues.get(t.tenant)
        if q is None:
            q = band.queues[t.tenant] = deque()
        q.append(t)
        band.queued += 1
        flow.queued += 1
        t.state = State.QUEUED
        heapq.heappush(self._expiry, (t.expires_s, t.seq, t))

    def _dequeue(self, flow: _Flow, t: Ticket) -> None:
        band = flow.bands[t.band]
        q = band.queues[t.tenant]
        if q[0] is t:
            q.popleft()
        else:
            q.remove(t)
        if not q:
            del band.queues[t.tenant]
        band.queued -= 1
        flow.queued -= 1

    def _reject(
        self, t: Ticket, reason: Reason, message: str, retry_after_s: float | None = None
    ) -> None:
        t.state = State.REJECTED
        t.rejection = Rejection(reason, message, retry_after_s)

    def _refuse(self, flow: _Flow, band: _Band, t: Ticket, rejection: Rejection) -> Ticket:
        t.state = State.REJECTED
        t.rejection = rejection
        band.forget_if_idle(t.tenant)
        if band.idle():
            del flow.bands[band.priority]
        return t

    def _cleanup(self, flow: _Flow, t: Ticket) -> None:
        band = flow.bands.get(t.band)
        if band is not None:
            band.forget_if_idle(t.tenant)
            if band.idle():
                del flow.bands[t.band]

    def _full(self, flow: _Flow, priority: int) -> Rejection:
        n = self.config.queue_max_requests
        return Rejection(
            Reason.QUEUE_FULL,
            f"the fleet is saturated and the queue of priority {priority} is full ({n} "
            "waiting); retry after the Retry-After",
            self._retry_after(flow, priority, self._clock()),
        )

    def _newest_below(self, flow: _Flow, priority: int) -> Ticket | None:
        """The newest waiting request of the lowest band below ``priority``."""
        lower = [b for b in flow.bands.values() if b.queued and b.priority < priority]
        if not lower:
            return None
        band = min(lower, key=lambda b: b.priority)
        return max((q[-1] for q in band.queues.values()), key=lambda t: t.seq)

    def _lowest_granted(self, flow: _Flow) -> Ticket | None:
        """The granted, not yet started request to take back first: lowest band, newest."""
        if not flow.granted:
            return None
        return min(flow.granted, key=lambda t: (t.band, -t.seq))

    def _ahead_of(self, flow: _Flow, band: _Band, tenant: str) -> int:
        """Requests that would start before a new one of ``tenant`` in ``band``: the higher
        bands' waiting ones, the grants not yet started, its tenant's own queue, and of every
        other tenant of the band those the fair order grants first (while that tenant's counter,
        growing by each one's cost, is not past the level this tenant's counter reaches when
        the new request is at its head). Not the whole band: a tenant with a long queue must
        not get a light tenant refused for its backlog."""
        mine = band.queues.get(tenant, ())
        start = band.counters.get(tenant, band.level())
        if not mine:  # becoming backlogged: lifted to the level (arrive)
            start = max(start, band.level())
        level = start + sum(t.cost for t in mine)
        others = 0
        for other, queue in band.queues.items():
            if other == tenant:
                continue
            c = band.counters[other]
            for t in queue:
                if c > level:
                    break
                others += 1
                c += t.cost
        return flow.queued_at_or_above(band.priority + 1) + len(flow.granted) + len(mine) + others

    def _retry_after(self, flow: _Flow, priority: int, now: float) -> float:
        rate = flow.drain.rate(now)
        if rate <= 0.0:  # nothing finished lately: the queue's TTL is the best guess
            return self._clamp(self.config.queue_ttl_s)
        ahead = flow.queued_at_or_above(priority) + len(flow.granted)
        return self._clamp((ahead + 1) / rate)

    def _clamp(self, seconds: float) -> float:
        cfg = self.config
        return min(max(seconds, cfg.retry_after_min_s), cfg.retry_after_max_s)
