"""Two-level averaging over real hivemind transports: four members in two sites, in one process."""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, Iterator

import pytest
import torch

from swarm.core.aggregation import Aggregation
from swarm.core.average import weighted_average
from swarm.core.site_plan import plan_sites, two_level_reference
from swarm.core.trust.credential import Credential, PeerKey, issue
from swarm.core.trust.credential import Member as Credentialed
from swarm.net.bulk.transport import Transport
from swarm.net.dht_entries import read_entries, sign_entry
from swarm.net.exchange.allreduce import Exchange
from swarm.net.exchange.rendezvous import Member, group_key, rendezvous
from swarm.net.exchange.slices.reduction import ExchangeFailed
from swarm.net.exchange.two_level import TwoLevelExchange

pytestmark = [pytest.mark.slow, pytest.mark.timeout(150)]

RUN_ID = "run-test-two-level"
NUMEL = 50_001
SITES = ["a", "b", "a", "b"]  # by peer index: each site's lowest index represents it
COORDINATOR = PeerKey.generate()


def credentialed(dht_peer_id: str, site: str) -> Credentialed:
    key, now = PeerKey.generate(), time.time()
    signed = issue(
        COORDINATOR,
        Credential(
            run_id=RUN_ID,
            peer_id=key.peer_id,
            public_key=key.public_key,
            dht_peer_id=dht_peer_id,
            role="peer",
            token_id="t",
            issued_at=now,
            expires_at=now + 3600,
            site=site,
        ),
    )
    return Credentialed(key=key, credential=signed, coordinator_public_key=COORDINATOR.public_key, run_id=RUN_ID)


class Peer:
    def __init__(self, transport: Transport, index: int) -> None:
        self.transport, self.index = transport, index
        self.credential = credentialed(transport.peer_id, SITES[index])
        self.two_level = TwoLevelExchange(Exchange(transport, run_id=RUN_ID), transport, run_id=RUN_ID, group_size=0)

    def member(self, weight: float) -> Member:
        return Member(
            peer_id=self.credential.peer_id,
            dht_peer_id=self.transport.peer_id,
            index=self.index,
            weight=weight,
            numel=NUMEL,
            codec="fp32",
            site=self.credential.site,
        )

    def average(self, key: str, me: Member, planned: set[str], delta: torch.Tensor, timeout_s: float = 30):
        group = rendezvous(
            self.transport.dht,
            key=key,
            me=me,
            member=self.credential,
            planned=lambda: planned,
            window_s=20,
            ttl_s=60,
            poll_s=0.05,
        )
        return group, self.two_level.average(key=key, group=group, me=me, delta=delta, timeout_s=timeout_s)


@pytest.fixture(scope="module")
def peers() -> Iterator[list[Peer]]:
    transports: list[Transport] = []
    try:
        transports.append(Transport(initial_peers=[]))
        for _ in range(3):
            transports.append(Transport(initial_peers=transports[0].visible_maddrs))
        yield [Peer(t, i) for i, t in enumerate(transports)]
    finally:
        for t in reversed(transports):
            t.shutdown()


def concurrently(calls: list[Callable[[], Any]], *, timeout_s: float) -> list[Any]:
    outcomes: list[Any] = [None] * len(calls)

    def run(i: int) -> None:
        try:
            outcomes[i] = calls[i]()
        except BaseException as e:  # handed back to the test, which asserts on it
            outcomes[i] = e

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(calls))]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout_s
    for t in threads:
        t.join(timeout=max(0.0, deadline - time.monotonic()))
    assert not any(t.is_alive() for t in threads), f"peers still running after {timeout_s:.0f}s"
    return outcomes


def test_two_sites_of_two_end_bit_identical_with_the_flat_mean_and_half_the_cross_site_bytes(peers) -> None:
    generator = torch.Generator().manual_seed(5)
    deltas = [torch.randn(NUMEL, generator=generator) for _ in peers]
    weights = [30.0, 10.0, 20.0, 40.0]
    planned = {p.credential.peer_id for p in peers}
    key = group_key(RUN_ID, 1)
    outcomes = concurrently(
        [lambda p=p, w=w, d=d: p.average(key, p.member(w), planned, d) for p, w, d in zip(peers, weights, deltas)],
        timeout_s=90,
    )
    for outcome in outcomes:
        if isinstance(outcome, BaseException):
            raise outcome
    results = [result for _, result in outcomes]
    assert [m.site for m in outcomes[0][0]] == SITES  # the group carries the credentials' sites
    first = results[0].average
    assert all(torch.equal(r.average, first) for r in results), "members ended with different averages"
    assert torch.allclose(first, weighted_average(deltas, weights), rtol=1e-5, atol=1e-6)
    reference = two_level_reference(
        deltas, Aggregation().weights(weights, [str(i) for i in range(4)]), plan_sites(SITES), "fp32"
    )
    assert torch.equal(first, reference), "the exchange and the simulator's reference differ"
    assert [r.representative for r in results] == [True, True, False, False]
    assert [r.cross_site_bytes_sent > 0 for r in results] == [True, True, False, False]
    # flat: each member sends 3/4 of the vector twice, 2/4 of it to the other site; two-level: the two
    # representatives send 1/2 of it twice across
    flat_cross = 4 * 2 * (2 / 4) * 4 * NUMEL
    assert sum(r.cross_site_bytes_sent for r in results) <= flat_cross / 2 * 1.05


def test_a_member_posting_another_site_than_its_credential_is_not_believed(peers) -> None:
    peer = peers[0]
    key = group_key(RUN_ID, 2)
    forged = Member(
        peer_id=peer.credential.peer_id,
        dht_peer_id=peer.transport.peer_id,
        index=0,
        weight=1.0,
        numel=NUMEL,
        codec="fp32",
        site="b",  # its credential says "a"
    )
    peer.transport.dht.store(
        key,
        subkey=peer.credential.peer_id,
        value=sign_entry(peer.credential, key, forged),
        expiration_time=time.time() + 60,
    )
    assert read_entries(peers[1].transport.dht, key, Member, member=peers[1].credential) == {}


def test_a_representative_that_fails_across_sites_fails_its_site_at_once(peers) -> None:
    """Site b's members never come: site a's representative gives up across sites, and tells its member."""
    site_a = [peers[0], peers[2]]
    key = group_key(RUN_ID, 3)
    b_members = [p.member(1.0) for p in (peers[1], peers[3])]
    group = sorted([p.member(1.0) for p in site_a] + b_members, key=lambda m: m.index)
    started = time.monotonic()
    outcomes = concurrently(
        [
            lambda p=p: p.two_level.average(
                key=key, group=group, me=p.member(1.0), delta=torch.ones(NUMEL), timeout_s=8
            )
            for p in site_a
        ],
        timeout_s=60,
    )
    assert all(isinstance(o, ExchangeFailed) for o in outcomes), outcomes
    assert "representative gave up" in str(outcomes[1])
    assert time.monotonic() - started < 8 * 2  # the member did not wait out its own 2x timeout
