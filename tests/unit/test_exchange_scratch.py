"""Between exchanges the exchange keeps its decoded slices for the next one only while they are small: a real
model's (a quarter of its fp32 bytes) are let go at the exchange's end, before the inner steps that follow."""

import time

import pytest
import torch

from swarm.core.average import butterfly_reference
from swarm.net.exchange import result_vectors
from swarm.net.exchange.rendezvous import group_key
from tests.unit.test_exchange import RUN_ID, Peer, concurrently, deltas, results_of, three_peers

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]


@pytest.fixture(scope="module")
def peers():
    yield from three_peers()


def _int4_exchange(peers: list[Peer], round_no: int) -> None:
    weights = [1.0, 2.0, 3.0]
    members = [p.member(weight=w, codec="int4") for p, w in zip(peers, weights)]
    inputs = deltas(round_no, 3)
    expected = butterfly_reference(inputs, weights, "int4")
    results = results_of(
        concurrently(
            [
                lambda p=p, m=m, d=d: p.average(group_key(RUN_ID, round_no), m, {q.name for q in peers}, d)
                for p, m, d in zip(peers, members, inputs)
            ],
            timeout_s=60,
        )
    )
    assert all(torch.equal(result.average, expected) for _, result in results)


def _kept_bytes(peer: Peer) -> int:
    return sum(a.nbytes for a in peer.exchange._scratch._arrays)


def _wait_until(condition, timeout_s: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return condition()


def test_a_small_vectors_decoded_slices_stay_for_the_next_exchange(peers: list[Peer]) -> None:
    _int4_exchange(peers, 61)
    assert all(0 < _kept_bytes(p) <= result_vectors.KEEP_MAX_BYTES for p in peers)


def test_decoded_slices_that_outgrow_the_pools_bound_are_let_go_when_the_exchange_ends(
    peers: list[Peer], monkeypatch: pytest.MonkeyPatch
) -> None:
    slice_bytes = 4 * (-(-deltas(0, 1)[0].numel() // len(peers)))
    # each slice fits the bound (so the pool keeps it during the exchange), all of them together do not
    monkeypatch.setattr(result_vectors, "KEEP_MAX_BYTES", 2 * slice_bytes)
    _int4_exchange(peers, 62)
    assert _wait_until(lambda: all(_kept_bytes(p) == 0 for p in peers))
    _int4_exchange(peers, 63)  # and the next exchange decodes into fresh memory, to the same average
    assert _wait_until(lambda: all(_kept_bytes(p) == 0 for p in peers))
