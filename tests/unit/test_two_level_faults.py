"""Two-level averaging when a sub-group fails: six members in three sites over real hivemind transports, in one
process. Site a is positions 0 and 3, site b 1 and 4, site c 2 and 5; the lower position represents its site."""

from __future__ import annotations

import time
from typing import Callable, Iterator, Optional

import pytest
import torch

from swarm.core.aggregation import Aggregation
from swarm.core.average import butterfly_reference
from swarm.net.bulk.transport import Transport
from swarm.net.exchange.allreduce import Exchange
from swarm.net.exchange.rendezvous import Member, group_digest, group_key
from swarm.net.exchange.slices.reduction import ExchangeFailed
from swarm.net.exchange.two_level import TwoLevelExchange
from swarm.net.exchange.withdrawal import WITHDRAWN
from swarm.v1 import exchange_pb2
from tests.unit.test_two_level_exchange import concurrently

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

RUN_ID = "run-test-two-level-faults"
NUMEL = 30_001
SITES = ["a", "b", "c", "a", "b", "c"]
TIMEOUT_S = 40.0  # each exchange's; a failure must be known well before it


class Peer:
    def __init__(self, transport: Transport, index: int) -> None:
        self.transport, self.index = transport, index
        self.two_level = TwoLevelExchange(Exchange(transport, run_id=RUN_ID), transport, run_id=RUN_ID, group_size=0)

    def member(self, weight: float) -> Member:
        return member_at(self.transport, self.index, weight)


def member_at(transport: Transport, index: int, weight: float) -> Member:
    return Member(
        peer_id=f"peer{index}",
        dht_peer_id=transport.peer_id,
        index=index,
        weight=weight,
        numel=NUMEL,
        codec="fp32",
        site=SITES[index],
    )


@pytest.fixture(scope="module")
def peers() -> Iterator[list[Peer]]:
    transports: list[Transport] = []
    try:
        transports.append(Transport(initial_peers=[]))
        for _ in range(len(SITES) - 1):
            transports.append(Transport(initial_peers=transports[0].visible_maddrs))
        yield [Peer(t, i) for i, t in enumerate(transports)]
    finally:
        for t in reversed(transports):
            t.shutdown()


def failing_at(phase: str) -> Callable[[str], Optional[float]]:
    """An ``on_phase`` hook whose member fails its exchange when it reaches ``phase``."""

    def hook(reached: str) -> Optional[float]:
        if reached == phase:
            raise ExchangeFailed(f"fault injected at {phase}")
        return None

    return hook


def test_a_member_failing_mid_exchange_leaves_the_other_subgroups_one_average_well_before_the_timeout(peers) -> None:
    """Site c's member fails while sending: site c's exchange fails, its representative withdraws it from level 2,
    and every peer, site c's two included, ends with the same bytes: sites a and b's average, as computed directly."""
    weights = [30.0, 10.0, 20.0, 40.0, 5.0, 15.0]
    group = [p.member(w) for p, w in zip(peers, weights)]
    key = group_key(RUN_ID, 1)
    generator = torch.Generator().manual_seed(3)
    deltas = [torch.randn(NUMEL, generator=generator) for _ in peers]
    hooks = [None, None, None, None, None, failing_at("sending")]
    started = time.monotonic()
    outcomes = concurrently(
        [
            lambda p=p, m=m, d=d, h=h: p.two_level.average(
                key=key, group=group, me=m, delta=d, timeout_s=TIMEOUT_S, on_phase=h
            )
            for p, m, d, h in zip(peers, group, deltas, hooks)
        ],
        timeout_s=3 * TIMEOUT_S,
    )
    elapsed = time.monotonic() - started
    failed = [o for o in outcomes if isinstance(o, BaseException)]
    assert not failed, failed
    assert elapsed < TIMEOUT_S / 2, f"the exchange took {elapsed:.1f}s"
    first = outcomes[0].average
    assert all(torch.equal(o.average, first) for o in outcomes), "peers ended with different averages"
    capped = Aggregation().weights(weights, [m.peer_id for m in group])
    site_a = butterfly_reference([deltas[0], deltas[3]], [capped[0], capped[3]], "fp32")
    site_b = butterfly_reference([deltas[1], deltas[4]], [capped[1], capped[4]], "fp32")
    expected = butterfly_reference([site_a, site_b], [capped[0] + capped[3], capped[1] + capped[4]], "fp32")
    assert torch.equal(first, expected), "the average is not sites a and b's"
    assert [o.withdrawn for o in outcomes] == [False, False, True, False, False, True]


@pytest.mark.parametrize("gather", [False, True], ids=["butterfly", "all-gather"])
def test_a_withdrawn_member_of_a_flat_exchange_leaves_the_others_average(peers, gather: bool) -> None:
    """In one group, a member that withdraws still takes part (a butterfly owner reduces and sends its slices): every
    member ends with the others' weighted average."""
    members = peers[:3]
    weights = [2.0, 3.0, 5.0]
    group = [p.member(w) for p, w in zip(members, weights)]
    key = group_key(RUN_ID, 10 + gather)
    for p in members:
        p.two_level.in_site.gather_all = gather  # between exchanges, as the run's config sets it
    generator = torch.Generator().manual_seed(4)
    deltas: list[Optional[torch.Tensor]] = [torch.randn(NUMEL, generator=generator) for _ in members]
    deltas[1] = None
    outcomes = concurrently(
        [
            lambda p=p, m=m, d=d: p.two_level.in_site.average(key=key, group=group, me=m, delta=d, timeout_s=TIMEOUT_S)
            for p, m, d in zip(members, group, deltas)
        ],
        timeout_s=3 * TIMEOUT_S,
    )
    for p in members:
        p.two_level.in_site.gather_all = False
    failed = [o for o in outcomes if isinstance(o, BaseException)]
    assert not failed, failed
    assert all(torch.equal(o.average, outcomes[0].average) for o in outcomes), "members ended with different averages"
    assert torch.equal(outcomes[0].average, butterfly_reference([deltas[0], deltas[2]], [2.0, 5.0], "fp32"))


def test_a_group_whose_every_member_withdraws_fails(peers) -> None:
    members = peers[:2]
    group = [p.member(1.0) for p in members]
    key = group_key(RUN_ID, 4)
    outcomes = concurrently(
        [
            lambda p=p, m=m: p.two_level.in_site.average(key=key, group=group, me=m, delta=None, timeout_s=TIMEOUT_S)
            for p, m in zip(members, group)
        ],
        timeout_s=3 * TIMEOUT_S,
    )
    assert all(isinstance(o, ExchangeFailed) and "withdrew" in str(o) for o in outcomes), outcomes


def test_a_dead_representative_costs_one_failed_send_and_the_others_go_on_without_it(peers) -> None:
    """Site c's representative's process is gone: the cross-site exchange fails at its first send to it, the
    representatives that answer a ping average among themselves, and sites a and b end with their average, as
    computed directly; site c's member fails at once (nobody would hand it an average)."""
    dead = Transport(initial_peers=peers[0].transport.visible_maddrs)
    dead_member = member_at(dead, 2, 1.0)
    dead.shutdown()
    weights = [30.0, 10.0, 1.0, 40.0, 5.0, 15.0]
    group = [p.member(w) for p, w in zip(peers, weights)]
    group[2] = dead_member
    live = [p for p in peers if p.index != 2]
    key = group_key(RUN_ID, 2)
    generator = torch.Generator().manual_seed(8)
    deltas = [torch.randn(NUMEL, generator=generator) for _ in peers]
    started = time.monotonic()
    outcomes = concurrently(
        [
            lambda p=p: p.two_level.average(
                key=key, group=group, me=group[p.index], delta=deltas[p.index], timeout_s=TIMEOUT_S
            )
            for p in live
        ],
        timeout_s=3 * TIMEOUT_S,
    )
    elapsed = time.monotonic() - started
    *averaged, orphan = outcomes
    failed = [o for o in averaged if isinstance(o, BaseException)]
    assert not failed, failed
    assert isinstance(orphan, ExchangeFailed), orphan
    assert elapsed < TIMEOUT_S / 2, f"the exchange took {elapsed:.1f}s"
    capped = Aggregation().weights(weights, [m.peer_id for m in group])
    site_a = butterfly_reference([deltas[0], deltas[3]], [capped[0], capped[3]], "fp32")
    site_b = butterfly_reference([deltas[1], deltas[4]], [capped[1], capped[4]], "fp32")
    expected = butterfly_reference([site_a, site_b], [capped[0] + capped[3], capped[1] + capped[4]], "fp32")
    assert all(torch.equal(o.average, expected) for o in averaged), "the average is not sites a and b's"


def test_a_strangers_withdrawal_of_a_member_is_not_believed(peers) -> None:
    """A peer outside the group sends owner 0 a withdrawal in member 1's name before the exchange: the owner drops it
    (it is not member 1's libp2p id), and member 1's contribution is in everyone's average."""
    members, stranger = peers[:3], peers[3].two_level.in_site
    weights = [2.0, 3.0, 5.0]
    group = [p.member(w) for p, w in zip(members, weights)]
    key = group_key(RUN_ID, 5)
    dropped = members[0].two_level.in_site.rejected_chunks
    stranger.transport.run(
        stranger._send(group[0], key, group_digest(group), exchange_pb2.PHASE_CONTRIBUTION, 0, 1, WITHDRAWN),
        timeout_s=30,
    )
    generator = torch.Generator().manual_seed(6)
    deltas = [torch.randn(NUMEL, generator=generator) for _ in members]
    outcomes = concurrently(
        [
            lambda p=p, m=m, d=d: p.two_level.in_site.average(key=key, group=group, me=m, delta=d, timeout_s=TIMEOUT_S)
            for p, m, d in zip(members, group, deltas)
        ],
        timeout_s=3 * TIMEOUT_S,
    )
    failed = [o for o in outcomes if isinstance(o, BaseException)]
    assert not failed, failed
    assert all(torch.equal(o.average, butterfly_reference(deltas, weights, "fp32")) for o in outcomes)
    assert members[0].two_level.in_site.rejected_chunks > dropped  # it did arrive, and was dropped
