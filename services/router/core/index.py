"""The router's KV block index: which workers hold which blocks, on which tiers.

Pure and synchronous: the KV event adapter feeds it the workers' ``KvEventBatch`` values, the
scheduler asks it how much of a prompt's block chain each worker holds. Call it from one thread
(the router's event loop): a 6,100-block ``match`` costs about a millisecond.

Representation. Every worker gets a small integer *slot* s; a block's holders are one Python int
with four bits per slot: bit 4s says "s holds it on some tier", bits 4s+1, 4s+2, 4s+3 say "on gpu",
"on cpu", "on disk". One ``dict[hash, int]`` maps each block hash to that int, so a lookup answers
for every worker and tier at once and narrowing the set of workers still matching is one ``&``.
A block on two tiers of one worker simply has two tier bits set.

A worker whose blocks must all go (it left, restarted, or resyncs with a snapshot) gets a fresh
slot at once and its old slot is *retired*: match() never looks at it again, and a sweep clears
its bits in bounded steps (one per ``apply``) before the slot is reused. So dropping a worker is
O(1) however big the index is.

Node stores. A kvmanager's blocks of one KV layout are a *store* (``StoreId``), fed by its own
numbered tier event stream (``apply_store``) and held like a worker, in a slot of its own.
``link`` names the store backing a worker's lower tiers (its node's kvmanager, for its layout):
``match`` counts the store's blocks as the worker's own by projecting each holder int it looks up,
copying a linked store's bits onto the bits of the candidates it backs (once per distinct int).
A block on the worker's gpu still beats the store's cpu. Stores are never matched themselves.
``match`` is one pass over the prompt: the lookups at C speed a chunk at a time, grouped into
runs of one holder int, and the prefix ends and the per-tier counts found per run (``_scan``).

Memory is bounded by ``IndexConfig.max_blocks`` distinct hashes: past it the least recently stored
blocks go (a dict keeps insertion order and a block moves to the end whenever a worker stores it).
A dropped block only costs affinity: the index never claims a block a worker does not hold because
of it. Identical holder ints are shared (interned), so most blocks cost a dict slot and their key.
More, with measurements: docs/kv-index.md.
"""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from heapq import heappop, heappush
from itertools import compress, groupby, islice, repeat
from operator import and_
from types import MappingProxyType

from kvmesh.discovery.keys import WorkerId
from kvmesh.kv.events import (
    AllBlocksCleared,
    BlockHash,
    BlockRemoved,
    BlockStored,
    KvEvent,
    KvEventBatch,
    Tier,
)

from .index_types import (
    ApplyResult,
    HolderId,
    IndexConfig,
    IndexStats,
    PrefixMatch,
    StoreId,
    StoreMatch,
    ViewState,
    WorkerKvView,
    store_id,
    store_parts,
)

__all__ = [
    "ApplyResult",
    "HolderId",
    "IndexConfig",
    "IndexStats",
    "KvIndex",
    "PrefixMatch",
    "StoreId",
    "StoreMatch",
    "ViewState",
    "WorkerKvView",
    "store_id",
    "store_parts",
]

_GPU, _CPU, _DISK = 0, 1, 2
# match() looks blocks up a chunk at a time: a short first chunk keeps a miss cheap.
_SCAN_FIRST_CHUNK = 64
_SCAN_CHUNK = 1024
_KEY_BYTES = (sys.getsizeof(1 << 63) + 7) & ~7  # one 64-bit hash as a Python int, allocated


def _tier_index(tier: Tier) -> int:
    # Identity tests: an Enum's __hash__ is Python code, too slow for a per-event dict lookup.
    if tier is Tier.GPU:
        return _GPU
    if tier is Tier.CPU:
        return _CPU
    return _DISK


def _bits(mask: int) -> Iterable[int]:
    """Positions of the set bits of ``mask``, lowest first (position p: slot p >> 2, bit p & 3)."""
    while mask:
        low = mask & -mask
        yield low.bit_length() - 1
        mask ^= low


def _or(masks: Iterable[int]) -> int:
    out = 0
    for m in masks:
        out |= m
    return out


def _tier_counts(cpu: dict[int, int], disk: dict[int, int]) -> dict[int, tuple[int, int]]:
    return {pos: (cpu.get(pos, 0), disk.get(pos, 0)) for pos in cpu.keys() | disk.keys()}


def _project_tiers(v: int, spread: Mapping[int, int], stores: int) -> int:
    """``v`` with each store's four bits copied onto every worker it backs. ``workers * nibble``
    puts the nibble at each worker's slot at once: slots are 4 bits apart, so nothing carries."""
    out = v & ~(stores * 15)
    for pos in _bits(v & stores):
        out |= spread[1 << pos] * ((v >> pos) & 15)
    return out


@dataclass(slots=True, eq=False)
class _Worker:
    """A holder: a worker, or a node store (``store``)."""

    worker_id: WorkerId  # a store's id is a StoreId (typed as a WorkerId here: no call per match)
    epoch: str
    seq: int
    state: ViewState
    synced: bool  # the blocks are exactly the worker's as of ``seq`` (False after NEW_EPOCH)
    store: bool = False  # a node store: never matched itself, only through ``link``
    slot: int = -1
    any_bit: int = 0  # 1 << 4*slot
    tier_bits: tuple[int, int, int] = (0, 0, 0)  # per tier: 1 << 4*slot + 1 + tier
    stored_bits: tuple[int, int, int] = (0, 0, 0)  # per tier: any_bit | tier bit (shared ints)
    counts: list[int] = field(default_factory=lambda: [0, 0, 0])  # blocks held per tier


class KvIndex:
    """Block hash -> holders per tier, fed by KV event batches (see the module docstring)."""

    def __init__(self, config: IndexConfig | None = None) -> None:
        self._cfg = config or IndexConfig()
        self._evict_batch = max(1, int(self._cfg.max_blocks * self._cfg.evict_fraction))
        self._d: dict[int, int] = {}
        self._workers: dict[HolderId, _Worker] = {}  # workers and stores
        self._links: dict[WorkerId, StoreId] = {}  # worker -> the store of its lower tiers
        self._owner: dict[int, _Worker] = {}  # live slot -> worker
        self._free: list[int] = []  # heap of clean slots (no bits anywhere)
        self._next_slot = 0
        self._live_any = 0  # any-bits of live slots
        self._live4 = 0  # all four bits of live slots
        self._store_any = 0  # any-bits of live store slots (a subset of _live_any)
        self._dirty = 0  # any-bits of retired slots waiting for the next sweep pass
        self._sweeping = 0  # any-bits of retired slots the current pass clears
        self._sweep_keys: list[int] = []
        self._sweep_pos = 0
        self._intern: dict[int, int] = {}
        self._totals = [0, 0, 0]
        self._evicted = 0

    # ---- events ---------------------------------------------------------------------------
    def apply(self, batch: KvEventBatch) -> ApplyResult:
        """Applies one worker's batch if it is the next one (see ``ApplyResult``)."""
        return self._apply(WorkerId(batch.worker_id), batch, False)

    def apply_store(self, store: StoreId, batch: KvEventBatch) -> ApplyResult:
        """Applies one batch of a node store's tier event stream (``batch.worker_id``, the
        kvmanager's id, is ignored: one kvmanager has one stream per layout). Same ordering
        rules as ``apply``."""
        return self._apply(store, batch, True)

    def _apply(self, hid: HolderId, batch: KvEventBatch, store: bool) -> ApplyResult:
        if self._dirty or self._sweep_keys:  # first, so a pass this batch needs starts later
            self.sweep(self._cfg.sweep_keys_per_apply)
        if len(self._intern) > self._cfg.intern_values:
            self._intern.clear()
        w = self._workers.get(hid)
        if batch.snapshot:
            if w is not None and w.synced and w.epoch == batch.epoch and batch.seq < w.seq:
                return ApplyResult.STALE
            w = self._fresh(hid, w, batch, store)
            self._apply_events(w, batch.events)
            w.state, w.synced = ViewState.EXACT, True
            return ApplyResult.SNAPSHOT_APPLIED
        if w is None or w.epoch != batch.epoch:
            w = self._fresh(hid, w, batch, store)
            self._apply_events(w, batch.events)
            w.state, w.synced = ViewState.DEGRADED, False
            return ApplyResult.NEW_EPOCH
        if batch.seq <= w.seq:
            return ApplyResult.STALE
        if batch.seq != w.seq + 1:
            w.state = ViewState.DEGRADED
            return ApplyResult.GAP
        self._apply_events(w, batch.events)
        w.seq = batch.seq
        if w.synced:
            w.state = ViewState.EXACT
        return ApplyResult.APPLIED

    def drop_worker(self, worker_id: WorkerId) -> bool:
        """Forgets a worker (it left etcd) and its link. O(1); its bits are swept later.
        False: unknown."""
        self._links.pop(worker_id, None)
        return self._drop(worker_id)

    def drop_store(self, store: StoreId) -> bool:
        """Forgets a node store (its kvmanager left, or no worker uses its layout any more):
        the workers linked to it keep the link but match only their own blocks. O(1)."""
        return self._drop(store)

    def _drop(self, hid: HolderId) -> bool:
        w = self._workers.pop(hid, None)
        if w is None:
            return False
        self._retire(w)
        return True

    def link(self, worker_id: WorkerId, store: StoreId | None) -> None:
        """Names the node store whose blocks count as the worker's lower tiers (None: none).
        Links are by id: either side may have no view yet, or lose it and get it back."""
        if store is None:
            self._links.pop(worker_id, None)
        else:
            self._links[worker_id] = store

    def linked(self, worker_id: WorkerId) -> StoreId | None:
        return self._links.get(worker_id)

    def links(self) -> Mapping[WorkerId, StoreId]:
        """Every worker -> store link (a read-only view)."""
        return MappingProxyType(self._links)

    def mark_degraded(self, worker_id: HolderId) -> None:
        """The worker's event stream was lost: keep its blocks, but as a hint. The next batch in
        sequence (a resumed stream) or a snapshot makes it EXACT again."""
        w = self._workers.get(worker_id)
        if w is not None:
            w.state = ViewState.DEGRADED

    def mark_live(self, worker_id: HolderId) -> None:
        """The worker's stream resumed and caught up with nothing missed: a view that was EXACT
        before the loss is EXACT again (one that never had a snapshot stays DEGRADED)."""
        w = self._workers.get(worker_id)
        if w is not None and w.synced:
            w.state = ViewState.EXACT

    def sweep(self, max_keys: int | None = None) -> int:
        """Clears retired slots' bits, visiting at most ``max_keys`` keys (None: until done).
        A pass starts with a snapshot of the keys (~12 ns a key), which is all a bounded call
        does that time. ``apply`` calls it with ``sweep_keys_per_apply``; the adapter may call it
        when the streams are idle. Returns the keys left to visit (0: nothing to sweep)."""
        budget = sys.maxsize if max_keys is None else max_keys
        d = self._d
        while budget > 0:
            if not self._sweep_keys:
                if not self._dirty:
                    break
                self._start_pass()
                if max_keys is not None:
                    break
                continue
            pos = self._sweep_pos
            chunk = self._sweep_keys[pos : pos + budget]
            budget -= len(chunk)
            self._sweep_pos = pos + len(chunk)
            mask4 = self._sweeping * 15
            live4 = self._live4
            intern = self._intern.setdefault
            for h in list(compress(chunk, map(and_, map(d.get, chunk, repeat(0)), repeat(mask4)))):
                v = d[h] & live4
                if v:
                    d[h] = intern(v, v)
                else:
                    del d[h]
            if self._sweep_pos >= len(self._sweep_keys):
                self._finish_pass()
        return self._sweep_pending()

    def _sweep_pending(self) -> int:
        return len(self._sweep_keys) - self._sweep_pos + (len(self._d) if self._dirty else 0)

    # ---- queries --------------------------------------------------------------------------
    def match(
        self, hashes: Sequence[BlockHash], workers: Iterable[WorkerId] | None = None
    ) -> dict[WorkerId, PrefixMatch]:
        """Per worker, the contiguous prefix of ``hashes`` it holds, on its own tiers or its
        linked store's, and its best tiers.

        ``workers``: only these (unknown ids and store ids are ignored); None: every worker in
        the index. Workers matching zero blocks are omitted. The dict is ordered by ``blocks``,
        longest first, ties by worker id."""
        active, spread, degraded = self._candidates(workers)
        if not active or not hashes:
            return {}
        ends, lower = self._scan(hashes, active, spread)
        if not ends:
            return {}
        owner = self._owner
        out: list[PrefixMatch] = []
        for length, mask in ends:
            for pos in _bits(mask):
                w = owner[pos >> 2]
                cpu, disk = lower.get(pos, (0, 0))
                out.append(
                    PrefixMatch(
                        w.worker_id,
                        length,
                        length - cpu - disk,
                        cpu,
                        disk,
                        w.state is ViewState.EXACT and not (degraded >> pos) & 1,
                    )
                )
        out.sort(key=lambda p: (-p.blocks, p.worker_id))
        return {p.worker_id: p for p in out}

    def match_stores(
        self, hashes: Sequence[BlockHash], stores: Iterable[StoreId] | None = None
    ) -> dict[StoreId, StoreMatch]:
        """Per node store, the contiguous prefix of ``hashes`` it holds itself (any tier; its
        workers' gpu blocks do not count): what a peer fetch from its kvmanager could supply.

        ``stores``: only these (unknown ids and worker ids are ignored); None: every store.
        Stores matching zero blocks are omitted; longest first, ties by store id. One walk for
        all stores, O(longest match): a miss costs one lookup."""
        by_id = self._workers
        if stores is None:
            active = self._store_any
        else:
            active = 0
            for sid in stores:
                s = by_id.get(sid)
                if s is not None and s.store:
                    active |= s.any_bit
        if not active or not hashes:
            return {}
        owner = self._owner
        out = [
            StoreMatch(StoreId(s.worker_id), length, s.state is ViewState.EXACT)
            for length, mask in self._walk(hashes, active)
            for s in (owner[pos >> 2] for pos in _bits(mask))
        ]
        out.sort(key=lambda m: (-m.blocks, m.store))
        return {m.store: m for m in out}

    def _walk(self, hashes: Sequence[BlockHash], active: int) -> list[tuple[int, int]]:
        """(prefix length, any-bits of the workers whose prefix ends there), lengths ascending."""
        get = self._d.get
        ends: list[tuple[int, int]] = []
        for n, h in enumerate(hashes):
            m = get(h, 0) & active
            if m != active:
                if n:
                    ends.append((n, active ^ m))
                active = m
                if not m:
                    break
        else:
            ends.append((len(hashes), active))
        return ends

    def _scan(
        self, hashes: Sequence[BlockHash], active: int, spread: dict[int, int]
    ) -> tuple[list[tuple[int, int]], dict[int, tuple[int, int]]]:
        """``_walk`` and the tiers in one pass: (prefix length, any-bits of the workers whose
        prefix ends there), lengths ascending; and per matching worker (bit position of its
        any-bit) its matched blocks whose best tier is cpu, and disk.

        A block a linked store holds counts for the workers it backs (``spread``: store any-bit
        -> their any-bits), its tier bits copied onto theirs (a worker's gpu beats its store's
        cpu). The lookups run at C speed (``map`` over a chunk of the prompt, ``groupby`` into
        runs of one holder int: a prompt's blocks come in long runs held by the same holders),
        and each distinct holder int is projected once; per run, not per block, the Python
        work. A miss stops the scan at the end of its chunk."""
        get = self._d.get
        stores = _or(spread)
        stores4 = stores * 15
        keep = active * 15 | stores4  # retired slots' stale bits are never looked at
        count_tiers = bool(self._totals[1] or self._totals[2])
        memo: dict[int, int] = {}
        ends: list[tuple[int, int]] = []
        cpu: dict[int, int] = {}
        disk: dict[int, int] = {}
        n = 0
        total = len(hashes)
        chunk = _SCAN_FIRST_CHUNK
        start = 0
        while start < total:
            for v, run in groupby(map(get, hashes[start : start + chunk], repeat(0))):
                pv = memo.get(v)
                if pv is None:
                    pv = v & keep
                    if pv & stores:
                        pv = _project_tiers(pv, spread, stores)
                    memo[v] = pv
                m = pv & active
                if m != active:
                    if n:
                        ends.append((n, active ^ m))
                    active = m
                    if not m:
                        return ends, _tier_counts(cpu, disk)
                c = len(list(run))
                if count_tiers:
                    on_gpu = (pv >> 1) & active
                    if on_gpu != active:
                        on_cpu = (pv >> 2) & active & ~on_gpu
                        for pos in _bits(on_cpu):
                            cpu[pos] = cpu.get(pos, 0) + c
                        for pos in _bits(active & ~on_gpu & ~on_cpu):
                            disk[pos] = disk.get(pos, 0) + c
                n += c
            start += chunk
            chunk = _SCAN_CHUNK
        ends.append((total, active))
        return ends, _tier_counts(cpu, disk)

    def _candidates(self, workers: Iterable[WorkerId] | None) -> tuple[int, dict[int, int], int]:
        """(any-bits of the workers asked for, store any-bit -> the any-bits of those it backs,
        any-bits of those whose store's view is not EXACT)."""
        by_id = self._workers
        if workers is None:
            active = self._live_any & ~self._store_any
            pairs: Iterable[tuple[_Worker | None, StoreId]] = (
                (by_id.get(wid), sid) for wid, sid in self._links.items()
            )
        else:
            active = 0
            found: list[tuple[_Worker | None, StoreId]] = []
            links = self._links
            for wid in workers:
                w = by_id.get(wid)
                if w is not None and not w.store:
                    active |= w.any_bit
                    sid = links.get(wid)
                    if sid is not None:
                        found.append((w, sid))
            pairs = found
        spread: dict[int, int] = {}
        degraded = 0
        for w, sid in pairs:
            s = by_id.get(sid)
            if w is None or s is None or w.store or not s.store:
                continue
            spread[s.any_bit] = spread.get(s.any_bit, 0) | w.any_bit
            if s.state is not ViewState.EXACT:
                degraded |= w.any_bit
        return active, spread, degraded

    def view(self, worker_id: HolderId) -> WorkerKvView:
        w = self._workers.get(worker_id)
        if w is None:
            return WorkerKvView(worker_id, ViewState.UNKNOWN, None, 0)
        g, c, d = w.counts
        return WorkerKvView(worker_id, w.state, w.epoch, w.seq, g, c, d)

    @property
    def block_count(self) -> int:
        """Distinct block hashes held now (O(1))."""
        return len(self._d)

    def workers(self) -> tuple[WorkerId, ...]:
        """Workers the index has a view of, by id."""
        return tuple(sorted(w.worker_id for w in self._workers.values() if not w.store))

    def stores(self) -> tuple[StoreId, ...]:
        """Node stores the index has a view of, by id."""
        return tuple(sorted(StoreId(w.worker_id) for w in self._workers.values() if w.store))

    def stats(self) -> IndexStats:
        d = self._d
        est = (
            sys.getsizeof(d)
            + len(d) * _KEY_BYTES
            + sys.getsizeof(self._intern)
            + sum(map(sys.getsizeof, self._intern))
            + sys.getsizeof(self._sweep_keys)
        )
        stores = sum(w.store for w in self._workers.values())
        return IndexStats(
            workers=len(self._workers) - stores,
            blocks=len(d),
            entries=sum(self._totals),
            evicted_blocks=self._evicted,
            sweep_pending=self._sweep_pending(),
            estimated_bytes=est,
            stores=stores,
            links=len(self._links),
        )

    def check_invariants(self) -> None:
        """Raises AssertionError if the bookkeeping is inconsistent. O(index): tests, debugging."""
        live4, garbage = self._live4, (self._dirty | self._sweeping) * 15
        per_bit: Counter[int] = Counter()
        for h, v in self._d.items():
            assert v, f"block {h:#x} has no holders"
            assert not v & ~(live4 | garbage), f"block {h:#x} has bits of a free slot"
            live = v & live4
            for pos in _bits(live):
                per_bit[pos] += 1
            any_bits = live & self._live_any
            assert any_bits == ((live >> 1) | (live >> 2) | (live >> 3)) & self._live_any, (
                f"block {h:#x}: any-bits disagree with tier bits"
            )
        totals = [0, 0, 0]
        for w in self._workers.values():
            assert self._owner.get(w.slot) is w
            for t in range(3):
                got = per_bit.get(4 * w.slot + 1 + t, 0)
                assert w.counts[t] == got >= 0, f"{w.worker_id}: counts {w.counts[t]} != {got}"
                totals[t] += got
        assert totals == self._totals, f"totals {self._totals} != {totals}"
        assert len(self._owner) == len(self._workers)
        stores = _or(w.any_bit for w in self._workers.values() if w.store)
        assert stores == self._store_any, "store any-bits disagree"

    # ---- internals ------------------------------------------------------------------------
    def _fresh(self, hid: HolderId, w: _Worker | None, batch: KvEventBatch, store: bool) -> _Worker:
        """The worker with no blocks (a new slot), at the batch's epoch and seq."""
        if w is None:
            w = _Worker(WorkerId(hid), batch.epoch, batch.seq, ViewState.DEGRADED, False, store)
            self._workers[hid] = w
        else:
            self._retire(w)
            w.epoch, w.seq = batch.epoch, batch.seq
        self._assign_slot(w)
        return w

    def _assign_slot(self, w: _Worker) -> None:
        if self._free:
            slot = heappop(self._free)
        else:
            slot = self._next_slot
            self._next_slot += 1
        ab = 1 << (4 * slot)
        w.slot, w.any_bit = slot, ab
        w.tier_bits = (ab << 1, ab << 2, ab << 3)
        w.stored_bits = (ab | ab << 1, ab | ab << 2, ab | ab << 3)
        w.counts = [0, 0, 0]
        self._owner[slot] = w
        self._live_any |= ab
        self._live4 |= ab * 15
        if w.store:
            self._store_any |= ab

    def _retire(self, w: _Worker) -> None:
        """Takes the worker's slot out of use; its bits are garbage until swept."""
        ab = w.any_bit
        self._live_any &= ~ab
        self._live4 &= ~(ab * 15)
        self._store_any &= ~ab
        del self._owner[w.slot]
        totals = self._totals
        held = False
        for t, c in enumerate(w.counts):
            totals[t] -= c
            held = held or c > 0
        if held:
            self._dirty |= ab  # the next sweep pass clears it
        else:
            heappush(self._free, w.slot)
        w.counts = [0, 0, 0]
        w.slot, w.any_bit = -1, 0

    def _start_pass(self) -> None:
        self._sweeping, self._dirty = self._dirty, 0
        self._sweep_keys = list(self._d)
        self._sweep_pos = 0
        if not self._sweep_keys:
            self._finish_pass()

    def _finish_pass(self) -> None:
        for pos in _bits(self._sweeping):
            heappush(self._free, pos >> 2)
        self._sweeping = 0
        self._sweep_keys = []
        self._sweep_pos = 0

    def _apply_events(self, w: _Worker, events: Iterable[KvEvent]) -> None:
        for ev in events:
            if isinstance(ev, BlockStored):
                self._store(w, ev.block_hashes, _tier_index(ev.tier))
            elif isinstance(ev, BlockRemoved):
                self._remove(w, ev.block_hashes, _tier_index(ev.tier))
            elif isinstance(ev, AllBlocksCleared):
                self._clear(w, ev.tier)

    def _store(self, w: _Worker, hashes: Sequence[int], t: int) -> None:
        room = self._cfg.max_blocks - len(self._d)
        if len(hashes) <= room:
            self._store_run(w, hashes, t)
        else:  # keep the bound while a long run goes in
            step = self._evict_batch
            for i in range(0, len(hashes), step):
                self._store_run(w, hashes[i : i + step], t)
                if len(self._d) > self._cfg.max_blocks:
                    self._evict()
        if len(self._d) > self._cfg.max_blocks:
            self._evict()

    def _store_run(self, w: _Worker, hashes: Iterable[int], t: int) -> None:
        d = self._d
        get = d.get
        intern = self._intern.setdefault
        tb, bits, live4 = w.tier_bits[t], w.stored_bits[t], self._live4
        new = 0
        for h in hashes:
            v = get(h)
            if v is None:
                d[h] = bits
                new += 1
            elif not v & tb:
                del d[h]  # re-inserted below: the most recently stored block goes last
                v = v & live4 | bits
                d[h] = intern(v, v)
                new += 1
        w.counts[t] += new
        self._totals[t] += new

    def _remove(self, w: _Worker, hashes: Iterable[int], t: int) -> None:
        d = self._d
        get = d.get
        intern = self._intern.setdefault
        ab, tb, live4 = w.any_bit, w.tier_bits[t], self._live4
        others = (ab * 14) & ~tb  # the worker's other tier bits
        gone = 0
        for h in hashes:
            v = get(h)
            if v is None or not v & tb:
                continue
            v = (v & live4) ^ tb
            if not v & others:
                v ^= ab
            if v:
                d[h] = intern(v, v)
            else:
                del d[h]
            gone += 1
        w.counts[t] -= gone
        self._totals[t] -= gone

    def _clear(self, w: _Worker, tier: Tier | None) -> None:
        t = -1 if tier is None else _tier_index(tier)
        if t < 0 or sum(w.counts) == w.counts[t]:
            # Nothing would be left: a fresh slot is O(1), the old one is swept.
            self._retire(w)
            self._assign_slot(w)
        elif w.counts[t]:  # O(index) scan, at C speed; AllBlocksCleared of one tier is rare
            d = self._d
            hits = list(compress(d, map(and_, d.values(), repeat(w.tier_bits[t]))))
            self._remove(w, hits, t)

    def _evict(self) -> None:
        """Drops the least recently stored blocks down to max_blocks - evict_batch."""
        d = self._d
        n = len(d) - (self._cfg.max_blocks - self._evict_batch)
        if n <= 0:
            return
        victims = list(islice(d, n))
        holders = Counter(map(and_, map(d.pop, victims), repeat(self._live4)))
        self._evicted += n
        owner, totals = self._owner, self._totals
        for v, c in holders.items():
            for pos in _bits(v):
                t = (pos & 3) - 1
                if t >= 0:
                    owner[pos >> 2].counts[t] -= c
                    totals[t] -= c
