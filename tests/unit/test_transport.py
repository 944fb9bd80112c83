"""Starting a peer's DHT transport: a bootstrap peer that does not answer is a clear error, not a hang."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from swarm.net.bulk.transport import Transport, TransportStartFailed

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]
ROOT = Path(__file__).resolve().parents[2]


def test_a_dht_whose_bootstrap_peer_is_gone_fails_to_start_with_a_message():
    gone = Transport(initial_peers=[])
    maddrs = gone.visible_maddrs
    gone.shutdown()

    with pytest.raises(TransportStartFailed, match="the DHT did not start through"):
        Transport(initial_peers=maddrs, start_timeout_s=30)

    again = Transport(initial_peers=[])  # and a transport still starts in this process afterwards
    again.shutdown()


def _children(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = open(f"/proc/{entry}/stat").read()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry))
    return found


def _running(pid: int) -> bool:
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_the_dht_process_and_its_p2pd_end_when_the_process_that_started_them_is_killed():
    """A kill -9 of a peer or coordinator must not leave its DHT node answering in the overlay."""
    code = (
        "import time; from swarm.net.bulk.transport import Transport; t = Transport(initial_peers=[]); "
        "print(t.dht.pid, flush=True); time.sleep(120)"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        dht_pid = int(proc.stdout.readline())
        p2pd = _children(dht_pid)
        assert p2pd, "the DHT process has no p2pd child"
    finally:
        proc.kill()
        proc.wait()
    deadline = time.monotonic() + 20
    while any(_running(pid) for pid in [dht_pid, *p2pd]) and time.monotonic() < deadline:
        time.sleep(0.1)  # polling the process table: there is nothing to await
    assert not any(_running(pid) for pid in [dht_pid, *p2pd]), "the DHT process outlived its parent"


def test_a_dht_process_that_never_hands_over_its_p2p_is_a_start_to_retry_and_the_process_still_exits():
    """On a loaded machine the DHT process once started but did not answer for its p2p daemon within the start
    timeout: the TimeoutError escaped, the peer did not retry, and it never exited (the interpreter waited for the
    DHT process, which waits for its parent to end)."""
    code = (
        "import asyncio, hivemind\n"
        "async def never(self): await asyncio.sleep(3600)\n"
        "hivemind.DHT.replicate_p2p = never\n"
        "from swarm.net.bulk.transport import Transport, TransportStartFailed\n"
        "try:\n"
        "    Transport(initial_peers=[], start_timeout_s=15)\n"
        "except TransportStartFailed as e:\n"
        "    print('refused:', e, flush=True)\n"
    )
    _refused_and_exited(code)


def test_a_dht_process_that_ignores_its_shutdown_is_killed_and_the_process_still_exits():
    """A chaos soak: a restarted peer's DHT process did not hand over its p2p daemon, and outlived both its shutdown
    and SIGTERM; the peer finished its run but its process never exited (the interpreter joins its children)."""
    code = (
        "import signal, time, hivemind\n"
        "async def stuck(dht, node):\n"
        "    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # runs in the DHT process, whose loop it then blocks\n"
        "    time.sleep(3600)\n"
        "hivemind.DHT._get_p2p_daemon_listen_maddr = staticmethod(stuck)\n"
        "from swarm.net.bulk.transport import Transport, TransportStartFailed\n"
        "try:\n"
        "    Transport(initial_peers=[], start_timeout_s=5)\n"
        "except TransportStartFailed as e:\n"
        "    print('refused:', e, flush=True)\n"
    )
    assert "did not end when asked; killing it" in _refused_and_exited(code).stderr


def _refused_and_exited(code: str) -> subprocess.CompletedProcess:
    """Run ``code`` (a failing Transport start) in a fresh interpreter: its start is refused and the process exits."""
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=90)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "refused: the DHT did not start through no peers: transport operation did not finish" in proc.stdout
    return proc
