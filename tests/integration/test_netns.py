"""kvmesh/netns.py on the real kernel: namespaces that reach each other and the root namespace
across the bridge, a shaped link that is slower, a node torn down, and the clean-up: on exit,
on SIGTERM, and of a run killed with SIGKILL (by the next run). Skips without root or netns."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time

import pytest

from kvmesh.netns import PREFIX, NetnsLab, remove_stale, unavailable_reason

pytestmark = pytest.mark.skipif(bool(_why := unavailable_reason()), reason=_why or "-")

_SERVE = "import socket,sys;s=socket.create_server((sys.argv[1],7001));print('up',flush=True);c,_=s.accept();n=0\nwhile d:=c.recv(1<<20): n+=len(d)\nprint(n,flush=True)"
_SEND = "import socket,sys,time;t=time.perf_counter();s=socket.create_connection((sys.argv[1],7001),timeout=20);s.sendall(bytes(int(sys.argv[2])));s.close();print(time.perf_counter()-t)"


def ours() -> set[str]:
    names = set(
        subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
    )
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    names |= {w.split("@")[0] for w in links.replace(":", " ").split() if w.startswith(PREFIX)}
    return {n for n in names if n.startswith(PREFIX)}


def send(lab: NetnsLab, src: int, dst: int, nbytes: int) -> float:
    """Seconds to send ``nbytes`` over TCP from node ``src`` to node ``dst``; checks arrival."""
    a, b = lab.nodes[src], lab.nodes[dst]
    srv = subprocess.Popen(
        ["ip", "netns", "exec", b.name, sys.executable, "-c", _SERVE, b.address],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert srv.stdout is not None and srv.stdout.readline().strip() == "up"
    out = subprocess.run(
        ["ip", "netns", "exec", a.name, sys.executable, "-c", _SEND, b.address, str(nbytes)],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    assert srv.communicate(timeout=30)[0].strip() == str(nbytes)
    return float(out)


def test_nodes_reach_each_other_and_a_shaped_link_is_slower():
    with NetnsLab(2) as lab:
        mine = {n for n in ours() if n.startswith(lab.tag)}
        assert {n.name for n in lab.nodes} | {lab.bridge} <= mine
        fast = send(lab, 0, 1, 4 << 20)
        lab.shape(lab.nodes[1], "tbf", "rate", "16mbit", "burst", "32kb", "latency", "5s")
        slow = send(lab, 0, 1, 4 << 20)  # 4 MiB at 2 MB/s: about 2 s
        lab.unshape(lab.nodes[1])
        assert slow > 1.5 > fast, (fast, slow)
        lab.remove_node(lab.nodes[1])
        assert lab.nodes[1].name not in ours()
    assert not (mine & ours()), "everything of the run is gone"


def test_a_shaped_pair_slows_that_link_only():
    """``shape_pair``: the link between nodes 0 and 1 is slow both ways; node 0 to node 2 and
    the root namespace's traffic are not (htb with a u32 filter per destination)."""
    with NetnsLab(3) as lab:
        lab.shape_pair(lab.nodes[0], lab.nodes[1], "16mbit", "32kb")
        slow = send(lab, 0, 1, 4 << 20)  # 4 MiB at 2 MB/s: about 2 s
        slow_back = send(lab, 1, 0, 4 << 20)
        other = send(lab, 0, 2, 4 << 20)
        lab.unshape(lab.nodes[0])
        lab.unshape(lab.nodes[1])
        again = send(lab, 0, 1, 4 << 20)
    assert slow > 1.5 and slow_back > 1.5, (slow, slow_back)
    assert other < 1.0 and again < 1.0, (other, again)


def test_sigterm_cleans_up_and_a_sigkilled_run_is_cleaned_by_the_next():
    script = textwrap.dedent(
        """
        import sys, time
        from kvmesh.netns import NetnsLab
        lab = NetnsLab(2).up()
        print(lab.tag, flush=True)
        time.sleep(60)
        """
    )
    for sig in (signal.SIGTERM, signal.SIGKILL):
        with subprocess.Popen(
            [sys.executable, "-c", script], stdout=subprocess.PIPE, text=True
        ) as proc:
            assert proc.stdout is not None
            tag = proc.stdout.readline().strip()
            assert any(n.startswith(tag) for n in ours())
            proc.send_signal(sig)
            proc.wait(20)
        if sig == signal.SIGKILL:
            time.sleep(0.2)
            assert any(n.startswith(tag) for n in ours()), "SIGKILL leaves them ..."
            assert any(n.startswith(tag) for n in remove_stale())  # ... the next run removes them
        assert not any(n.startswith(tag) for n in ours()), sig
