"""The mesh under the simulated workers: nodes of several workers, each node with a kvmanager
CPU tier (and optionally a disk tier) of its own capacity and LRU, and peer fetch between nodes.

What it models (the KvmeshConnector and the kvmanager, services/worker/connector, kvmanager/):

- **Write-through.** Every block a worker's engine stores (a ``BlockStored`` on its GPU) is saved
  to its node's CPU tier (the connector saves what the engine computes). A CPU tier over its
  capacity demotes its least recently used blocks to the disk tier (or drops them without one);
  a disk tier over capacity drops its least recently used.
- **Loading.** A request routed to a worker is served, past the prefix its engine holds, by its
  node's tiers (the contiguous blocks the node holds from there on), then by a peer: the other
  node whose tiers hold the longest prefix, when it beats the local prefix by at least
  ``peer_min_gain_blocks`` (the router's peer hint rule, core/peers.py). Fetched blocks land in
  the node's CPU tier (KvManager.FetchFromPeer puts them there) and, once loaded, in the engine.
- **Time.** Each source is a ``Link``: ``latency_s + tokens * s_per_token``, its whole time to
  bring the KV into the engine. The last leg, node CPU tier -> engine, happens when the engine
  admits the request (vLLM asks its KV connector at scheduling time), charged to the admitting
  step at the CPU link's rate, for every block the engine lacks *then*: so a prefix the engine
  held at routing but evicted while the request waited in its queue is loaded from the node
  (written through) instead of recomputed. What the node's CPU tier lacks comes there first (a
  peer fetch, a disk read: the link's time beyond the CPU leg, before the engine sees the
  request; other requests keep running meanwhile). TTFT counts from the arrival at the router.
  Blocks planned at routing are taken as still there at admission (the node's LRU may have
  dropped some meanwhile; the replay does not check).

Defaults are this project's own measurements (BENCHMARKS.md, "KV tiers and peer fetch"): a
4,000-token prompt's TTFT from the node CPU tier is 0.28x of recomputing it, from the disk tier
0.83x, from a peer kvmanager 0.44x. Scaled to the simulator's prefill cost (5e-5 s per token),
that is 1.4e-5, 4.15e-5 and 2.2e-5 s per token (for 128 KiB of KV per token: ~9.4, ~3.2 and
~6.0 GB/s). For a GPU cluster pass your own: HBM<->DRAM over PCIe, RDMA between nodes.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvmesh.kv.events import BlockHash, BlockRemoved, BlockStored, KvEvent, Tier

SIM_PREFILL_S_PER_TOKEN = 5e-5  # SimWorkerConfig().prefill_s_per_token, the ratios' base
CPU_TTFT_RATIO = 0.28  # TTFT from the node CPU tier / recompute, 4K-token prompt (issue 4)
DISK_TTFT_RATIO = 0.83  # ... from the node disk tier
PEER_TTFT_RATIO = 0.44  # ... from a peer kvmanager (fetch into the node's CPU tier, then load)


@dataclass(frozen=True, slots=True)
class Link:
    """A source of KV blocks: time to bring ``tokens`` of KV into the engine."""

    s_per_token: float
    latency_s: float = 0.0

    def __post_init__(self) -> None:
        if self.s_per_token < 0 or self.latency_s < 0:
            raise ValueError("link times must be >= 0")

    def time_s(self, tokens: int) -> float:
        return self.latency_s + tokens * self.s_per_token if tokens > 0 else 0.0


@dataclass(frozen=True, slots=True)
class MeshConfig:
    workers_per_node: int = 4
    cpu_blocks: int = 0  # per node; 0: no kvmanager tiers (the replay as before issue 12)
    disk_blocks: int = 0  # per node; 0: no disk tier
    cpu: Link = field(default_factory=lambda: Link(CPU_TTFT_RATIO * SIM_PREFILL_S_PER_TOKEN, 1e-3))
    disk: Link = field(
        default_factory=lambda: Link(DISK_TTFT_RATIO * SIM_PREFILL_S_PER_TOKEN, 5e-3)
    )
    peer: Link = field(
        default_factory=lambda: Link(PEER_TTFT_RATIO * SIM_PREFILL_S_PER_TOKEN, 2e-3)
    )
    peer_fetch: bool = True
    peer_min_gain_blocks: int = 4

    def __post_init__(self) -> None:
        if self.workers_per_node < 1:
            raise ValueError("workers_per_node must be >= 1")
        if self.cpu_blocks < 0 or self.disk_blocks < 0:
            raise ValueError("tier capacities must be >= 0")
        if self.disk_blocks and not self.cpu_blocks:
            raise ValueError("a disk tier needs a CPU tier above it")

    @property
    def tiered(self) -> bool:
        return self.cpu_blocks > 0

    def node_of(self, worker: int) -> int:
        return worker // self.workers_per_node


TierSink = Callable[[Sequence[KvEvent]], None]


class NodeStore:
    """One node kvmanager's tiers: CPU (and disk) LRU of block hashes. Publishes its changes
    as KV events (``Tier.CPU`` / ``Tier.DISK``), as the kvmanager's tier event stream does."""

    def __init__(
        self, cpu_blocks: int, disk_blocks: int, block_size: int, sink: TierSink | None = None
    ) -> None:
        self._cpu_cap = cpu_blocks
        self._disk_cap = disk_blocks
        self._bs = block_size
        self._sink = sink
        self.cpu: OrderedDict[BlockHash, None] = OrderedDict()  # LRU first
        self.disk: OrderedDict[BlockHash, None] = OrderedDict()

    def __contains__(self, h: BlockHash) -> bool:
        return h in self.cpu or h in self.disk

    def save(self, hashes: Sequence[BlockHash]) -> None:
        """Blocks written to the CPU tier (write-through, or a peer fetch): most recent now."""
        cpu, disk = self.cpu, self.disk
        new: list[BlockHash] = []
        from_disk: list[BlockHash] = []
        for h in hashes:
            if h in cpu:
                cpu.move_to_end(h)
                continue
            cpu[h] = None
            new.append(h)
            if h in disk:
                del disk[h]
                from_disk.append(h)
        events: list[KvEvent] = []
        if from_disk:
            events.append(BlockRemoved(tuple(from_disk), Tier.DISK))
        if new:
            events.append(BlockStored(tuple(new), None, Tier.CPU, self._bs))
        events += self._shrink()
        if events and self._sink is not None:
            self._sink(events)

    def touch(self, hashes: Sequence[BlockHash]) -> None:
        """Blocks read (loaded or fetched): most recently used now, on the tier they are on."""
        cpu, disk = self.cpu, self.disk
        for h in hashes:
            if h in cpu:
                cpu.move_to_end(h)
            elif h in disk:
                disk.move_to_end(h)

    def run(self, hashes: Sequence[BlockHash], start: int, limit: int) -> tuple[int, int]:
        """(cpu, disk) blocks of the contiguous run ``hashes[start:limit]`` this node holds
        from ``start`` on (each block on its best tier)."""
        cpu, disk = self.cpu, self.disk
        c = d = 0
        for i in range(start, limit):
            h = hashes[i]
            if h in cpu:
                c += 1
            elif h in disk:
                d += 1
            else:
                break
        return c, d

    def prefix(self, hashes: Sequence[BlockHash], limit: int) -> int:
        """Leading blocks of ``hashes`` (at most ``limit``) the node holds, any tier."""
        c, d = self.run(hashes, 0, limit)
        return c + d

    def _shrink(self) -> list[KvEvent]:
        out: list[KvEvent] = []
        over = len(self.cpu) - self._cpu_cap
        if over <= 0:
            return out
        demoted = [self.cpu.popitem(last=False)[0] for _ in range(over)]
        out.append(BlockRemoved(tuple(demoted), Tier.CPU))
        if not self._disk_cap:
            return out
        for h in demoted:
            self.disk[h] = None
        out.append(BlockStored(tuple(demoted), None, Tier.DISK, self._bs))
        over = len(self.disk) - self._disk_cap
        if over > 0:
            dropped = [self.disk.popitem(last=False)[0] for _ in range(over)]
            out.append(BlockRemoved(tuple(dropped), Tier.DISK))
        return out


@dataclass(frozen=True, slots=True)
class FetchPlan:
    """Where one request's prompt blocks come from on the worker it was routed to."""

    gpu_blocks: int  # the engine's own prefix
    cpu_blocks: int  # then its node's CPU tier
    disk_blocks: int  # then its node's disk tier
    peer_blocks: int  # then a peer node's tiers
    peer_node: int  # -1: none
    fetch_s: float  # time before the engine can use them

    @property
    def blocks(self) -> int:
        return self.gpu_blocks + self.cpu_blocks + self.disk_blocks + self.peer_blocks


def plan_fetch(
    cfg: MeshConfig,
    stores: Sequence[NodeStore],
    node: int,
    hashes: Sequence[BlockHash],
    gpu_blocks: int,
    limit: int,
    block_size: int,
) -> FetchPlan:
    """The sources of a request's prefix on a worker of ``node`` whose engine holds
    ``gpu_blocks`` (see the module doc), and the fetch time they cost."""
    own = stores[node]
    c, d = own.run(hashes, gpu_blocks, limit)
    local = gpu_blocks + c + d
    peer, peer_node = 0, -1
    bar = local + cfg.peer_min_gain_blocks  # a peer must hold at least this many blocks
    if cfg.peer_fetch and bar <= limit:
        best = bar - 1
        for j, s in enumerate(stores):
            if best >= limit:
                break
            if j == node or hashes[best] not in s:
                continue  # a quick test on the block it must hold to beat the best so far
            n = s.prefix(hashes, limit)
            if n > best:
                best, peer_node = n, j
        if peer_node >= 0:
            peer = best - local
    bs = block_size
    # Before the engine sees the request: what its node's CPU tier lacks (a peer fetch, a disk
    # read) comes there; the last leg, node CPU tier -> engine, is the engine's load at
    # admission (cfg.cpu's rate, charged by the engine: SimWorkerConfig.load_s_per_token).
    cpu_s = cfg.cpu.s_per_token
    fetch = 0.0
    if d:
        fetch += cfg.disk.latency_s + d * bs * max(cfg.disk.s_per_token - cpu_s, 0.0)
    if peer:
        fetch += cfg.peer.latency_s + peer * bs * max(cfg.peer.s_per_token - cpu_s, 0.0)
    return FetchPlan(gpu_blocks, c, d, peer, peer_node, fetch)


def apply_fetch(
    stores: Sequence[NodeStore], node: int, hashes: Sequence[BlockHash], plan: FetchPlan
) -> None:
    """What the fetch does to the tiers: the blocks read are used, peer blocks are copied into
    the node's CPU tier."""
    a = plan.gpu_blocks
    b = a + plan.cpu_blocks + plan.disk_blocks
    if b > a:
        stores[node].touch(hashes[a:b])
    if plan.peer_blocks:
        stores[plan.peer_node].touch(hashes[: b + plan.peer_blocks])
        stores[node].save(hashes[b : b + plan.peer_blocks])
