"""Group formation and the butterfly all-reduce over real hivemind transports, three peers in one process."""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, Iterator, Optional

import pytest
import torch

from swarm.core.average import weighted_average
from swarm.core.codec import CODECS
from swarm.net.allreduce import Exchange, ExchangeFailed, ExchangeResult
from swarm.net.rendezvous import Member, group_key, rendezvous
from swarm.net.transport import Transport

pytestmark = pytest.mark.timeout(120)

RUN_ID = "run-test-exchange"
NUMEL = 100_003  # not divisible by 3: the slices differ in length


class Peer:
    def __init__(self, transport: Transport, exchange: Exchange, index: int):
        self.transport = transport
        self.exchange = exchange
        self.index = index
        self.name = f"p{index}"

    def member(self, *, weight: float, codec: str = "fp32", numel: int = NUMEL) -> Member:
        return Member(peer_id=self.name, dht_peer_id=self.transport.peer_id, index=self.index,
                      weight=weight, numel=numel, codec=codec)

    def group(self, key: str, me: Member, planned: set[str], *, window_s: float = 20.0) -> list[Member]:
        return rendezvous(self.transport.dht, key=key, me=me, planned=lambda: planned, window_s=window_s,
                          ttl_s=60, poll_s=0.05)

    def average(self, key: str, me: Member, planned: set[str], delta: torch.Tensor, *,
                window_s: float = 20.0, timeout_s: float = 30.0) -> tuple[list[Member], ExchangeResult]:
        """The group this peer found and the exchange's result."""
        group = self.group(key, me, planned, window_s=window_s)
        return group, self.exchange.average(key=key, group=group, me=me, delta=delta, timeout_s=timeout_s)


@pytest.fixture(scope="module")
def peers() -> Iterator[list[Peer]]:
    transports: list[Transport] = []
    try:
        transports.append(Transport(initial_peers=[]))
        for _ in range(2):
            transports.append(Transport(initial_peers=transports[0].visible_maddrs))
        yield [Peer(t, Exchange(t, run_id=RUN_ID), i) for i, t in enumerate(transports)]
    finally:
        for t in reversed(transports):
            t.shutdown()


def concurrently(calls: list[Callable[[], Any]], *, timeout_s: float) -> list[Any]:
    """Run the calls in threads; return each one's result, or the exception it raised."""
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


def results_of(outcomes: list[Any]) -> list[Any]:
    for outcome in outcomes:
        if isinstance(outcome, BaseException):
            raise outcome
    return outcomes


def deltas(seed: int, count: int, numel: int = NUMEL) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(numel, generator=generator) for _ in range(count)]


def test_three_peers_get_the_bit_identical_weighted_average(peers: list[Peer]) -> None:
    key = group_key(RUN_ID, 1)
    weights = [80.0, 48.0, 16.0]
    inputs = deltas(1, 3)
    planned = {p.name for p in peers}
    members = [p.member(weight=w) for p, w in zip(peers, weights)]

    results = results_of(concurrently(
        [lambda p=p, m=m, d=d: p.average(key, m, planned, d) for p, m, d in zip(peers, members, inputs)],
        timeout_s=60,
    ))

    expected = weighted_average(inputs, weights)
    for group, result in results:
        assert [m.peer_id for m in group] == ["p0", "p1", "p2"]
        assert torch.equal(result.average, expected)
    # each peer sends K-1 of its K slices, then its averaged slice to K-1 peers: 2(K-1)/K of the vector
    payload = 2 * 2 / 3 * 4 * NUMEL
    for _, result in results:
        assert payload <= result.bytes_sent <= payload * 1.01, result.bytes_sent
        assert payload * 0.99 <= result.bytes_received <= payload * 1.01, result.bytes_received


def test_fp16_average_is_bit_identical_on_every_peer_and_close_to_fp32(peers: list[Peer]) -> None:
    key = group_key(RUN_ID, 2)
    weights = [10.0, 30.0, 20.0]
    inputs = deltas(2, 3)
    planned = {p.name for p in peers}
    members = [p.member(weight=w, codec="fp16") for p, w in zip(peers, weights)]

    results = [result for _, result in results_of(concurrently(
        [lambda p=p, m=m, d=d: p.average(key, m, planned, d) for p, m, d in zip(peers, members, inputs)],
        timeout_s=60,
    ))]

    for result in results[1:]:
        assert torch.equal(result.average, results[0].average)
    fp32_average = weighted_average(inputs, weights)
    scale = fp32_average.abs().max().item()
    torch.testing.assert_close(results[0].average, fp32_average, rtol=0, atol=1e-2 * scale)
    # the wire carries 2 bytes per element, about half of fp32
    payload = 2 * 2 / 3 * 2 * NUMEL
    assert all(payload <= r.bytes_sent <= payload * 1.01 for r in results), [r.bytes_sent for r in results]
    # and the average is exactly the fp16 round trip of the average of the fp16 round trips
    fp16 = CODECS["fp16"]
    through_wire = [fp16.decode(fp16.encode(d), NUMEL) for d in inputs]
    assert torch.equal(results[0].average, fp16.decode(fp16.encode(weighted_average(through_wire, weights)), NUMEL))


def test_a_planned_peer_that_never_shows_up_is_left_out_after_the_window(peers: list[Peer]) -> None:
    key = group_key(RUN_ID, 3)
    present = peers[:2]
    planned = {"p0", "p1", "p2"}  # p2 was planned but never posts
    weights = [2.0, 3.0]
    inputs = deltas(3, 2)
    members = [p.member(weight=w) for p, w in zip(present, weights)]
    window_s = 2.0

    started = time.monotonic()
    results = results_of(concurrently(
        [lambda p=p, m=m, d=d: p.average(key, m, planned, d, window_s=window_s)
         for p, m, d in zip(present, members, inputs)],
        timeout_s=60,
    ))

    assert time.monotonic() - started >= window_s  # they waited the window out for p2
    expected = weighted_average(inputs, weights)
    for group, result in results:
        assert [m.peer_id for m in group] == ["p0", "p1"]
        assert torch.equal(result.average, expected)


def test_a_member_that_posts_but_never_exchanges_fails_the_others(peers: list[Peer]) -> None:
    key = group_key(RUN_ID, 4)
    planned = {p.name for p in peers}
    inputs = deltas(4, 3)
    members = [p.member(weight=1.0) for p in peers]
    timeout_s = 3.0
    silent = peers[2]

    def silent_member() -> list[Member]:
        return silent.group(key, members[2], planned)

    def active(i: int) -> tuple[Optional[ExchangeResult], float]:
        group = peers[i].group(key, members[i], planned)
        assert len(group) == 3
        started = time.monotonic()
        try:
            return peers[i].exchange.average(key=key, group=group, me=members[i], delta=inputs[i],
                                             timeout_s=timeout_s), time.monotonic() - started
        except ExchangeFailed as e:
            return e, time.monotonic() - started

    outcomes = results_of(concurrently([lambda: active(0), lambda: active(1), silent_member], timeout_s=60))

    assert [m.peer_id for m in outcomes[2]] == ["p0", "p1", "p2"]
    for outcome, seconds in outcomes[:2]:
        assert isinstance(outcome, ExchangeFailed), f"expected ExchangeFailed, got {outcome!r}"
        # its own timeout, or the first groupmate's to time out, which tells the others (abort)
        assert key in str(outcome)
        assert "did not complete" in str(outcome) or "no complete exchange within" in str(outcome)
        assert timeout_s - 1 <= seconds < timeout_s + 3


def test_a_member_that_fails_tells_the_others_who_fail_at_once(peers: list[Peer]) -> None:
    key = group_key(RUN_ID, 5)
    planned = {p.name for p in peers}
    inputs = deltas(5, 3)
    members = [p.member(weight=1.0) for p in peers]
    timeout_s = 30.0

    def member(i: int) -> tuple[Any, float]:
        group = peers[i].group(key, members[i], planned)

        def on_phase(phase: str) -> None:
            if i == 2 and phase == "sending":
                raise ExchangeFailed("injected: this member's link is down")

        started = time.monotonic()
        try:
            return peers[i].exchange.average(key=key, group=group, me=members[i], delta=inputs[i],
                                             timeout_s=timeout_s, on_phase=on_phase), time.monotonic() - started
        except ExchangeFailed as e:
            return e, time.monotonic() - started

    outcomes = results_of(concurrently([lambda: member(0), lambda: member(1), lambda: member(2)], timeout_s=60))
    assert "injected" in str(outcomes[2][0])
    for outcome, seconds in outcomes[:2]:
        assert isinstance(outcome, ExchangeFailed), f"expected ExchangeFailed, got {outcome!r}"
        assert "groupmate p2 gave up (" in str(outcome) and "link is down" in str(outcome)
        assert seconds < 10, f"took {seconds:.1f}s: the abort did not reach it, it waited for its timeout"


def test_a_group_and_its_votes_ignore_malformed_entries_and_entries_posted_under_another_peers_name(peers):
    from hivemind.utils.timed_storage import get_dht_time

    from swarm.net.dht_entries import read_entries
    from swarm.net.votes import Vote, collect_votes, post_vote, vote_key

    a, b, c = peers
    key = group_key(RUN_ID, 901)
    dht = a.transport.dht
    expires = get_dht_time() + 60
    dht.store(key, subkey="p1", value={"not": "a member"}, expiration_time=expires)  # malformed
    dht.store(key, subkey="p2", value=vars(b.member(weight=1.0)), expiration_time=expires)  # p1 posing as p2
    dht.store(key, subkey="p0", value=vars(a.member(weight=1.0)), expiration_time=expires)
    assert set(read_entries(c.transport.dht, key, Member)) == {"p0"}

    vote = Vote(peer_id="p0", dht_peer_id=a.transport.peer_id, ok=True, state_hash="h")
    post_vote(dht, key, vote, ttl_s=60)
    dht.store(vote_key(key), subkey="p1", value={"ok": True}, expiration_time=expires)
    assert collect_votes(c.transport.dht, key, ["p0"], timeout_s=5) == {"p0": vote}
    assert collect_votes(c.transport.dht, key, ["p0", "p1"], timeout_s=0.5) is None  # p1's vote is unreadable


def test_a_group_smaller_than_the_runs_live_peers_takes_a_proportionally_smaller_outer_step():
    from swarm.net.rendezvous import group_digest, participation_scale

    def m(i: int, live: int) -> Member:
        return Member(peer_id=f"p{i}", dht_peer_id=f"d{i}", index=i, weight=8.0, numel=10, codec="fp32",
                      live_peers=live)

    assert participation_scale([m(0, 5)]) == 0.2  # alone among five live peers
    assert participation_scale([m(0, 4), m(1, 5)]) == 0.4  # members that heard different counts agree on the max
    assert participation_scale([m(0, 2), m(1, 2)]) == 1.0  # the whole run
    assert participation_scale([m(0, 0), m(1, 0)]) == 1.0  # nobody knew (coordinator down): plain average
    assert group_digest([m(0, 4)]) != group_digest([m(0, 5)])  # a different view is caught, not merged
