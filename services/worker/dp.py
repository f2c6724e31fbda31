"""Data-parallel ranks on vLLM (``--data-parallel-size N``): what ``engine.VllmEngine`` needs
for an engine of several ranks (docs/engine.md#data-parallel-ranks).

- **KV events per rank.** vLLM gives every rank a publisher of its own at the configured
  endpoint offset by the rank (``ZmqEventPublisher.offset_endpoint_port``: a tcp port + rank;
  an ``ipc://`` endpoint it refuses for rank >= 1), and tags each batch with its rank. So with
  ranks the engine gets ``tcp://*:P`` (replay ``tcp://*:Q``) and we open one reader per rank,
  at ``P + r`` (and ``Q + r``): each rank's events go to that rank's log.
- **Load per rank.** vLLM builds one stat logger per engine index (= rank); one ``_StatsSink``
  per rank keeps that rank's counters; the engine's load is their sum (``sum_loads``).
"""

from __future__ import annotations

import random
import socket
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from kvmesh import errors

from .core import EngineLoad, SpecDecodeCounts

_PORT_FLOOR = 10000  # below: well-known and registered services' ports


def free_port_run(count: int, attempts: int = 200) -> int:
    """A port P with P .. P + count - 1 all free now on every address (vLLM binds ``tcp://*``),
    drawn below the kernel's ephemeral range: a port in that range may be taken meanwhile as
    the local end of any outgoing connection, between this check and vLLM's bind seconds later
    (a rank >= 1 then failed to start, seen once in CI). A race with a process binding the same
    port on purpose stays possible; vLLM then fails to bind and says so."""
    low, high = _unraced_range(count)
    rng = random.Random()
    for _ in range(attempts):
        base = rng.randrange(low, high - count)
        if all(_free(base + i) for i in range(count)):
            return base
    raise errors.Unavailable(f"found no run of {count} free TCP ports for the KV event sockets")


def _unraced_range(
    count: int, path: str = "/proc/sys/net/ipv4/ip_local_port_range"
) -> tuple[int, int]:
    """[low, high) of ports the kernel does not hand out to outgoing connections: below the
    ephemeral range, above it where that leaves no room, and every port past the well-known
    ones where neither side has room."""
    try:
        with open(path) as f:
            first, last = (int(x) for x in f.read().split())
    except (OSError, ValueError):
        first, last = 32768, 60999  # Linux's default
    if first - _PORT_FLOOR > 16 * count:
        return _PORT_FLOOR, first
    if 65536 - (last + 1) > 16 * count:
        return last + 1, 65536
    return _PORT_FLOOR, 65536  # the ephemeral range covers nearly all: no unraced ports


def _free(port: int) -> bool:
    """Whether ``port`` can be bound on every address: a wildcard bind conflicts with a socket
    on any address (a check on 127.0.0.1 misses one bound to the host's own address)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("", port))
        except OSError:
            return False
    return True


def rank_event_configs(user: Mapping[str, Any] | None, ranks: int) -> list[dict[str, Any]]:
    """Per rank, the KV events config its reader subscribes with (rank 0's is the engine's):
    the user's settings with tcp endpoints ``tcp://*:P + r`` / ``tcp://*:Q + r``. A user
    endpoint must be tcp with a fixed port (vLLM offsets it per rank); none given: free ports."""
    cfg = dict(user or {})
    endpoint, replay = cfg.get("endpoint"), cfg.get("replay_endpoint")
    if endpoint is None:
        base = free_port_run(2 * ranks)
        endpoint, replay = f"tcp://*:{base}", f"tcp://*:{base + ranks}"
    for name, value in (("endpoint", endpoint), ("replay_endpoint", replay)):
        if value is not None and not _tcp_port(str(value)):
            raise errors.InvalidArgument(
                f"kv_events_config.{name} {value!r}: with --data-parallel-size > 1 vLLM offsets "
                "the endpoint's port by the rank, so use tcp://*:PORT with a fixed port (or "
                "leave it unset)"
            )
    out = []
    for r in range(ranks):
        rank_cfg = dict(cfg, endpoint=_offset(str(endpoint), r))
        if replay is not None:
            rank_cfg["replay_endpoint"] = _offset(str(replay), r)
        out.append(rank_cfg)
    return out


def _tcp_port(endpoint: str) -> int:
    if not endpoint.startswith("tcp://"):
        return 0
    port = endpoint.rpartition(":")[2]
    return int(port) if port.isdigit() else 0


def _offset(endpoint: str, rank: int) -> str:
    base, _, port = endpoint.rpartition(":")
    return f"{base}:{int(port) + rank}"


def sum_loads(loads: Sequence[EngineLoad]) -> EngineLoad:
    """The engine's load over its ranks: counts summed, KV usage the mean (equal caches)."""
    per_pos: list[int] = []
    for x in loads:
        pos = x.spec.accepted_per_position
        per_pos += [0] * (len(pos) - len(per_pos))
        for i, n in enumerate(pos):
            per_pos[i] += n
    return EngineLoad(
        running_requests=sum(x.running_requests for x in loads),
        waiting_requests=sum(x.waiting_requests for x in loads),
        kv_cache_usage=sum(x.kv_cache_usage for x in loads) / max(len(loads), 1),
        prefix_cache_queried_tokens=sum(x.prefix_cache_queried_tokens for x in loads),
        prefix_cache_hit_tokens=sum(x.prefix_cache_hit_tokens for x in loads),
        preemptions=sum(x.preemptions for x in loads),
        prefill_computed_tokens=sum(x.prefill_computed_tokens for x in loads),
        prefill_s=sum(x.prefill_s for x in loads),
        generation_tokens=sum(x.generation_tokens for x in loads),
        decode_tokens=sum(x.decode_tokens for x in loads),
        decode_s=sum(x.decode_s for x in loads),
        spec=SpecDecodeCounts(
            drafts=sum(x.spec.drafts for x in loads),
            draft_tokens=sum(x.spec.draft_tokens for x in loads),
            accepted_tokens=sum(x.spec.accepted_tokens for x in loads),
            accepted_per_position=tuple(per_pos),
        ),
        kv_connector=_sum_counts(x.kv_connector for x in loads),
    )


def _sum_counts(
    counts: Iterable[tuple[tuple[str, int], ...]],
) -> tuple[tuple[str, int], ...]:
    total: dict[str, int] = {}
    for c in counts:
        for name, n in c:
            total[name] = total.get(name, 0) + n
    return tuple(sorted(total.items()))
