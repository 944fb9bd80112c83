"""The pipelined data path: slices of several chunks, encoded part by part while they are sent, give every
member the same bits the one-process reference computes; a vector that cannot be encoded fails loudly. An exchange
ends with its own outcome even when a saturated machine keeps its transport's loop from clearing its buffers in time
(``FORGET_WAIT_S`` 0 here: the exchange's end does not wait for that at all)."""

from __future__ import annotations

import time
from typing import Iterator

import pytest
import torch

from swarm.core.average import butterfly_reference
from swarm.net.bulk.transport import Transport
from swarm.net.exchange.allreduce import Exchange, ExchangeFailed
from swarm.net.exchange.rendezvous import group_key
from tests.unit.test_exchange import Peer, concurrently, results_of

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

RUN_ID = "run-test-exchange"  # the Peer helper's credentials are for this run
NUMEL = 1_000_003  # fp32 slices of ~2 MB: three chunks each, bf16 two


@pytest.fixture(scope="module")
def pair() -> Iterator[list[Peer]]:
    transports: list[Transport] = []
    try:
        transports.append(Transport(initial_peers=[]))
        transports.append(Transport(initial_peers=transports[0].visible_maddrs))
        yield [Peer(t, Exchange(t, run_id=RUN_ID), i) for i, t in enumerate(transports)]
    finally:
        for t in reversed(transports):
            t.shutdown()


@pytest.mark.parametrize("round_number, codec", [(101, "fp32"), (102, "bf16"), (103, "int4")])
def test_multi_chunk_slices_average_to_the_reference_bits(pair: list[Peer], round_number: int, codec: str) -> None:
    key, weights = group_key(RUN_ID, round_number), [3.0, 1.0]
    generator = torch.Generator().manual_seed(round_number)
    inputs = [torch.randn(NUMEL, generator=generator) for _ in pair]
    members = [p.member(weight=w, codec=codec, numel=NUMEL) for p, w in zip(pair, weights)]
    planned = {p.name for p in pair}

    results = results_of(
        concurrently(
            [
                lambda p=p, m=m, d=d: p.average(key, m, planned, d, timeout_s=90)
                for p, m, d in zip(pair, members, inputs)
            ],
            timeout_s=150,
        )
    )

    expected = butterfly_reference(inputs, weights, codec)
    for _, result in results:
        assert torch.equal(result.average, expected)


def test_a_completed_exchange_returns_its_result_when_its_loop_is_slow_to_clear_it(
    pair: list[Peer], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("swarm.net.exchange.allreduce.FORGET_WAIT_S", 0.0)
    key, weights = group_key(RUN_ID, 106), [1.0, 2.0]
    generator = torch.Generator().manual_seed(106)
    inputs = [torch.randn(NUMEL, generator=generator) for _ in pair]
    members = [p.member(weight=w, numel=NUMEL) for p, w in zip(pair, weights)]
    planned = {p.name for p in pair}

    results = results_of(
        concurrently(
            [
                lambda p=p, m=m, d=d: p.average(key, m, planned, d, timeout_s=90)
                for p, m, d in zip(pair, members, inputs)
            ],
            timeout_s=150,
        )
    )

    expected = butterfly_reference(inputs, weights, "fp32")
    assert all(torch.equal(result.average, expected) for _, result in results)
    deadline = time.monotonic() + 30  # and each loop clears the exchange's buffers when it gets there
    while any(p.exchange.inbox.averaging(key) for p in pair) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(p.exchange.inbox.averaging(key) for p in pair)


@pytest.mark.parametrize("round_number, forget_wait_s", [(104, None), (105, 0.0)])
def test_a_vector_that_cannot_be_encoded_fails_at_once_and_tells_its_groupmate(
    pair: list[Peer], round_number: int, forget_wait_s: float | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    if forget_wait_s is not None:
        monkeypatch.setattr("swarm.net.exchange.allreduce.FORGET_WAIT_S", forget_wait_s)
    key = group_key(RUN_ID, round_number)
    inputs = [torch.ones(NUMEL), torch.ones(NUMEL)]
    inputs[1][-1] = float("nan")  # in the last slice: found before the first slice goes
    members = [p.member(weight=1.0, numel=NUMEL) for p in pair]
    planned = {p.name for p in pair}

    def member(i: int):
        group = pair[i].group(key, members[i], planned)
        started = time.monotonic()
        try:
            return pair[i].exchange.average(key=key, group=group, me=members[i], delta=inputs[i], timeout_s=60)
        except ExchangeFailed as e:
            return e, time.monotonic() - started

    outcomes = concurrently([lambda: member(0), lambda: member(1)], timeout_s=120)
    assert all(isinstance(o, tuple) for o in outcomes), outcomes  # each member's ExchangeFailed, nothing else
    bad, seconds = outcomes[1]
    assert "cannot encode this slice" in str(bad) and "inf or nan" in str(bad)
    other, other_seconds = outcomes[0]
    assert isinstance(other, ExchangeFailed) and "gave up" in str(other), other
    assert other_seconds < 30, f"the groupmate waited {other_seconds:.0f}s: the abort did not reach it"
