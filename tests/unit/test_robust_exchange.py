"""The aggregation rule and the weight cap in a real butterfly all-reduce over hivemind, three peers in
one process: every member gets the simulator's bits, and owners report whom they clipped or refused."""

from __future__ import annotations

import threading
from typing import Any, Callable, Iterator

import pytest
import torch

from swarm.core.aggregation import Aggregation
from swarm.core.average import butterfly_reference
from swarm.net.bulk.transport import Transport
from swarm.net.exchange.allreduce import Exchange, ExchangeFailed
from swarm.net.exchange.rendezvous import Member, group_key

pytestmark = [pytest.mark.slow, pytest.mark.timeout(90)]

RUN_ID = "run-test-robust-exchange"
NUMEL = 30_001
RULE = Aggregation(rule="clipped_mean", max_weight=64.0)


@pytest.fixture(scope="module")
def exchanges() -> Iterator[list[Exchange]]:
    transports: list[Transport] = []
    try:
        transports.append(Transport(initial_peers=[]))
        for _ in range(2):
            transports.append(Transport(initial_peers=transports[0].visible_maddrs))
        yield [Exchange(t, run_id=RUN_ID, aggregation=RULE) for t in transports]
    finally:
        for t in reversed(transports):
            t.shutdown()


def run_all(calls: list[Callable[[], Any]], timeout_s: float = 60) -> list[Any]:
    """Each call in its own thread; its result or the exception it raised."""
    outcomes: list[Any] = [None] * len(calls)

    def run(i: int) -> None:
        try:
            outcomes[i] = calls[i]()
        except BaseException as e:  # handed back to the test
            outcomes[i] = e

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s)
    assert not any(t.is_alive() for t in threads)
    return outcomes


def members(exchanges: list[Exchange], weights: list[float]) -> list[Member]:
    return [
        Member(peer_id=f"p{i}", dht_peer_id=e.transport.peer_id, index=i, weight=w, numel=NUMEL, codec="fp32")
        for i, (e, w) in enumerate(zip(exchanges, weights))
    ]


def test_a_clipped_attacker_with_a_huge_weight_gets_the_simulators_bits_on_every_member(exchanges):
    g = torch.Generator().manual_seed(0)
    common = torch.randn(NUMEL, generator=g)
    deltas = [common + 0.3 * torch.randn(NUMEL, generator=g) for _ in range(2)] + [-50.0 * common]
    group = members(exchanges, [64.0, 32.0, 1e30])
    key = group_key(RUN_ID, 1)

    outcomes = run_all(
        [
            lambda e=e, m=m, d=d: e.average(key=key, group=group, me=m, delta=d, timeout_s=30)
            for e, m, d in zip(exchanges, group, deltas)
        ]
    )

    assert not any(isinstance(o, BaseException) for o in outcomes), outcomes
    expected = butterfly_reference(deltas, [64.0, 32.0, 64.0], "fp32", reduce=lambda d, w: RULE.reduce(d, w).average)
    for result in outcomes:
        assert torch.equal(result.average, expected)
        assert list(result.clipped) == ["p2"] and result.rejected == {}  # every owner clipped p2's slice
    # the attacker's slices were clipped to 2x the median norm: the average stays that short (a plain mean: ~20x)
    assert expected.norm() <= 2 * max(d.norm() for d in deltas[:2])


def test_a_member_declaring_a_nan_weight_fails_the_exchange_naming_it(exchanges):
    group = members(exchanges, [8.0, float("nan"), 8.0])
    key = group_key(RUN_ID, 2)
    outcomes = run_all(
        [
            lambda e=e, m=m: e.average(key=key, group=group, me=m, delta=torch.ones(NUMEL), timeout_s=20)
            for e, m in zip(exchanges, group)
        ]
    )
    for outcome in outcomes:
        assert isinstance(outcome, ExchangeFailed) and "member p1 declared the weight nan" in str(outcome)
