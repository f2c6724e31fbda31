"""Three nodes on one machine, each a network namespace of its own (kvmesh/netns.py): per node a
kvmanager and one real vLLM worker on the tiny model, listening on the node's address; etcd
and the router in the root namespace on the bridge. Between the nodes the KV bytes cross real
(virtual) links: veth pairs and a bridge.

* A conversation that moves to another node has its prefix fetched from the first node's
  kvmanager (the router's peer hint, FetchFromPeer over the data plane, checksummed), seen in
  the usage (cached_peer_tokens), in both kvmanagers' metrics, with the output a recompute gives.
* One slow link (node 0 <-> node 1 at 512 kbit/s, ``NetnsLab.shape_pair``: this kernel has no
  ``sch_netem``, so a rate limit rather than a delay) and one fast (node 0 <-> node 2): once the
  slow link's speed is measured (node 1's kvmanager publishes it) the router stops naming node 0
  to node 1's worker and it recomputes; node 2's worker keeps fetching from node 0, the link's
  speed measured too.
* A node's whole namespace torn down under load: no request lost (the router's resume).

The router runs round-robin over the three workers (sorted by id: node 0, 1, 2), and the tests
steer a request to a node with tiny filler requests (``to_node``). The module skips, saying why,
where namespaces cannot be made (not root, no ``ip``).
"""

from __future__ import annotations

import asyncio
import functools
import random
import re
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import aetcd
import pytest

from kvmesh.client import Completion, RouterClient, make_request
from kvmesh.discovery.keys import KvManagerRecord, kvmanager_key
from kvmesh.launcher import MeshSpec
from kvmesh.netns import NodesMesh, unavailable_reason

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(bool(_why := unavailable_reason()), reason=_why or "-"),
]

NODES = 3
PREFIX_TOKENS = 640  # 20 blocks of 32
THINK_S = 0.8  # between turns: the kvmanager's tier events reach the router meanwhile
# Per stream under load: node 1 goes once all six streams have their first tokens, so its own
# streams must still be running then. At 64 tokens they had finished in a whole-suite run (first
# tokens on three engines sharing two cores came that far apart), and nothing was resumed. The
# engines run float32 (the fixture), where a greedy stream does not hang on bf16 near-ties.
# Long enough that node 1's streams are still running when its namespace goes (320 tokens
# finished first once the engine's step got cheaper, 2026-12-07: no stream left to resume);
# the load ignores EOS, and so must its recomputed references.
LOAD_TOKENS = 1000
# The slow link: 512 kbit/s both ways. The prefix's 20 blocks (about 0.33 MB on the tiny model)
# would take ~5 s, past the connector's 2 s peer_fetch timeout.
SLOW_RATE = "512kbit"


@pytest.fixture(scope="module")
def nodes(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[NodesMesh]:
    spec = MeshSpec(
        model_path=tiny_model,
        served_model_name="tiny",
        workers=1,
        max_model_len=2048,
        kv_cache_bytes=64 << 20,
        kvmanager_cpu_bytes=256 << 20,
        router_policy="round-robin",
        worker_args=("--dtype", "float32"),  # outputs compared token for token
        log_dir=tmp_path_factory.mktemp("multinode"),
    )
    with NodesMesh(spec, nodes=NODES) as m:
        yield m


def prompt(seed: int, n: int = PREFIX_TOKENS) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(5, 1000) for _ in range(n)]


def scrape(url: str) -> dict[str, float]:
    """A Prometheus text page: metric name (with labels) -> value."""
    with urllib.request.urlopen(url, timeout=5) as resp:
        text = resp.read().decode()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def peer_counters(nodes: NodesMesh, i: int) -> dict[str, float]:
    """Node ``i``'s kvmanager: its peer fetch and data plane counters."""
    kvm = nodes.nodes[i].kvmanager
    assert kvm is not None
    got = scrape(kvm.ready["metrics"].removesuffix("/metrics") + "/metrics")
    return {k: v for k, v in got.items() if re.match(r"kvmesh_kvmanager_(peer|data_plane)_", k)}


async def counters_after(
    nodes: NodesMesh, before: list[dict[str, float]], node: int, blocks: int, wait_s: float = 6.0
) -> list[dict[str, float]]:
    """Both nodes' counters once node ``node`` shows ``blocks`` more fetched (or ``wait_s``)."""
    deadline = time.monotonic() + wait_s
    while True:
        after = [peer_counters(nodes, i) for i in range(len(before))]
        key = "kvmesh_kvmanager_peer_blocks_fetched_total"
        if delta(after[node], before[node], key) >= blocks or time.monotonic() > deadline:
            await asyncio.sleep(2.5)  # the serving side's counters refresh on their own clock
            return [peer_counters(nodes, i) for i in range(len(before))]
        await asyncio.sleep(0.5)


def worker_node(nodes: NodesMesh, worker_id: str) -> int:
    for i, mesh in enumerate(nodes.nodes):
        if any(w.name == worker_id for w in mesh.workers):
            return i
    raise AssertionError(f"worker {worker_id} on no node")


def delta(after: dict[str, float], before: dict[str, float], key: str) -> float:
    return after.get(key, 0.0) - before.get(key, 0.0)


async def to_node(client: RouterClient, nodes: NodesMesh, target: int) -> None:
    """Tiny filler requests until the router's round-robin sends the next request to node
    ``target`` (it picks the workers in id order: node 0, 1, 2, ...)."""
    n = len([m for m in nodes.nodes if m.workers])
    for _ in range(n + 1):
        c = await client.complete(
            make_request(prompt(time.monotonic_ns(), 8), max_tokens=1, temperature=0.0),
            timeout_s=60,
        )
        assert c.usage is not None
        if worker_node(nodes, c.usage.worker_id) == (target - 1) % n:
            return
    raise AssertionError(f"round-robin never reached the node before node {target}")


async def two_turns(
    client: RouterClient, nodes: NodesMesh, seed: int, first: int, second: int
) -> tuple[Completion, Completion, list[int]]:
    """Turn 1 on node ``first``, turn 2 (history + answer + a new message) on node ``second``."""
    history = prompt(seed)
    await to_node(client, nodes, first)
    one = await client.complete(
        make_request(history, max_tokens=8, temperature=0.0, session_id=f"s{seed}"), timeout_s=60
    )
    history += one.token_ids + prompt(seed + 1000, 40)
    await asyncio.sleep(THINK_S)
    await to_node(client, nodes, second)
    two = await client.complete(
        make_request(history, max_tokens=16, temperature=0.0, session_id=f"s{seed}"), timeout_s=60
    )
    assert one.usage is not None and two.usage is not None
    assert worker_node(nodes, one.usage.worker_id) == first, one.usage
    assert worker_node(nodes, two.usage.worker_id) == second, two.usage
    return one, two, history


async def recompute(
    client: RouterClient, tokens: list[int], max_tokens: int, ignore_eos: bool = False
) -> Completion:
    """The same prompt under a cache salt of its own: no cache anywhere, computed from scratch."""
    c = await client.complete(
        make_request(
            tokens,
            max_tokens=max_tokens,
            temperature=0.0,
            ignore_eos=ignore_eos,
            cache_salt=f"r{time.monotonic_ns()}",
        ),
        timeout_s=60,
    )
    assert c.usage is not None and c.usage.cached_prompt_tokens == 0
    return c


async def test_moved_conversation_fetches_its_prefix_from_the_other_node(nodes: NodesMesh):
    src, dst = 0, 1
    async with RouterClient(nodes.router_address) as client:
        await client.wait_for_models()
        before = [peer_counters(nodes, i) for i in range(NODES)]
        first, second, history = await two_turns(client, nodes, seed=1, first=src, second=dst)
        ref = await recompute(client, history, 16)
    assert first.usage is not None and second.usage is not None
    # The moved turn's prefix came from the peer node, not from a recompute ...
    assert second.usage.cached_peer_tokens >= PREFIX_TOKENS, second.usage
    # The kvmanagers' counters (refreshed every 2 s): the moved turn's node fetched the prefix's
    # blocks, and the first node's data plane, on its own address across the link, sent them.
    after = await counters_after(nodes, before, dst, PREFIX_TOKENS // 32)
    fetched = delta(after[dst], before[dst], "kvmesh_kvmanager_peer_blocks_fetched_total")
    sent = delta(after[src], before[src], "kvmesh_kvmanager_data_plane_blocks_sent_total")
    moved = delta(after[dst], before[dst], "kvmesh_kvmanager_peer_bytes_fetched_total")
    assert fetched >= PREFIX_TOKENS // 32, (before, after)
    assert sent >= fetched, "the first node's data plane sent what the other fetched"
    third = 3 - src - dst
    assert delta(after[third], before[third], "kvmesh_kvmanager_data_plane_blocks_sent_total") == 0
    kvm = nodes.nodes[src].kvmanager
    assert kvm is not None and kvm.ready["data_plane"].startswith(nodes.lab.nodes[src].address)
    print(f"\npeer fetch across the link: {fetched:.0f} blocks, {moved / 1e6:.2f} MB")
    # ... and the output is the one a cold recompute of the whole prompt gives.
    assert second.token_ids == ref.token_ids


async def published_link(nodes: NodesMesh, fetcher: int, peer: int, wait_s: float = 15.0) -> float:
    """The speed node ``fetcher``'s kvmanager published for its fetches from node ``peer``
    (its etcd record's ``peer_s_per_token``), s/token; 0 if none within ``wait_s``."""
    host, _, port = nodes.etcd_endpoints[0].rpartition(":")
    key = kvmanager_key(nodes.spec.cluster, nodes.lab.nodes[fetcher].name).encode()
    client = aetcd.Client(host=host, port=int(port), timeout=5)
    try:
        deadline = time.monotonic() + wait_s
        while True:
            got = await client.get(key)
            links = KvManagerRecord.from_json(got.value).peer_s_per_token if got else {}
            rates = links.get(nodes.lab.nodes[peer].name, {})
            if rates or time.monotonic() > deadline:
                return max(rates.values(), default=0.0)
            await asyncio.sleep(0.25)
    finally:
        await client.close()


def routed(nodes: NodesMesh, request_id: str) -> str:
    """The router's log line for the request's routing decision."""
    assert nodes.router is not None
    log = nodes.router.log_path.read_text(errors="replace")
    lines = re.findall(rf"request {re.escape(request_id)} -> .*", log)
    assert lines, f"no routing line for {request_id}"
    return lines[-1]


async def test_a_slow_link_is_priced_out_and_a_fast_one_kept(nodes: NodesMesh):
    """The router prices a peer fetch with the measured speed of that link (core/peer_cost.py).
    Node 0 holds each conversation's prefix; its link to node 1 is slowed to 512 kbit/s."""
    lab = nodes.lab
    a, b = lab.nodes[:2]
    lab.shape_pair(a, b, SLOW_RATE)
    try:
        async with RouterClient(nodes.router_address) as client:
            await client.wait_for_models()
            # 1. The link is not measured yet: the router names node 0 and tells the worker how
            # long the fetch is worth waiting for; the fetch gives up there (not at the 2 s
            # peer_fetch timeout) and what it got measures the link.
            _, probe, probe_hist = await two_turns(client, nodes, seed=3, first=0, second=1)
            probe_line = routed(nodes, probe.request_id)
            slow_link = await published_link(nodes, 1, 0)
            await asyncio.sleep(0.5)  # the router's etcd watch
            # 2. Measured slow: node 0 is not named; node 1's worker recomputes the prefix.
            _, skip, skip_hist = await two_turns(client, nodes, seed=4, first=0, second=1)
            await to_node(client, nodes, 1)
            cold = await recompute(client, skip_hist, 16)  # the same prompt cold on node 1
            # 3. Node 2's link to node 0 is fast: fetched, until measured, and then still.
            # (A quick fetch is no sample on its own: the kvmanager waits for 4096 tokens or
            # 0.1 s of them, rates.py.)
            fast_link, fetches = 0.0, 0
            while not fast_link and fetches < 12:
                await two_turns(client, nodes, seed=10 + fetches, first=0, second=2)
                fetches += 1
                if fetches >= 5:
                    fast_link = await published_link(nodes, 2, 0, wait_s=2.5)
            await asyncio.sleep(0.5)
            _, fast, fast_hist = await two_turns(client, nodes, seed=30, first=0, second=2)
            refs = [await recompute(client, h, 16) for h in (probe_hist, skip_hist, fast_hist)]
    finally:
        lab.unshape(a)
        lab.unshape(b)
    assert probe.usage is not None and skip.usage is not None and fast.usage is not None
    assert cold.usage is not None
    # 1: named, with a budget; much sooner than the 2 s timeout a fetch waited before.
    assert f" peer={a.name} " in probe_line and "max_fetch_s=" in probe_line, probe_line
    assert probe.usage.time_to_first_token_s < 1.5, probe.usage
    assert slow_link > 1e-3, f"node 1 measured its link to node 0: {slow_link} s/token"
    # 2: not named, said why; nothing came from a peer; TTFT that of a cold recompute.
    skip_line = routed(nodes, skip.request_id)
    assert " peer=" not in skip_line and f"peer_skipped={a.name}" in skip_line, skip_line
    assert skip.usage.cached_peer_tokens == 0, skip.usage
    assert skip.usage.time_to_first_token_s < cold.usage.time_to_first_token_s + 0.5
    # 3: the fast link measured, and still used.
    assert fast_link and fast_link < slow_link / 10, (fast_link, slow_link)
    fast_line = routed(nodes, fast.request_id)
    assert f" peer={a.name} " in fast_line and "probe" not in fast_line, fast_line
    assert fast.usage.cached_peer_tokens >= PREFIX_TOKENS, fast.usage
    # Every answer is the one a cold recompute gives.
    assert [probe.token_ids, skip.token_ids, fast.token_ids] == [r.token_ids for r in refs]
    print(
        f"\nslow link (512 kbit/s) measured {slow_link:.2e} s/token, fast link"
        f" {fast_link:.2e} s/token (after {fetches} fetches);"
        f" turn-2 TTFT: first over the slow link {probe.usage.time_to_first_token_s:.3f} s"
        f" (peer tokens {probe.usage.cached_peer_tokens}), slow link priced out"
        f" {skip.usage.time_to_first_token_s:.3f} s (cold recompute on that node"
        f" {cold.usage.time_to_first_token_s:.3f} s), fast link"
        f" {fast.usage.time_to_first_token_s:.3f} s (peer tokens {fast.usage.cached_peer_tokens})"
        f"\n  {probe_line}\n  {skip_line}\n  {fast_line}"
    )


async def test_node_namespace_torn_down_under_load(nodes: NodesMesh):
    prompts = [prompt(100 + i, 200) for i in range(6)]
    async with RouterClient(nodes.router_address) as client:
        await client.wait_for_models()
        reqs = [
            make_request(
                p, max_tokens=LOAD_TOKENS, temperature=0.0, ignore_eos=True, session_id=f"l{i}"
            )
            for i, p in enumerate(prompts)
        ]
        started: set[int] = set()
        all_started = asyncio.Event()

        def on_chunk(i: int, chunk: object) -> None:
            if getattr(chunk, "token_ids", None):
                started.add(i)
                if len(started) == len(reqs):
                    all_started.set()

        tasks = [
            asyncio.create_task(
                client.complete(r, timeout_s=120, on_chunk=functools.partial(on_chunk, i))
            )
            for i, r in enumerate(reqs)
        ]
        # Every stream mid-stream (three engines on two cores: a first token can take a second
        # or more), then node 1 goes: the streams there must resume elsewhere.
        await asyncio.wait_for(all_started.wait(), 60)
        await asyncio.to_thread(nodes.kill_node, 1)
        done = await asyncio.gather(*tasks)
        survivors = {w.name for i in (0, 2) for w in nodes.nodes[i].workers}
        refs = [await recompute(client, p, LOAD_TOKENS, ignore_eos=True) for p in prompts]
    where = [(c.usage.worker_id, c.usage.resumes) for c in done if c.usage is not None]
    assert len(where) == len(done) and all(len(c.token_ids) == LOAD_TOKENS for c in done), where
    resumed = [i for i, c in enumerate(done) if c.usage is not None and c.usage.resumes > 0]
    assert resumed, f"some streams were on the node torn down, and went on elsewhere: {where}"
    # A resumed stream is the uninterrupted one (docs/failover.md): the tokens of a recompute.
    assert [done[i].token_ids for i in resumed] == [refs[i].token_ids for i in resumed], where
    # A resumed stream ended on a survivor; one that had finished on node 1 before it went
    # down is as good as any.
    assert all(done[i].usage.worker_id in survivors for i in resumed), where  # type: ignore[union-attr]
    same = sum(c.token_ids == r.token_ids for c, r in zip(done, refs, strict=True))
    print(
        f"\nnode 1 torn down: {len(resumed)} of {len(done)} requests resumed on {survivors};"
        f" {same} of {len(done)} equal to a solo recompute; {where}"
    )
