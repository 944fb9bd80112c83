"""A node with no token replays a member's older signed DHT entry with a later expiration: real hivemind nodes
in this process; no member's node stores the replay (each is asked in turn, as scripts/attack.py asks them), and
the member's newer entry is the one every reader gets."""

from __future__ import annotations

import dataclasses
import functools
import sys
from pathlib import Path
from typing import Iterator

import pytest
from hivemind.utils.timed_storage import get_dht_time
from testbed.members import make_member

from swarm.core.trust.credential import PeerKey
from swarm.net.bulk.transport import Transport
from swarm.net.dht_entries import guard, read_entries, store_entry
from swarm.net.exchange.rendezvous import Member, group_key

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
from attack import store_at_each_node  # noqa: E402  the soak's replay, one node at a time

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

RUN_ID = "run-test-replay"
COORDINATOR = PeerKey.generate()


@pytest.fixture
def nodes() -> Iterator[list[Transport]]:
    """Two members' guarded nodes and a stranger's bare hivemind node (no token, no validator) in one DHT."""
    started: list[Transport] = []
    try:
        started.append(Transport(initial_peers=[]))
        started += [Transport(initial_peers=started[0].visible_maddrs) for _ in range(2)]
        yield started
    finally:
        for t in reversed(started):
            t.shutdown()


def test_a_replayed_older_entry_with_a_later_expiration_does_not_displace_the_newer_one(nodes) -> None:
    a, b, stranger = nodes
    members = [make_member(COORDINATOR, RUN_ID, t.peer_id) for t in (a, b)]
    for t, m in zip((a, b), members):
        guard(t.dht, m)
    key = group_key(RUN_ID, 970)
    older = Member(peer_id=members[0].peer_id, dht_peer_id=a.peer_id, index=0, weight=1.0, numel=10, codec="fp32")
    newer = dataclasses.replace(older, closed="0,1")
    store_entry(a.dht, key, older, member=members[0], ttl_s=30)
    captured = stranger.dht.get(key, latest=True).value[older.peer_id]  # what any node of the DHT can read
    store_entry(a.dht, key, newer, member=members[0], ttl_s=30)
    assert read_entries(b.dht, key, Member, member=members[1]) == {newer.peer_id: newer}

    # the older entry, signature intact, stored again to outlive the newer one: no member's node takes it (its
    # signed expiration is not the record's); stored again as it was signed, it is older than the newer one.
    # Each node is asked on its own: DHT.store answers only whichever node answered last.
    for expiration_time in (get_dht_time() + 600, captured.expiration_time):
        answers = stranger.dht.run_coroutine(
            functools.partial(
                store_at_each_node,
                key=key,
                subkey=older.peer_id,
                value=captured.value,
                expiration_time=expiration_time,
                skip=[],
            )
        )
        assert answers == {str(a.peer_id): False, str(b.peer_id): False}
    # the same replay, asked of every node but a member's own: the one node without a validator takes it
    answers = a.dht.run_coroutine(
        functools.partial(
            store_at_each_node,
            key=key,
            subkey=older.peer_id,
            value=captured.value,
            expiration_time=get_dht_time() + 600,
            skip=[],
        )
    )
    assert answers == {str(b.peer_id): False, str(stranger.peer_id): True}

    for reader, member in ((b, members[1]), (a, members[0])):
        assert read_entries(reader.dht, key, Member, member=member) == {newer.peer_id: newer}
