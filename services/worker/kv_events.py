"""vLLM's KV cache events, from its ZMQ publisher to the worker's event sink.

Wiring. vLLM publishes from the scheduler inside its engine-core child process, on a ZMQ PUB
socket, and keeps the last ``buffer_steps`` batches for a ROUTER "replay" socket. By default
``VllmKvEvents`` points both at ``ipc://`` sockets in a temp dir of its own (unique per engine),
so the publisher BINDS (vLLM binds ``ipc://``, ``*`` and ``::`` endpoints and connects to the
rest) and this process CONNECTS; no port is taken and two workers on one host cannot collide. A
user-given ``tcp://host:port`` endpoint is one the publisher connects to, so then we bind it;
``tcp://*:port`` is bound by the publisher and we connect to 127.0.0.1. The SUB socket is made
(and connected) before the engine starts and the engine is only handed out once the ZMTP
handshake is done; the reader then first asks the replay socket for everything from seq 0, so
events published before our subscription took effect (ZMQ's slow joiner) are not lost.

Wire format (``vllm.distributed.kv_events``, msgspec): frames ``[topic, seq (8-byte big-endian,
0, 1, 2, ...), payload]``; payload is the array ``[ts, events, dp_rank]``; each event is a map
tagged by ``"type"``: ``BlockStored`` (block_hashes, parent_block_hash, block_size, medium, ...),
``BlockRemoved`` (block_hashes, medium, ...), ``AllBlocksCleared``. Hashes are ints (the low 64
bits of vLLM's block hash, ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``, vLLM's default) or, with
that variable off, the full hash bytes, of which we keep the same low 64 bits vLLM would.

Tiers. The engine's own KV memory is ``Tier.GPU`` (our "engine memory" tier) on every machine:
vLLM's block pool always reports medium ``"GPU"``, also on a CPU machine where that memory is
host RAM. Without a KV connector every event comes from that pool, so every event is mapped to
``Tier.GPU`` whatever its medium says. With a connector, connectors report their own tiers
(``"CPU"``, ``"STORAGE"``...): those map to ``Tier.CPU`` / ``Tier.DISK``.

Lost batches. A seq that is not the next one expected means batches were dropped (publisher or
SUB high-water mark, or the slow joiner): we fetch the missing ones from the replay socket and
apply them in order. Batches the replay buffer no longer has cannot be rebuilt (vLLM has no way to
list its cached blocks), so the reader sends ``AllBlocksCleared`` for the engine tier: every
subscriber forgets this worker's blocks and learns them again from new events. That
under-reports (blocks stored before the gap and still cached are not advertised until vLLM stores
them again); routing then only misses some cache hits, it never trusts a block that is gone.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
import tempfile
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from kvmesh import errors
from kvmesh.kv.events import (
    AllBlocksCleared,
    BlockHash,
    BlockRemoved,
    BlockStored,
    KvEvent,
    Tier,
)

from .core import KvEventSink

log = logging.getLogger(__name__)

_MASK64 = (1 << 64) - 1
_END_SEQ = b"\xff" * 8  # vLLM's end-of-replay marker: (-1).to_bytes(8, "big", signed=True)
_MEDIUM_TIERS = {"GPU": Tier.GPU, "CPU": Tier.CPU, "STORAGE": Tier.DISK, "DISK": Tier.DISK}
_MAX_IPC_PATH = 100  # sockaddr_un holds 107 bytes; keep room for the socket names


# ---- decoding (pure) ---------------------------------------------------------------------------
def block_hash(value: int | bytes) -> BlockHash:
    """A published block hash as our 64-bit int: ints as they are, bytes (the full hash, when
    vLLM publishes bytes) cut to the low 64 bits exactly as vLLM does for int hashes."""
    if isinstance(value, bytes | bytearray):
        return BlockHash(int.from_bytes(value, "big") & _MASK64)
    return BlockHash(int(value) & _MASK64)


def medium_tier(medium: str | None, engine_only: bool) -> Tier | None:
    """The tier of an event's ``medium``; None for a medium we do not know. ``engine_only``: no
    KV connector runs, so every event is about the engine's own memory (``Tier.GPU``)."""
    if engine_only or medium is None:
        return Tier.GPU
    return _MEDIUM_TIERS.get(medium.upper())


def decode_events(payload: bytes, engine_only: bool = True) -> list[KvEvent]:
    """One published payload (``[ts, events, dp_rank]``) as our event values. Events of unknown
    type or medium are skipped with a warning."""
    raw = msgspec.msgpack.decode(payload)
    if not isinstance(raw, list | tuple) or len(raw) < 2:
        raise ValueError(f"not a vLLM KV event batch: {type(raw).__name__}")
    out: list[KvEvent] = []
    for ev in raw[1]:
        kind = ev.get("type") if isinstance(ev, dict) else None
        if kind == "AllBlocksCleared":
            out.append(AllBlocksCleared(Tier.GPU if engine_only else None))
            continue
        if kind not in ("BlockStored", "BlockRemoved"):
            log.warning("skipping a KV event of unknown type %r", kind)
            continue
        tier = medium_tier(ev.get("medium"), engine_only)
        if tier is None:
            log.warning("skipping a %s event of unknown medium %r", kind, ev.get("medium"))
            continue
        hashes = tuple(block_hash(h) for h in ev.get("block_hashes") or ())
        if not hashes:
            continue
        if kind == "BlockStored":
            parent = ev.get("parent_block_hash")
            out.append(
                BlockStored(
                    hashes,
                    None if parent is None else block_hash(parent),
                    tier,
                    int(ev.get("block_size") or 0),
                )
            )
        else:
            out.append(BlockRemoved(hashes, tier))
    return out


# ---- configuration -----------------------------------------------------------------------------
def publisher_binds(endpoint: str) -> bool:
    """vLLM's rule (``ZmqEventPublisher._is_bind_endpoint``)."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def subscriber_address(endpoint: str) -> tuple[str, bool]:
    """Where our SUB socket goes for a publisher ``endpoint``, and whether it binds there."""
    if endpoint.startswith("inproc://"):
        raise errors.InvalidArgument(
            f"kv_events_config.endpoint {endpoint!r}: inproc cannot reach vLLM's engine-core "
            "process; use ipc:// or tcp://"
        )
    if not publisher_binds(endpoint):
        return endpoint, True
    if endpoint.startswith("tcp://"):
        host, _, port = endpoint[len("tcp://") :].rpartition(":")
        if port in ("", "0", "*"):
            raise errors.InvalidArgument(
                f"kv_events_config.endpoint {endpoint!r}: give a fixed port (vLLM picks the "
                "address of port 0 itself, and we could not find it)"
            )
        loopback = "[::1]" if "::" in host else "127.0.0.1"
        return f"tcp://{loopback}:{port}", False
    return endpoint, False


def events_config(user: Mapping[str, Any] | None, run_dir: str) -> dict[str, Any]:
    """vLLM ``KVEventsConfig`` fields: the user's, with events always on through ZMQ and, unless
    given, ipc endpoints in ``run_dir``. Raises ``InvalidArgument`` for settings that turn the
    events off."""
    cfg = dict(user or {})
    if cfg.get("enable_kv_cache_events") is False or cfg.get("publisher", "zmq") != "zmq":
        raise errors.InvalidArgument(
            "kv_events_config: kvmesh needs vLLM's KV events through ZMQ; drop "
            "enable_kv_cache_events=false / publisher (got "
            f"{cfg.get('enable_kv_cache_events')!r} / {cfg.get('publisher')!r})"
        )
    cfg["enable_kv_cache_events"] = True
    cfg["publisher"] = "zmq"
    cfg.setdefault("endpoint", f"ipc://{run_dir}/kv-events")
    cfg.setdefault("replay_endpoint", f"ipc://{run_dir}/kv-replay")
    return cfg


def _run_dir() -> str:
    path = tempfile.mkdtemp(prefix="kvmesh-kv-")
    if len(path) > _MAX_IPC_PATH:  # a long TMPDIR: ipc paths must fit in sockaddr_un
        shutil.rmtree(path, ignore_errors=True)
        path = tempfile.mkdtemp(prefix="kvmesh-kv-", dir="/tmp")
    return path


# ---- the reader --------------------------------------------------------------------------------
@dataclass(slots=True)
class KvEventsStats:
    """What the reader has seen (cumulative)."""

    received: int = 0  # batches taken from the live SUB socket
    replayed: int = 0  # batches fetched from the replay socket
    delivered: int = 0  # batches passed on (each seq once)
    lost: int = 0  # batches neither received nor replayable (each one forced a clear)
    next_seq: int = 0  # the vLLM seq expected next


class VllmKvEvents:
    """Subscribes to one vLLM engine's KV events and hands them to a sink on the event loop.

    ``open()`` before the engine is built (its ``config`` goes into the engine arguments),
    ``await start()`` once the engine is up, ``set_sink()`` whenever the consumer is ready
    (events that come before are kept, up to ``pending_batches``), ``await close()`` after the
    engine is shut down.
    """

    def __init__(
        self,
        config: dict[str, Any],
        run_dir: str | None,
        engine_only: bool = True,
        replay_timeout_s: float = 5.0,
        pending_batches: int = 10_000,
    ) -> None:
        self.config = config  # vLLM KVEventsConfig fields
        self.engine_only = engine_only
        self.stats = KvEventsStats()
        self._run_dir = run_dir
        self._replay_timeout_s = replay_timeout_s
        self._topic = str(config.get("topic") or "").encode()
        self._address, self._bind = subscriber_address(str(config["endpoint"]))
        replay = config.get("replay_endpoint")
        self._replay_address = subscriber_address(str(replay))[0] if replay else None
        self._sink: KvEventSink | None = None
        self._pending: deque[list[KvEvent]] = deque(maxlen=pending_batches)
        self._ctx = zmq.asyncio.Context()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.LINGER, 0)
        self._sub.setsockopt(zmq.RCVHWM, 100_000)  # vLLM's PUB side keeps as many
        self._sub.setsockopt(zmq.SUBSCRIBE, self._topic)
        self._monitor = self._sub.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
        self._task: asyncio.Task[None] | None = None
        try:
            if self._bind:
                self._sub.bind(self._address)
            else:
                self._sub.connect(self._address)
        except zmq.ZMQError as exc:
            self._close_sockets()
            raise errors.Unavailable(
                f"cannot {'bind' if self._bind else 'connect'} the KV event subscriber at "
                f"{self._address}: {exc}"
            ) from exc

    @classmethod
    def open(
        cls, user_config: Mapping[str, Any] | None = None, engine_only: bool = True
    ) -> VllmKvEvents:
        """A subscriber, already connecting, for an engine about to be started with
        ``.config``; its ipc sockets live in a new temp dir (removed by ``close()``)."""
        run_dir = _run_dir()
        try:
            return cls(events_config(user_config, run_dir), run_dir, engine_only)
        except BaseException:
            shutil.rmtree(run_dir, ignore_errors=True)
            raise

    async def start(self, connect_timeout_s: float = 10.0) -> None:
        """Waits until the publisher and our SUB socket have shaken hands, then starts reading
        (first replaying whatever was published before)."""
        try:
            await asyncio.wait_for(self._handshake(), connect_timeout_s)
        except TimeoutError:
            raise errors.Unavailable(
                f"vLLM's KV event publisher at {self.config['endpoint']} did not connect within "
                f"{connect_timeout_s:g} s"
            ) from None
        finally:
            self._close_monitor()
        self._task = asyncio.get_running_loop().create_task(self._run(), name="vllm-kv-events")

    async def _handshake(self) -> None:
        while True:
            msg = parse_monitor_message(await self._monitor.recv_multipart())
            if msg["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                return

    def set_sink(self, sink: KvEventSink) -> None:
        self._sink = sink
        while self._pending:
            self._call_sink(self._pending.popleft())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        self._close_sockets()
        if self._run_dir is not None:
            shutil.rmtree(self._run_dir, ignore_errors=True)

    # ---- internals ---------------------------------------------------------------------------
    def _close_sockets(self) -> None:
        self._close_monitor()
        self._sub.close(linger=0)
        self._ctx.term()

    def _close_monitor(self) -> None:
        if self._monitor.closed:
            return
        with contextlib.suppress(zmq.ZMQError):
            self._sub.disable_monitor()
        self._monitor.close(linger=0)

    async def _run(self) -> None:
        try:
            await self._fill(up_to=None)  # whatever came before our subscription took effect
            while True:
                frames = await self._sub.recv_multipart()
                if len(frames) != 3:
                    log.warning("skipping a KV event message of %d frames", len(frames))
                    continue
                seq = int.from_bytes(frames[1], "big")
                self.stats.received += 1
                if seq > self.stats.next_seq:
                    await self._fill(up_to=seq)
                if seq >= self.stats.next_seq:
                    self._deliver(seq, frames[2])
        except asyncio.CancelledError:
            raise
        except Exception:  # never silently: a dead reader means a stale index
            log.exception("the vLLM KV event reader failed; no more KV events from this engine")
            raise

    async def _fill(self, up_to: int | None) -> None:
        """Fetches missed batches (seq ``next_seq`` onwards) from the replay socket and delivers
        them; what it cannot get below ``up_to`` is lost (see the module doc)."""
        start = self.stats.next_seq
        got = await self._replay(start) if self._replay_address else []
        for seq, payload in got:
            if seq < self.stats.next_seq:
                continue
            if seq > self.stats.next_seq:
                self._lose(self.stats.next_seq, seq)
            self.stats.replayed += 1
            self._deliver(seq, payload)
        if up_to is not None and self.stats.next_seq < up_to:
            self._lose(self.stats.next_seq, up_to)
        if got or up_to is not None:
            log.info(
                "KV events: %d batches from seq %d replayed (next seq %d)",
                len(got),
                start,
                self.stats.next_seq,
            )

    async def _replay(self, start: int) -> list[tuple[int, bytes]]:
        assert self._replay_address is not None
        sock = self._ctx.socket(zmq.DEALER)  # vLLM's ROUTER streams many replies per request
        sock.setsockopt(zmq.LINGER, 0)
        out: list[tuple[int, bytes]] = []
        try:
            sock.connect(self._replay_address)
            await sock.send_multipart([b"", start.to_bytes(8, "big")])
            async with asyncio.timeout(self._replay_timeout_s):
                while True:
                    frames = await sock.recv_multipart()  # [b"", topic, seq, payload]
                    if len(frames) != 4:
                        continue
                    if frames[2] == _END_SEQ:
                        break
                    out.append((int.from_bytes(frames[2], "big"), frames[3]))
        except TimeoutError:
            log.warning(
                "KV event replay from seq %d timed out after %.1f s (%d batches received)",
                start,
                self._replay_timeout_s,
                len(out),
            )
        finally:
            sock.close(linger=0)
        out.sort(key=lambda item: item[0])
        return out

    def _lose(self, first: int, stop: int) -> None:
        n = stop - first
        self.stats.lost += n
        self.stats.next_seq = stop
        log.warning(
            "KV events: vLLM batches %d..%d are lost (not in the replay buffer); clearing this "
            "engine's advertised blocks so subscribers resync",
            first,
            stop - 1,
        )
        self._emit([AllBlocksCleared(Tier.GPU if self.engine_only else None)])

    def _deliver(self, seq: int, payload: bytes) -> None:
        self.stats.next_seq = seq + 1
        self.stats.delivered += 1
        try:
            events = decode_events(payload, self.engine_only)
        except Exception:
            log.exception("undecodable KV event batch seq=%d; treating it as lost", seq)
            self.stats.lost += 1
            events = [AllBlocksCleared(Tier.GPU if self.engine_only else None)]
        if events:
            self._emit(events)

    def _emit(self, events: list[KvEvent]) -> None:
        if self._sink is None:
            if len(self._pending) == self._pending.maxlen:
                log.warning("KV events: no sink yet; dropping the oldest waiting batch")
            self._pending.append(events)
            return
        self._call_sink(events)

    def _call_sink(self, events: Sequence[KvEvent]) -> None:
        assert self._sink is not None
        try:
            self._sink(events)
        except Exception:
            log.exception("the KV event sink failed on %d events", len(events))
