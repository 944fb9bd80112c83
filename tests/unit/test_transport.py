"""Starting a peer's DHT transport: a bootstrap peer that does not answer is a clear error, not a hang."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from swarm.net.transport import Transport, TransportStartFailed

pytestmark = pytest.mark.timeout(120)
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
    code = ("import time; from swarm.net.transport import Transport; t = Transport(initial_peers=[]); "
            "print(t.dht.pid, flush=True); time.sleep(120)")
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
