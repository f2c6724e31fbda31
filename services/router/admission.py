"""Flow control's asyncio edge (``--admission``): the servicer's ``Admission``. The decisions
are ``core/admission.py``'s (bands, fairness, bounds, pre-emption) over ``core/saturation.py``'s
view of the workers; this module computes a request's cost (its uncached prompt tokens, from
the scheduler's prefix source), wakes the requests the core grants or refuses, looks at the
workers again every ``pump_interval_s`` while any request waits and whenever one ends, and
counts it all (``metrics.AdmissionMetrics``).

A refused request raises ``ResourceExhausted`` (429 / RESOURCE_EXHAUSTED) or ``Unavailable``
(no worker, draining: 503 / UNAVAILABLE), both with ``retry_after_s``; a deadline that passes
while queued, ``DeadlineExceeded``. Nothing waits past the queue TTL.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Sequence

from kvmesh import errors

from .core.admission import AdmissionConfig, FlowControl, FreeSlots, Reason, State, Ticket
from .core.auth import KeyTable
from .core.ratelimit import Limits, RateLimiter
from .core.routing import RoutingPolicy
from .core.saturation import SERVING_ROLES, Capacity, capacity
from .core.scheduler import Scheduler
from .core.scheduler.rates import PrefillRates
from .core.types import RouteRequest
from .core.workers import WorkerSet, WorkerView
from .metrics import AdmissionMetrics
from .shared_limits import SharedRateLimiter

log = logging.getLogger(__name__)
NO_LIMITS = Limits()
DEPTH_REFRESH_S = 0.5  # how often the queue depth gauges are set while requests wait


class AdmissionGate:
    def __init__(
        self,
        config: AdmissionConfig,
        workers: WorkerSet,
        policy: RoutingPolicy,
        metrics: AdmissionMetrics,
        keyed: bool = False,
        clock: Callable[[], float] = time.monotonic,
        cluster: str = "default",
    ) -> None:
        """``keyed``: tenants come from API keys (metric labels carry their names);
        ``cluster``: the prefix of the shared rate limits' keys (``config.redis_url``)."""
        self.config = config
        self.flow = FlowControl(config, clock)
        self._workers = workers
        self._scheduler = policy if isinstance(policy, Scheduler) else None
        self._rates = PrefillRates(config.prefill_s_per_token)
        self._limiter = RateLimiter(clock)
        self._shared = (
            SharedRateLimiter(config.redis_url, cluster, config.redis_timeout_s, self._limiter)
            if config.redis_url
            else None
        )
        self._charges: set[asyncio.Task[None]] = set()  # shared output-token charges in flight
        self._keys: Callable[[], KeyTable] | None = None
        self._limits_of: tuple[KeyTable | None, dict[str, Limits]] = (None, {})
        self._keyed = keyed
        self._metrics = metrics
        self._events: dict[Ticket, asyncio.Event] = {}
        self._pumper: asyncio.Task[None] | None = None

    def use_keys(self, keys: Callable[[], KeyTable]) -> None:
        """The key table in force: tenants' rate limits (and tenant names as metric labels)."""
        self._keys = keys
        self._keyed = True

    # ---- the request path ------------------------------------------------------------------
    def precheck(self, model: str, tenant: str, priority: int) -> None:
        """Refuses, before any work on the prompt, a request that would be refused anyway: no
        worker serves the model, or its band's queue is full."""
        cap, free = self.free_slots(model)
        if cap.workers == 0:
            self._count_rejected(model, priority, tenant, Reason.NO_WORKER)
            raise self._no_worker(model)
        rejection = self.flow.precheck(model, tenant, priority, free)
        if rejection is not None:
            self._count_rejected(model, priority, tenant, rejection.reason)
            raise errors.ResourceExhausted(rejection.message, rejection.retry_after_s)

    async def admit(self, route: RouteRequest, output_tokens: int, deadline_s: float) -> Ticket:
        """Returns when the request may be routed (its ticket: hand it to ``release``)."""
        model, tenant, band = route.model, route.tenant, route.priority
        cap, free = self.free_slots(model)
        if cap.workers == 0:
            self._count_rejected(model, band, tenant, Reason.NO_WORKER)
            raise self._no_worker(model)
        limits = self._limits(tenant)
        if self._shared is not None and limits.limited:
            wait_s = await self._shared.check(tenant, limits, route.prompt_tokens)
        else:
            wait_s = self._limiter.check(tenant, limits, route.prompt_tokens)
        if wait_s > 0.0:
            self._count_rejected(model, band, tenant, Reason.RATE_LIMIT)
            raise errors.ResourceExhausted(
                f"tenant {tenant!r} is over its rate limit ({_describe(limits)}); retry after "
                "the Retry-After",
                wait_s,
            )
        cached = 0
        if self._scheduler is not None:
            cached = self._scheduler.cached_tokens(route, self._workers.candidates(model))
        ticket, changed = self.flow.arrive(
            model,
            route.request_id,
            tenant,
            band,
            route.prompt_tokens - cached,
            output_tokens,
            free,
            deadline_s,
        )
        self._wake(changed)
        if ticket.state is State.REJECTED:
            await self._refund(tenant, limits, route.prompt_tokens)
            raise self._refused(ticket)
        if ticket.state is not State.RUNNING:
            await self._wait(ticket, limits, route.prompt_tokens)
        labels = self._labels(model, band, tenant)
        self._metrics.wait_seconds.labels(*labels).observe(ticket.wait_s)
        self._metrics.admitted.labels(*labels, "queued" if ticket.waited else "immediate").inc()
        return ticket

    async def _wait(self, ticket: Ticket, limits: Limits, prompt_tokens: int) -> None:
        event = self._events[ticket] = asyncio.Event()
        self._ensure_pumper()
        try:
            while True:
                await event.wait()
                event.clear()
                if ticket.state is State.REJECTED:
                    await self._refund(ticket.tenant, limits, prompt_tokens)
                    raise self._refused(ticket)
                if self.flow.started(ticket):
                    return
                # Put back in its queue for a higher band before its task ran: wait again.
        except BaseException:
            if ticket.state is not State.REJECTED:  # its client went away while it waited
                self.flow.leave(ticket)
                self._pump(ticket.model)
            raise
        finally:
            self._events.pop(ticket, None)

    def prefilled(self, ticket: Ticket) -> None:
        """The request's first token came: its prefill left the worker's backlog, so a waiting
        request may fit now."""
        if self.config.max_prefill_backlog_s > 0.0:
            self._pump(ticket.model)

    def release(
        self, ticket: Ticket, prompt_tokens: int, cached_tokens: int, output_tokens: int | None
    ) -> None:
        """The request is over (``output_tokens`` None: it ended without a final message)."""
        self.flow.leave(ticket, output_tokens)
        if output_tokens is not None:
            self._charge(ticket.tenant, self._limits(ticket.tenant), output_tokens)
            tokens = self._metrics.tenant_tokens
            tenant = self._tenant_label(ticket.tenant)
            tokens.labels(ticket.model, tenant, "prompt-uncached").inc(
                max(prompt_tokens - cached_tokens, 0)
            )
            tokens.labels(ticket.model, tenant, "prompt-cached").inc(max(cached_tokens, 0))
            tokens.labels(ticket.model, tenant, "output").inc(max(output_tokens, 0))
        self._pump(ticket.model)

    def drain(self) -> None:
        """The router is shutting down: every waiting request is refused (to another router)."""
        self._wake(
            self.flow.reject_all(
                None, Reason.DRAINING, "router is shutting down; retry on another router"
            )
        )

    async def close(self) -> None:
        self.drain()
        if self._pumper is not None:
            self._pumper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._pumper
        if self._charges:
            await asyncio.gather(*self._charges, return_exceptions=True)
        if self._shared is not None:
            await self._shared.close()

    # ---- rate limits -----------------------------------------------------------------------
    async def _refund(self, tenant: str, limits: Limits, prompt_tokens: int) -> None:
        if self._shared is not None and limits.limited:
            await self._shared.refund(tenant, limits, prompt_tokens)
        else:
            self._limiter.refund(tenant, limits, prompt_tokens)

    def _charge(self, tenant: str, limits: Limits, output_tokens: int) -> None:
        """A finished request's output tokens, off the request's path when shared."""
        if self._shared is None or limits.tokens_per_minute <= 0 or output_tokens <= 0:
            self._limiter.charge(tenant, limits, output_tokens)
            return
        task = asyncio.get_running_loop().create_task(
            self._shared.charge(tenant, limits, output_tokens)
        )
        self._charges.add(task)
        task.add_done_callback(self._charges.discard)

    # ---- the workers' state ----------------------------------------------------------------
    def capacity(self, model: str, share: float = 1.0, band: int | None = None) -> Capacity:
        """``band``: the workers that band may use (the profile's ``reserve`` filter) and, with
        ``engines_by_priority``, only the prefill backlog of that band and higher (engines that
        schedule by priority); None: every worker, all of the backlog."""
        views: Sequence[WorkerView] = self._workers.candidates(model)
        sched = self._scheduler
        if band is not None and sched is not None and sched.reserves_workers:
            views = sched.band_views(
                [v for v in views if v.serving and v.record.role in SERVING_ROLES], band
            )
        if self.config.max_prefill_backlog_s <= 0.0 or sched is None:
            return capacity(views, self.config, share=share)
        rates, ledger = self._rates, sched.ledger
        for v in views:
            rates.observe(v.record.worker_id, v.load)
        if band is None or not self.config.engines_by_priority:
            return capacity(
                views,
                self.config,
                lambda wid: ledger.tally(wid).prefill_tokens * rates.s_per_token(wid),
                share,
            )
        # An engine that schedules by priority serves this band before the lower ones in its
        # queue: its reported queue (all bands together) says nothing of this band's wait, the
        # ledger's backlog of this band and higher does. The lowest bands still look at it.
        return capacity(
            views,
            self.config,
            lambda wid: ledger.tally(wid).prefill_tokens_from(band) * rates.s_per_token(wid),
            share,
            queue_signal=band < self.config.reserve_priority,
        )

    def free_slots(self, model: str) -> tuple[Capacity, FreeSlots]:
        """The fleet's capacity, and its free slots per band (the reserve only for bands at or
        above ``reserve_priority``; with ``engines_by_priority``, each band's backlog counted
        from that band up; with a ``reserve`` filter in the profile, each band's workers)."""
        full = self.capacity(model)
        cfg = self.config
        by_band = cfg.engines_by_priority and cfg.max_prefill_backlog_s > 0.0
        reserving = self._scheduler is not None and self._scheduler.reserves_workers
        if (cfg.reserve <= 0.0 and not by_band and not reserving) or full.workers == 0:
            return full, full.free_slots
        at = cfg.reserve_priority
        if not by_band and not reserving:
            low = self.capacity(model, 1.0 - cfg.reserve).free_slots
            top = full.free_slots
            return full, lambda band: top if band >= at else low
        seen: dict[int, int] = {}

        def per_band(band: int) -> int:
            n = seen.get(band)
            if n is None:
                share = 1.0 if band >= at or cfg.reserve <= 0.0 else 1.0 - cfg.reserve
                n = seen[band] = self.capacity(model, share, band).free_slots
            return n

        return full, per_band

    def _pump(self, model: str) -> None:
        if not self.flow.queued(model):
            return
        cap, free = self.free_slots(model)
        if cap.workers == 0:
            self._wake(
                self.flow.reject_all(
                    model,
                    Reason.NO_WORKER,
                    f"no worker serves model {model!r} any more; retry after the Retry-After",
                )
            )
            return
        self._wake(self.flow.pump(model, free))

    def _ensure_pumper(self) -> None:
        if self._pumper is None or self._pumper.done():
            self._pumper = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        """While requests wait: expire them at their TTL, look at the workers again."""
        refreshed = 0.0
        try:
            while self.flow.queued():
                delay = self.config.pump_interval_s
                nxt = self.flow.next_expiry_s()
                if nxt is not None:
                    delay = min(delay, max(nxt - time.monotonic(), 0.0))
                await asyncio.sleep(delay)
                self._wake(self.flow.expire())
                for model in self.flow.models_waiting():
                    self._pump(model)
                now = time.monotonic()
                if now - refreshed >= DEPTH_REFRESH_S:
                    refreshed = now
                    self._refresh_depths()
        except Exception:  # never leave requests waiting on a dead pumper
            log.exception("flow control's pump failed; refusing the waiting requests")
            self._wake(self.flow.reject_all(None, Reason.DRAINING, "flow control failed"))
        finally:
            self._refresh_depths()

    def _refresh_depths(self) -> None:
        depths: dict[tuple[str, str, str], int] = {}
        for t in self.flow.waiting():
            labels = self._labels(t.model, t.band, t.tenant)
            depths[labels] = depths.get(labels, 0) + 1
        self._metrics.refresh_depths(depths)

    # ---- helpers ---------------------------------------------------------------------------
    def _wake(self, changed: list[Ticket]) -> None:
        for t in changed:
            if t.state is State.QUEUED:  # its grant was taken back for a higher band
                self._metrics.preempted.labels(*self._labels(t.model, t.band, t.tenant)).inc()
            event = self._events.get(t)
            if event is not None:
                event.set()

    def _refused(self, ticket: Ticket) -> errors.KvmeshError:
        r = ticket.rejection
        assert r is not None
        self._count_rejected(ticket.model, ticket.band, ticket.tenant, r.reason)
        log.info(
            "request %s refused by flow control (%s, retry after %s s): %s",
            ticket.request_id,
            r.reason.value,
            r.retry_after_s,
            r.message,
        )
        if r.reason is Reason.DEADLINE:
            return errors.DeadlineExceeded(r.message)
        if r.reason in (Reason.NO_WORKER, Reason.DRAINING):
            return errors.Unavailable(r.message, r.retry_after_s)
        return errors.ResourceExhausted(r.message, r.retry_after_s)

    def _no_worker(self, model: str) -> errors.Unavailable:
        return errors.Unavailable(
            f"no worker serves model {model!r} now; start one or retry after the Retry-After",
            self.config.unavailable_retry_after_s,
        )

    def _count_rejected(self, model: str, band: int, tenant: str, reason: Reason) -> None:
        self._metrics.rejected.labels(*self._labels(model, band, tenant), reason.value).inc()

    def _labels(self, model: str, band: int, tenant: str) -> tuple[str, str, str]:
        return model, str(band), self._tenant_label(tenant)

    def _tenant_label(self, tenant: str) -> str:
        return tenant if self._keyed and tenant else "-"

    def _limits(self, tenant: str) -> Limits:
        if self._keys is None:
            return NO_LIMITS
        table = self._keys()
        cached, by_name = self._limits_of
        if table is not cached:  # a reload: the new table's limits
            by_name = table.limits()
            self._limits_of = (table, by_name)
        return by_name.get(tenant, NO_LIMITS)


def _describe(limits: Limits) -> str:
    parts = []
    if limits.requests_per_minute:
        parts.append(f"{limits.requests_per_minute} requests per minute")
    if limits.tokens_per_minute:
        parts.append(f"{limits.tokens_per_minute} tokens per minute")
    return ", ".join(parts)
