"""Peers that announce an address their groupmates cannot dial: the exchange says which groupmate could
not be reached, at which address, and what to pass, instead of a bare send error every round."""

from __future__ import annotations

from typing import Iterator

import pytest
import torch

from swarm.net.bulk.transport import Transport
from swarm.net.exchange.allreduce import Exchange, ExchangeFailed
from swarm.net.exchange.rendezvous import Member, group_key
from swarm.net.link.reachability import is_dial_failure, shown_maddrs, unreachable_groupmate
from tests.unit.test_exchange import concurrently

pytestmark = [pytest.mark.slow, pytest.mark.timeout(90)]
RUN_ID = "run-test-unreachable"


@pytest.fixture(scope="module")
def misannounced() -> Iterator[tuple[list[Transport], list[Exchange]]]:
    """Two nodes that listen on 127.0.0.1 but announce 127.0.0.2, where nothing listens, joined through
    a bootstrap node that is reachable (and their exchanges: all made outside the test, see
    test_p2p_address.announcing)."""
    started: list[Transport] = []
    try:
        started.append(Transport(initial_peers=[]))
        for _ in range(2):
            started.append(
                Transport(initial_peers=started[0].visible_maddrs, host="127.0.0.1", announce_host="127.0.0.2")
            )
        yield started[1:], [Exchange(t, run_id=RUN_ID) for t in started[1:]]
    finally:
        for t in reversed(started):
            t.shutdown()


def test_each_peer_names_the_groupmate_it_cannot_reach_and_tells_how_to_fix_its_own_address(misannounced, caplog):
    transports, exchanges = misannounced
    assert all(e.own_maddrs.startswith("/ip4/127.0.0.2/tcp/") for e in exchanges)
    group = [
        Member(
            peer_id=f"p{i}", dht_peer_id=t.peer_id, index=i, weight=1.0, numel=1000, codec="fp32", maddrs=e.own_maddrs
        )
        for i, (t, e) in enumerate(zip(transports, exchanges))
    ]
    key = group_key(RUN_ID, 1)
    outcomes = concurrently(
        [
            lambda i=i: exchanges[i].average(key=key, group=group, me=group[i], delta=torch.ones(1000), timeout_s=20)
            for i in range(2)
        ],
        timeout_s=60,
    )
    for i, outcome in enumerate(outcomes):
        assert isinstance(outcome, ExchangeFailed), outcome
        other = group[1 - i]
        assert f"cannot reach groupmate {other.peer_id} at {other.maddrs} (" in str(outcome)
        assert (
            f"groupmates cannot reach this peer at {group[i].maddrs}; pass --announce-host ADDRESS reachable "
            "from them (and open the port)"
        ) in str(outcome)
    assert caplog.text.count("groupmates cannot reach this peer") == 2  # once per peer

    # the next round fails the same way, and the peers do not log the fix again
    again = concurrently(
        [
            lambda i=i: exchanges[i].average(
                key=group_key(RUN_ID, 2), group=group, me=group[i], delta=torch.ones(1000), timeout_s=20
            )
            for i in range(2)
        ],
        timeout_s=60,
    )
    assert all(isinstance(o, ExchangeFailed) and "cannot reach groupmate" in str(o) for o in again)
    assert caplog.text.count("groupmates cannot reach this peer") == 2


def test_dial_failures_are_told_apart_and_shown_bounded():
    assert is_dial_failure(RuntimeError("failed to find any peer in table: routing: not found"))
    assert is_dial_failure(RuntimeError("failed to dial QmX: all dials failed"))
    assert not is_dial_failure(RuntimeError("stream reset"))
    shown = shown_maddrs([f"/ip4/10.0.0.{i}/tcp/7100/p2p/QmPeer" for i in range(9)])
    assert shown == " ".join(f"/ip4/10.0.0.{i}/tcp/7100" for i in range(3))
    reason = unreachable_groupmate("k", "p-1", "bad\x1b[31m", RuntimeError("routing: not found"))
    assert reason == (
        "k: cannot reach groupmate p-1 at no announced address (routing: not found); it may have "
        "stopped, or if it runs, it must pass --announce-host ADDRESS reachable from its groupmates (and"
        " open the port)"
    )
