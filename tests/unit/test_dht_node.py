"""The coordinator's DHT node across restarts: same port when it can, and it dials the peers it knew.

Each scenario runs in a fresh interpreter, as a coordinator does: in one process, after several
hivemind DHTs have started and stopped, torch's shared-memory manager connection that hivemind's
futures use can break ("RuntimeError: Broken pipe") and fail whichever test comes next.
"""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

from coordinator.dht_node import DHTNode
from swarm.net.bulk.transport import Transport

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]
ROOT = Path(__file__).resolve().parents[2]


def _in_fresh_process(scenario: str, tmp_path: Path) -> None:
    code = f"from tests.unit.test_dht_node import {scenario}; from pathlib import Path; {scenario}(Path({str(tmp_path)!r}))"
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=100)
    assert done.returncode == 0, done.stderr[-3000:]


def restart_scenario(state_dir: Path) -> None:
    first = DHTNode(state_dir=state_dir, host="127.0.0.1")
    first.start()
    port, address = first.port, first.initial_peers
    peer = Transport(initial_peers=address)
    first.stop()
    try:
        again = DHTNode(state_dir=state_dir, host="127.0.0.1", previous_port=port)
        assert again.start(bootstrap=peer.visible_maddrs) == address  # the peers' address for it holds
        # it dialed the peer: the peer is connected to it without having done anything
        connected = {str(info.peer_id) for info in peer.run(peer.p2p.list_peers(), timeout_s=10)}
        assert again.initial_peers[0].rsplit("/p2p/", 1)[1] in connected, connected
        again.stop()
    finally:
        peer.shutdown()


def taken_port_scenario(state_dir: Path) -> None:
    gone = Transport(initial_peers=[])
    stale = gone.visible_maddrs
    gone.shutdown()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        node = DHTNode(state_dir=state_dir, host="127.0.0.1", previous_port=taken.getsockname()[1])
        node.start(bootstrap=stale)  # the peer it knew is gone: skipped
        try:
            assert node.port not in (0, taken.getsockname()[1])
            assert node.initial_peers and all(f"/tcp/{node.port}/" in m for m in node.initial_peers)
        finally:
            node.stop()


def test_a_restarted_node_keeps_its_port_and_identity_and_dials_the_peers_it_knew(tmp_path):
    _in_fresh_process("restart_scenario", tmp_path)


def test_a_taken_port_and_peers_that_are_gone_still_leave_a_working_node(tmp_path):
    _in_fresh_process("taken_port_scenario", tmp_path)


def bad_addresses_scenario(state_dir: Path) -> None:
    import time

    gone = Transport(initial_peers=[])
    stale = gone.visible_maddrs  # valid, but nobody listens there any more
    gone.shutdown()
    pid = stale[0].rsplit("/p2p/", 1)[1]
    bootstrap = ["garbage-not-a-multiaddr", "/ip4/127.0.0.1/tcp/1", f"/ip4/10.255.255.1/tcp/9/p2p/{pid}", *stale]
    started = time.monotonic()
    node = DHTNode(state_dir=state_dir, host="127.0.0.1")
    try:
        node.start(bootstrap=bootstrap)
        assert time.monotonic() - started < 20, "a bad stored address held up the start"
        assert node.initial_peers
    finally:
        node.stop()


def test_stored_addresses_that_are_garbage_or_unreachable_do_not_hold_up_a_start(tmp_path):
    _in_fresh_process("bad_addresses_scenario", tmp_path)
