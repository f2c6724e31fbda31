"""The etcd adapter (Registrar, PrefixWatcher) and LocalEtcd on a real etcd: registration, update,
revoke, a killed process's key expiring, etcd restarts, a partition long enough to lose the lease,
and compaction while a watcher is away."""

from __future__ import annotations

import asyncio
import signal
import sys
import time
import uuid
from pathlib import Path

import aetcd
import pytest

from kvmesh.discovery.client import Endpoint, parse_endpoint, parse_endpoints
from kvmesh.discovery.etcd import EtcdUnavailable, PrefixWatcher, Registrar
from kvmesh.discovery.keys import (
    Role,
    WorkerId,
    WorkerRecord,
    WorkerState,
    router_key,
    worker_key,
    workers_prefix,
)
from kvmesh.etcd_server import EtcdStartError, LocalEtcd, find_etcd_binary, free_port
from tests.support import eventually

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]


class Recorder:
    """A consumer of PrefixWatcher: the state it rebuilds and every callback, in order."""

    def __init__(self) -> None:
        self.state: dict[str, str] = {}
        self.calls: list[tuple[str, ...]] = []

    def on_snapshot(self, snapshot: dict[str, str]) -> None:
        self.state = dict(snapshot)
        self.calls.append(("snapshot", *sorted(snapshot)))

    def on_put(self, key: str, value: str) -> None:
        self.state[key] = value
        self.calls.append(("put", key, value))

    def on_delete(self, key: str) -> None:
        self.state.pop(key, None)
        self.calls.append(("delete", key))

    def watcher(self, endpoints: list[str], prefix: str, **kw: float) -> PrefixWatcher:
        return PrefixWatcher(endpoints, prefix, self.on_snapshot, self.on_put, self.on_delete, **kw)


def new_cluster() -> str:
    return f"t{uuid.uuid4().hex[:10]}"


def record(wid: str, state: WorkerState = WorkerState.SERVING) -> str:
    return WorkerRecord(
        worker_id=WorkerId(wid),
        address="127.0.0.1:9",
        model="m",
        model_path="/m",
        state=state,
    ).to_json()


# -- Registrar -----------------------------------------------------------------------------------


async def test_registrar_puts_updates_and_revokes(etcd: LocalEtcd, etcd_client: aetcd.Client):
    key = worker_key(new_cluster(), Role.BOTH, "w1")
    reg = Registrar(etcd.endpoints, key, record("w1"), ttl_s=3)
    await reg.start()
    try:
        stored = await etcd_client.get(key.encode())
        assert stored is not None and stored.value.decode() == record("w1")
        assert reg.lease_id is not None and stored.lease == reg.lease_id
        info = await etcd_client.get_lease_info(reg.lease_id)
        assert info.grantedTTL == 3

        await reg.update(record("w1", WorkerState.DRAINING))
        stored = await etcd_client.get(key.encode())
        assert stored is not None
        assert WorkerRecord.from_json(stored.value).state is WorkerState.DRAINING
        assert stored.lease == reg.lease_id  # same lease: the update does not extend life
        assert reg.connected
    finally:
        await reg.close(revoke=True)
    assert await etcd_client.get(key.encode()) is None, "revoke deletes the key at once"


async def test_keepalive_outlives_the_ttl(etcd: LocalEtcd, etcd_client: aetcd.Client):
    key = worker_key(new_cluster(), Role.DECODE, "w1")
    async with Registrar(etcd.endpoints, key, "v", ttl_s=1) as reg:
        await asyncio.sleep(2.5)  # 2.5 TTLs
        assert await etcd_client.get(key.encode()) is not None
        assert reg.connected


async def test_close_without_revoke_leaves_the_key_until_the_ttl(
    etcd: LocalEtcd, etcd_client: aetcd.Client
):
    key = worker_key(new_cluster(), Role.BOTH, "w1")
    reg = Registrar(etcd.endpoints, key, "v", ttl_s=2)
    await reg.start()
    await reg.close(revoke=False)
    assert await etcd_client.get(key.encode()) is not None
    start = time.monotonic()
    while await etcd_client.get(key.encode()) is not None:
        assert time.monotonic() - start < 3.5, "key outlived its 2 s lease"
        await asyncio.sleep(0.1)


@pytest.mark.parametrize("kind", ["registrar", "watcher"])
async def test_start_fails_fast_and_names_the_endpoint(kind: str):
    endpoint = f"127.0.0.1:{free_port()}"  # nothing listens there
    if kind == "registrar":
        component = Registrar([endpoint], "/kvmesh/x/k", "v", op_timeout_s=1.0)
    else:
        component = Recorder().watcher([endpoint], "/kvmesh/x/", op_timeout_s=1.0)
    start = time.monotonic()
    with pytest.raises(EtcdUnavailable, match=endpoint):
        await component.start()
    assert time.monotonic() - start < 2.0
    await component.close()  # harmless after a failed start


# -- PrefixWatcher -------------------------------------------------------------------------------


async def test_watcher_snapshot_then_events_in_order(etcd: LocalEtcd, etcd_client: aetcd.Client):
    cluster = new_cluster()
    old_key = worker_key(cluster, Role.PREFILL, "old")
    await etcd_client.put(old_key.encode(), b"old-value")
    await etcd_client.put(router_key(cluster, "r1").encode(), b"not a worker")  # other prefix
    rec = Recorder()
    watcher = rec.watcher(etcd.endpoints, workers_prefix(cluster))
    await watcher.start()
    try:
        assert rec.calls == [("snapshot", old_key)]
        assert rec.state == {old_key: "old-value"}
        assert watcher.connected and watcher.snapshots == 1

        key = worker_key(cluster, Role.BOTH, "w1")
        reg = Registrar(etcd.endpoints, key, record("w1"), ttl_s=3)
        await reg.start()
        seen_s = await eventually(lambda: key in rec.state, 1.0, "watcher sees the registration")
        assert seen_s < 1.0
        await reg.update(record("w1", WorkerState.DRAINING))
        await eventually(lambda: len(rec.calls) == 3, 1.0, "watcher sees the update")
        await reg.close()
        await eventually(lambda: key not in rec.state, 1.0, "watcher sees the revoke")
        await etcd_client.delete(old_key.encode())
        await eventually(lambda: not rec.state, 1.0, "watcher sees a plain delete")

        assert rec.calls[1:] == [
            ("put", key, record("w1")),
            ("put", key, record("w1", WorkerState.DRAINING)),
            ("delete", key),
            ("delete", old_key),
        ]
        now = (await etcd_client.get_prefix(b"/")).header.revision
        assert watcher.last_revision == now
    finally:
        await watcher.close()


async def test_a_failing_callback_does_not_stop_the_watch(
    etcd: LocalEtcd, etcd_client: aetcd.Client
):
    prefix = workers_prefix(new_cluster())
    seen: list[str] = []

    def on_put(key: str, value: str) -> None:
        seen.append(value)
        if value == "boom":
            raise RuntimeError("consumer bug")

    async with PrefixWatcher(etcd.endpoints, prefix, lambda s: None, on_put, lambda k: None) as w:
        await etcd_client.put(f"{prefix}both/a".encode(), b"boom")
        await etcd_client.put(f"{prefix}both/a".encode(), b"fine")
        await eventually(lambda: seen == ["boom", "fine"], 1.0, "both puts delivered")
        assert w.connected


async def test_killed_process_disappears_within_its_ttl(etcd: LocalEtcd):
    cluster = new_cluster()
    key = worker_key(cluster, Role.BOTH, "doomed")
    rec = Recorder()
    script = (
        "import asyncio, sys\n"
        "from kvmesh.discovery.etcd import Registrar\n"
        "async def main():\n"
        "    await Registrar([sys.argv[1]], sys.argv[2], 'alive', ttl_s=2).start()\n"
        "    print('registered', flush=True)\n"
        "    await asyncio.Event().wait()\n"
        "asyncio.run(main())\n"
    )
    async with rec.watcher(etcd.endpoints, workers_prefix(cluster)):
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-c",
            script,
            etcd.endpoint,
            key,
            cwd=REPO,
            stdout=asyncio.subprocess.PIPE,
        )
        try:
            line = await asyncio.wait_for(proc.stdout.readline(), 20)  # type: ignore[union-attr]
            assert line.strip() == b"registered"
            await eventually(lambda: rec.state.get(key) == "alive", 1.0, "watcher sees the worker")
            await asyncio.sleep(1.0)  # a few keepalives
            assert key in rec.state
            proc.send_signal(signal.SIGKILL)
            killed_at = time.monotonic()
        finally:
            if proc.returncode is None:
                proc.kill()
            await proc.wait()
        await eventually(lambda: key not in rec.state, 4.0, "the dead worker's key expires")
        gone_after_s = time.monotonic() - killed_at
        # TTL 2 s counted from the last keepalive (<= 0.67 s before the kill); etcd checks expiry
        # every 0.5 s.
        assert 1.0 < gone_after_s < 3.0, gone_after_s
        assert rec.calls[-1] == ("delete", key)


# -- outages -------------------------------------------------------------------------------------


async def test_etcd_restart_watcher_keeps_state_and_resumes(private_etcd: LocalEtcd):
    cluster = new_cluster()
    prefix = workers_prefix(cluster)
    key = worker_key(cluster, Role.BOTH, "w1")
    other = worker_key(cluster, Role.BOTH, "other")
    assert private_etcd.client_port is not None
    client = aetcd.Client(host=private_etcd.host, port=private_etcd.client_port, timeout=5)
    rec = Recorder()
    watcher = rec.watcher(private_etcd.endpoints, prefix)
    reg = Registrar(private_etcd.endpoints, key, record("w1"), ttl_s=3)
    try:
        await client.put(other.encode(), b"x")
        await watcher.start()
        await reg.start()
        await eventually(lambda: key in rec.state, 1.0, "registration seen")
        before = dict(rec.state)
        calls_before = len(rec.calls)

        await private_etcd.astop()
        await eventually(lambda: not watcher.connected, 3.0, "watcher notices etcd is down")
        await eventually(lambda: not reg.connected, 3.0, "registrar notices etcd is down")
        await asyncio.sleep(1.0)
        assert rec.state == before, "the last state is kept while etcd is down"
        assert len(rec.calls) == calls_before, "no callbacks while etcd is down"

        await private_etcd.astart()  # same ports, same data
        await eventually(lambda: watcher.connected, 3.0, "watcher reconnects by itself")
        await eventually(lambda: reg.connected, 3.0, "registrar reconnects by itself")
        stored = await client.get(key.encode())
        assert stored is not None and stored.value.decode() == record("w1")

        new = worker_key(cluster, Role.DECODE, "new")
        await client.put(new.encode(), b"y")
        await client.delete(other.encode())
        await reg.update(record("w1", WorkerState.DRAINING))
        expected = {new: "y", key: record("w1", WorkerState.DRAINING)}
        await eventually(lambda: rec.state == expected, 2.0, "changes after the restart seen")
        assert watcher.snapshots == 1, "resumed from the last revision, no re-list needed"
    finally:
        await reg.close()
        await watcher.close()
        await client.close()


async def test_lease_lost_during_partition_is_granted_again(
    etcd: LocalEtcd, etcd_client: aetcd.Client, tcp_proxy
):
    cluster = new_cluster()
    key = worker_key(cluster, Role.BOTH, "w1")
    proxy = await tcp_proxy()
    rec = Recorder()
    async with rec.watcher(etcd.endpoints, workers_prefix(cluster)):  # direct, not partitioned
        reg = Registrar([proxy.endpoint], key, record("w1"), ttl_s=2)
        await reg.start()
        try:
            first_lease = reg.lease_id
            await eventually(lambda: key in rec.state, 1.0, "registration seen")
            await proxy.cut()  # etcd stays up, the registrar cannot reach it
            await eventually(lambda: key not in rec.state, 4.0, "lease expires in the partition")
            await proxy.resume()
            await eventually(lambda: key in rec.state, 3.0, "registrar puts the key again")
            assert reg.lease_id != first_lease
            stored = await etcd_client.get(key.encode())
            assert stored is not None and stored.lease == reg.lease_id
        finally:
            await reg.close()


async def test_update_during_partition_is_written_when_back(
    etcd: LocalEtcd, etcd_client: aetcd.Client, tcp_proxy
):
    key = worker_key(new_cluster(), Role.BOTH, "w1")
    proxy = await tcp_proxy()
    reg = Registrar([proxy.endpoint], key, record("w1"), ttl_s=3, op_timeout_s=1.0)
    await reg.start()
    try:
        await proxy.cut()
        with pytest.raises(EtcdUnavailable, match="will be written when etcd is back"):
            await reg.update(record("w1", WorkerState.DRAINING))
        await proxy.resume()

        async def stored_state() -> WorkerState | None:
            got = await etcd_client.get(key.encode())
            return WorkerRecord.from_json(got.value).state if got else None

        start = time.monotonic()
        while await stored_state() is not WorkerState.DRAINING:
            assert time.monotonic() - start < 3.0, "the pending update was never written"
            await asyncio.sleep(0.05)
    finally:
        await reg.close()


async def test_watcher_relists_after_compaction_while_away(
    etcd: LocalEtcd, etcd_client: aetcd.Client, tcp_proxy
):
    cluster = new_cluster()
    prefix = workers_prefix(cluster)
    keep, drop, add = (worker_key(cluster, Role.BOTH, w) for w in ("keep", "drop", "add"))
    await etcd_client.put(keep.encode(), b"1")
    await etcd_client.put(drop.encode(), b"2")
    proxy = await tcp_proxy()
    rec = Recorder()
    async with rec.watcher([proxy.endpoint], prefix) as watcher:
        seen_revision = watcher.last_revision
        await proxy.cut()
        await eventually(lambda: not watcher.connected, 3.0, "watcher notices the partition")
        await etcd_client.delete(drop.encode())
        await etcd_client.put(add.encode(), b"3")
        head = await etcd_client.put(router_key(cluster, "r").encode(), b"bump")
        await etcd_client.compact(head.header.revision, physical=True)
        assert head.header.revision > seen_revision + 1
        await proxy.resume()
        await eventually(lambda: watcher.snapshots == 2, 3.0, "a fresh snapshot after compaction")
        assert rec.state == {keep: "1", add: "3"}
        assert rec.calls[-1] == ("snapshot", add, keep)
        assert watcher.last_revision >= head.header.revision
        await eventually(lambda: watcher.connected, 2.0, "watching again after the re-list")
        await etcd_client.put(keep.encode(), b"4")
        await eventually(lambda: rec.state[keep] == "4", 1.0, "events after the re-list")


# -- endpoints and LocalEtcd ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("127.0.0.1:2379", Endpoint("127.0.0.1", 2379)),
        ("http://etcd:2380", Endpoint("etcd", 2380)),
        ("http://etcd:2380/", Endpoint("etcd", 2380)),
        ("etcd", Endpoint("etcd", 2379)),
        ("[::1]:4001", Endpoint("::1", 4001)),
        (" host:1 ", Endpoint("host", 1)),
    ],
    ids=["ip-port", "url", "url-slash", "default-port", "ipv6", "spaces"],
)
def test_parse_endpoint(raw: str, expected: Endpoint):
    assert parse_endpoint(raw) == expected


@pytest.mark.parametrize(
    "raw",
    ["", ":2379", "h:port", "h:0", "h:70000", "::1:2379", "[::1"],
    ids=["empty", "no-host", "port-not-number", "port-zero", "port-too-big", "bare-ipv6", "open-["],
)
def test_parse_endpoint_rejects(raw: str):
    with pytest.raises(ValueError, match="bad etcd endpoint"):
        parse_endpoint(raw)


def test_parse_endpoints_wants_a_list():
    with pytest.raises(TypeError):
        parse_endpoints("127.0.0.1:2379")
    with pytest.raises(ValueError, match="no etcd endpoints"):
        parse_endpoints([])
    assert str(parse_endpoints(["[::1]:1"])[0]) == "[::1]:1"


def test_find_etcd_binary_explains_how_to_install():
    with pytest.raises(FileNotFoundError, match="apt-get install etcd-server"):
        find_etcd_binary("etcd-that-does-not-exist")
    assert Path(find_etcd_binary()).name == "etcd"


def test_local_etcd_restart_keeps_ports_and_data(tmp_path: Path):
    with LocalEtcd(data_dir=tmp_path) as server:
        endpoint, first_pid = server.endpoint, server.pid
        server.restart()
        assert server.endpoint == endpoint and server.pid != first_pid and server.running
        server.kill()
        assert not server.running
        server.start()
        assert server.endpoint == endpoint
    assert not server.running
    assert (tmp_path / "etcd.log").exists(), "a given data dir is kept"
    assert (tmp_path / "etcd" / "member").is_dir()


def test_local_etcd_refuses_a_taken_port(etcd: LocalEtcd, tmp_path: Path):
    other = LocalEtcd(data_dir=tmp_path, start_timeout_s=3)
    other.client_port, other.peer_port = etcd.client_port, free_port()
    with pytest.raises(EtcdStartError, match="in use"):
        other.start()
    other.close()
    assert etcd.running


def test_local_etcd_reports_the_log_when_etcd_fails(tmp_path: Path):
    server = LocalEtcd(data_dir=tmp_path, extra_args=["--no-such-flag"])
    with pytest.raises(EtcdStartError, match="no-such-flag"):
        server.start()
    assert not server.running
