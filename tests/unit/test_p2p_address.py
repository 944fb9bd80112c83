"""Which address a peer's libp2p node listens on and announces: one its groupmates can dial."""

from __future__ import annotations

import socket

import pytest

from swarm.net.bulk.transport import Transport
from swarm.net.link.p2p_address import (
    P2PAddress,
    choose_p2p_address,
    free_port,
    maddr,
    only_loopback,
    route_source_address,
    unreachable_sentence,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(60)]


def _own_address() -> str:
    """A non-loopback address of this machine, or skip."""
    address = route_source_address("192.0.2.1")  # TEST-NET-1: only the route is looked up
    if address is None or address.startswith("127."):
        pytest.skip("this machine has no route off loopback to test with")
    return address


def test_a_coordinator_on_loopback_keeps_the_peer_on_loopback():
    assert route_source_address("127.0.0.1") == "127.0.0.1"
    assert choose_p2p_address(coordinator_host="127.0.0.1") == P2PAddress("127.0.0.1", None)
    assert choose_p2p_address(coordinator_host="localhost").listen_host in ("127.0.0.1", "::1")
    assert choose_p2p_address(coordinator_host="127.0.1.1") == P2PAddress("127.0.0.1", None)  # lo sends from .0.1


def test_a_remote_coordinator_makes_the_peer_listen_everywhere_and_announce_its_route_address():
    own = _own_address()
    assert choose_p2p_address(coordinator_host="192.0.2.1") == P2PAddress("0.0.0.0", own)


def test_a_given_announce_host_wins_over_the_route():
    chosen = choose_p2p_address(coordinator_host="127.0.0.1", announce_host="198.51.100.4")
    assert chosen == P2PAddress("0.0.0.0", "198.51.100.4")
    chosen = choose_p2p_address(coordinator_host="192.0.2.1", p2p_host="0.0.0.0", announce_host="198.51.100.4")
    assert chosen == P2PAddress("0.0.0.0", "198.51.100.4")


def test_a_given_listen_address_is_the_announced_one_unless_told_otherwise():
    assert choose_p2p_address(coordinator_host="192.0.2.1", p2p_host="10.1.2.3") == P2PAddress("10.1.2.3", None)
    assert choose_p2p_address(coordinator_host="192.0.2.1", p2p_host="0.0.0.0", announce_host="0.0.0.0") == P2PAddress(
        "0.0.0.0", None
    )


def test_no_route_to_the_coordinator_announces_every_local_address(caplog):
    chosen = choose_p2p_address(coordinator_host="no-such-host.invalid")
    assert chosen == P2PAddress("0.0.0.0", None)
    assert "pass --announce-host" in caplog.text


def test_multiaddrs_and_the_unreachable_sentence():
    assert maddr("10.0.0.2", 7100) == "/ip4/10.0.0.2/tcp/7100"
    assert maddr("::1", 7100) == "/ip6/::1/tcp/7100"
    assert maddr("peer.example.org", 7100) == "/dns/peer.example.org/tcp/7100"
    assert only_loopback(["/ip4/127.0.0.1/tcp/5/p2p/Qm"]) and not only_loopback(["/ip4/10.0.0.2/tcp/5/p2p/Qm"])
    sentence = unreachable_sentence(["/ip4/127.0.0.1/tcp/5"])
    assert sentence == (
        "groupmates cannot reach this peer at /ip4/127.0.0.1/tcp/5; pass --announce-host ADDRESS "
        "reachable from them (and open the port)"
    )


def test_free_port_is_bindable():
    port = free_port("0.0.0.0")
    with socket.socket() as s:
        s.bind(("0.0.0.0", port))


@pytest.fixture(scope="module")
def announcing():
    """Started outside the test: torch's shared-memory manager, which hivemind's DHT starts with its first
    node, must outlive the test (the conftest reaps a test's new child processes)."""
    t = Transport(initial_peers=[], host="0.0.0.0", port=0, announce_host="127.0.0.2")
    yield t
    t.shutdown()


def test_a_transport_on_port_0_announces_the_given_host_with_the_port_it_bound(announcing):
    visible = announcing.visible_maddrs
    assert len(visible) == 1 and visible[0].startswith("/ip4/127.0.0.2/tcp/")
    port = int(visible[0].split("/tcp/")[1].split("/")[0])
    assert port > 0
    with socket.create_connection(("127.0.0.2", port), timeout=5):  # it really listens there
        pass
