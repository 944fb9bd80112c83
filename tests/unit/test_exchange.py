"""Group formation and the butterfly all-reduce over real hivemind transports, three peers in one process."""

from __future__ import annotations

import dataclasses
import gc
import math
import threading
import time
from typing import Any, Callable, Iterator, Optional

import pytest
import torch
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord
from hivemind.p2p import PeerID
from hivemind.utils.asyncio import as_aiter
from hivemind.utils.serializer import MSGPackSerializer
from hivemind.utils.timed_storage import get_dht_time
from testbed.members import make_member

from swarm.core import average as average_module
from swarm.core.average import butterfly_bounds, butterfly_reference, part_bounds, stripe_count, weighted_average
from swarm.core.codecs.codec import CODECS, get_codec
from swarm.core.codecs.owner_feedback import OwnerFeedback
from swarm.core.trust import credential
from swarm.core.trust.credential import PeerKey
from swarm.core.trust.signed_entry import entry_body
from swarm.core.wire_protocol import PROTOCOL
from swarm.net.bulk.transport import Transport
from swarm.net.dht_entries import EntryValidator, guard, read_entries, sign_entry, store_entry
from swarm.net.exchange import restarted_groupmates
from swarm.net.exchange.allreduce import Exchange, ExchangeFailed, ExchangeResult
from swarm.net.exchange.rendezvous import Member, group_digest, group_key, rendezvous
from swarm.net.exchange.slices.inbox import MAX_OPEN_KEYS
from swarm.net.exchange.slices.reduction import check_agreement
from swarm.net.link.link_stats import LinkEstimates
from swarm.net.votes import Vote, collect_votes, post_vote, vote_key
from swarm.v1 import exchange_pb2

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

RUN_ID = "run-test-exchange"
NUMEL = 100_003  # not divisible by 3: the slices differ in length


COORDINATOR = PeerKey.generate()


class Peer:
    def __init__(self, transport: Transport, exchange: Exchange, index: int):
        self.transport = transport
        self.exchange = exchange
        self.index = index
        self.credential: credential.Member = make_member(COORDINATOR, RUN_ID, transport.peer_id)
        self.name = self.credential.peer_id

    def member(self, *, weight: float, codec: str = "fp32", numel: int = NUMEL, bulk: bool = True) -> Member:
        """``bulk``: announce this peer's bulk channel (its slices then come over it), as a peer does."""
        return Member(
            peer_id=self.name,
            dht_peer_id=self.transport.peer_id,
            index=self.index,
            weight=weight,
            numel=numel,
            codec=codec,
            bulk=self.exchange.bulk_address if bulk else "",
        )

    def group(
        self,
        key: str,
        me: Member,
        planned: set[str] | Callable[[], set[str]],
        *,
        window_s: float = 20.0,
        processes: dict[str, str] | None = None,
        plan_holds: bool = False,
        hold_s: float | None = None,
        ttl_s: float = 60.0,
    ) -> list[Member]:
        plan = planned if callable(planned) else (lambda: planned)
        return rendezvous(
            self.transport.dht,
            key=key,
            me=me,
            member=self.credential,
            planned=plan,
            window_s=window_s,
            ttl_s=ttl_s,
            poll_s=0.05,
            processes=lambda: processes or {},
            plan_holds=lambda: plan_holds,
            hold_s=hold_s,
        )

    def average(
        self,
        key: str,
        me: Member,
        planned: set[str],
        delta: torch.Tensor,
        *,
        window_s: float = 20.0,
        timeout_s: float = 30.0,
        owner: OwnerFeedback | None = None,
        processes: dict[str, str] | None = None,
    ) -> tuple[list[Member], ExchangeResult]:
        """The group this peer found and the exchange's result."""
        group = self.group(key, me, planned, window_s=window_s, processes=processes)
        return group, self.exchange.average(key=key, group=group, me=me, delta=delta, timeout_s=timeout_s, owner=owner)


def three_peers(run_id: str = RUN_ID) -> Iterator[list[Peer]]:
    """Three real hivemind transports on loopback, each with an Exchange of ``run_id`` (the fixtures' body)."""
    transports: list[Transport] = []
    try:
        transports.append(Transport(initial_peers=[]))
        for _ in range(2):
            transports.append(Transport(initial_peers=transports[0].visible_maddrs))
        yield [Peer(t, Exchange(t, run_id=run_id), i) for i, t in enumerate(transports)]
    finally:
        for t in reversed(transports):
            t.shutdown()


@pytest.fixture(scope="module")
def peers() -> Iterator[list[Peer]]:
    yield from three_peers()


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

    results = results_of(
        concurrently(
            [lambda p=p, m=m, d=d: p.average(key, m, planned, d) for p, m, d in zip(peers, members, inputs)],
            timeout_s=60,
        )
    )

    expected = weighted_average(inputs, weights)
    for group, result in results:
        assert [m.peer_id for m in group] == [p.name for p in peers]
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

    results = [
        result
        for _, result in results_of(
            concurrently(
                [lambda p=p, m=m, d=d: p.average(key, m, planned, d) for p, m, d in zip(peers, members, inputs)],
                timeout_s=60,
            )
        )
    ]

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


@pytest.mark.parametrize("stripe_min_bytes", [None, 1024])  # None: one stripe at this size; 1024: several
@pytest.mark.parametrize("codec", ["sign", "ternary@0.01"])  # ternary@0.01: variable-size, blocks of 4,096
def test_owners_keep_their_residual_across_rounds_as_the_simulator_does(
    peers: list[Peer], codec: str, stripe_min_bytes: int | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """1-bit and sparse ternary codecs: each owner adds what re-encoding its averaged slices (one per stripe) lost
    last round, exactly as ``butterfly_reference`` (the simulator) does with its owners' residuals."""
    if stripe_min_bytes:
        monkeypatch.setattr(average_module, "STRIPE_MIN_BYTES", stripe_min_bytes)
    stripes = stripe_count(codec, NUMEL, 3)
    assert (stripes > 1) == bool(stripe_min_bytes)
    weights = [3.0, 1.0, 2.0]
    planned = {p.name for p in peers}
    owners, reference_owners = [OwnerFeedback() for _ in peers], [OwnerFeedback() for _ in peers]
    members = [p.member(weight=w, codec=codec) for p, w in zip(peers, weights)]
    for round_no in (20, 21):
        inputs = deltas(round_no, 3)
        results = [
            result
            for _, result in results_of(
                concurrently(
                    [
                        lambda p=p, m=m, d=d, o=o: p.average(group_key(RUN_ID, round_no), m, planned, d, owner=o)
                        for p, m, d, o in zip(peers, members, inputs, owners)
                    ],
                    timeout_s=60,
                )
            )
        ]
        expected = butterfly_reference(inputs, weights, codec, owners=reference_owners)
        for result in results:
            assert torch.equal(result.average, expected)
        for owner in owners + reference_owners:
            owner.commit()
        assert all(torch.equal(a.residual, b.residual) for a, b in zip(owners, reference_owners))
    bounds = butterfly_bounds(NUMEL, 3, get_codec(codec).block, stripes)
    assert [o.bounds for o in owners] == [bounds[k::3] for k in range(3)]


def test_an_entry_left_by_a_replaced_process_is_not_its_peers_and_the_others_average_without_it(
    peers: list[Peer],
) -> None:
    # the third peer posted, then died and was restarted: the coordinator now lists its new process's libp2p id,
    # and the entry under the old one (here another node's id: nothing of that peer answers there) is stale
    key = group_key(RUN_ID, 4)
    present, restarted = peers[:2], peers[2]
    old_id = present[0].transport.peer_id
    old_process = make_member(COORDINATOR, RUN_ID, old_id, key=restarted.credential.key)  # its credential then
    stale = dataclasses.replace(restarted.member(weight=7.0), dht_peer_id=old_id)
    store_entry(restarted.transport.dht, key, stale, member=old_process, ttl_s=60)
    processes = {p.name: p.transport.peer_id for p in peers}
    weights, inputs = [2.0, 3.0], deltas(4, 2)
    members = [p.member(weight=w) for p, w in zip(present, weights)]

    results = results_of(
        concurrently(
            [
                lambda p=p, m=m, d=d: p.average(key, m, {q.name for q in peers}, d, window_s=2.0, processes=processes)
                for p, m, d in zip(present, members, inputs)
            ],
            timeout_s=60,
        )
    )

    for group, result in results:
        assert [m.peer_id for m in group] == [p.name for p in present]
        assert torch.equal(result.average, weighted_average(inputs, weights))


def test_a_planned_peer_that_never_shows_up_is_left_out_after_the_window(peers: list[Peer]) -> None:
    key = group_key(RUN_ID, 3)
    present = peers[:2]
    planned = {p.name for p in peers}  # the third was planned but never posts
    weights = [2.0, 3.0]
    inputs = deltas(3, 2)
    members = [p.member(weight=w) for p, w in zip(present, weights)]
    window_s = 2.0

    started = time.monotonic()
    results = results_of(
        concurrently(
            [
                lambda p=p, m=m, d=d: p.average(key, m, planned, d, window_s=window_s)
                for p, m, d in zip(present, members, inputs)
            ],
            timeout_s=60,
        )
    )

    assert time.monotonic() - started >= window_s  # they waited the window out for p2
    expected = weighted_average(inputs, weights)
    for group, result in results:
        assert [m.peer_id for m in group] == [p.name for p in present]
        assert torch.equal(result.average, expected)


def test_a_planned_peer_that_posts_after_the_group_formed_fails_at_once(peers: list[Peer]) -> None:
    """A straggler that finished its inner steps after the others' window closed used to see their entries, form a
    group of all three and wait the exchange's whole timeout for groupmates who had long averaged without it."""
    key = group_key(RUN_ID, 23)
    present, late = peers[:2], peers[2]
    planned = {p.name for p in peers}
    inputs = deltas(23, 2)
    results = results_of(
        concurrently(
            [
                lambda p=p, d=d: p.average(key, p.member(weight=1.0), planned, d, window_s=1.0)
                for p, d in zip(present, inputs)
            ],
            timeout_s=60,
        )
    )
    assert all([m.peer_id for m in group] == [p.name for p in present] for group, _ in results)

    started = time.monotonic()
    with pytest.raises(ExchangeFailed, match="the group averaged without this peer"):
        late.average(key, late.member(weight=1.0), planned, deltas(24, 1)[0], window_s=20.0, timeout_s=30.0)
    assert time.monotonic() - started < 10.0  # not the 20 s window nor the 30 s exchange timeout


def test_while_the_coordinator_still_plans_a_late_peer_the_window_waits_for_it(peers: list[Peer]) -> None:
    """The WAN testbed's overlap run: a peer that posted the moment the round opened closed its window before the
    slowest planned peer posted, while a member that posted later included it; three rounds voided in a row."""
    key = group_key(RUN_ID, 27)
    planned = {p.name for p in peers}
    window_s = 1.0

    def late() -> list[Member]:
        time.sleep(window_s + 0.5)  # the scenario: it posts after the others' window, before twice it
        return peers[2].group(key, peers[2].member(weight=1.0), planned, window_s=window_s, plan_holds=True)

    groups = results_of(
        concurrently(
            [
                lambda p=p: p.group(key, p.member(weight=1.0), planned, window_s=window_s, plan_holds=True)
                for p in peers[:2]
            ]
            + [late],
            timeout_s=60,
        )
    )
    assert all([m.peer_id for m in g] == [p.name for p in peers] for g in groups)  # one group, on every member


def test_a_peer_that_posts_long_before_its_planned_groupmates_waits_for_them(peers: list[Peer]) -> None:
    """The WAN testbed's first round: start-up probes taken as four peers started on two cores cut one peer's budget
    to 9 steps; it posted within seconds, its window (held at most twice its length) closed long before its
    groupmates finished their 300 steps, and the round committed its 9 steps alone. Held while the coordinator
    plans them (``hold_s``: a peer holds up to the round's timeout), it forms one group with them (its entry is
    posted again as its short ttl runs down: that path runs here, though this DHT still served the old entry)."""
    key = group_key(RUN_ID, 31)
    planned = {p.name for p in peers}
    window_s, ttl_s = 0.5, 1.5

    def late(peer: Peer) -> list[Member]:
        time.sleep(6 * window_s)  # past twice the window, and past the early peer's first entry's ttl
        return peer.group(
            key, peer.member(weight=1.0), planned, window_s=window_s, plan_holds=True, hold_s=30.0, ttl_s=ttl_s
        )

    def early():
        member = peers[0].member(weight=1.0)
        return peers[0].group(key, member, planned, window_s=window_s, plan_holds=True, hold_s=30.0, ttl_s=ttl_s)

    groups = results_of(concurrently([early, lambda: late(peers[1]), lambda: late(peers[2])], timeout_s=60))
    assert all([m.peer_id for m in g] == [p.name for p in peers] for g in groups)  # one group, on every member


def test_when_the_coordinator_drops_a_planned_peer_the_window_closes_on_its_new_plan(peers: list[Peer]) -> None:
    key = group_key(RUN_ID, 29)
    present = peers[:2]
    started = time.monotonic()
    plan = lambda: {p.name for p in (peers if time.monotonic() - started < 2.5 else present)}  # noqa: E731
    groups = results_of(
        concurrently(
            [lambda p=p: p.group(key, p.member(weight=1.0), plan, window_s=2.0, plan_holds=True) for p in present],
            timeout_s=60,
        )
    )
    assert 2.5 <= time.monotonic() - started < 3.8  # past the window, closed on the new plan (refreshed each second)
    assert all([m.peer_id for m in g] == [p.name for p in present] for g in groups)


def test_members_that_formed_different_groups_all_fail_at_once(peers: list[Peer]) -> None:
    """A peer posting just as the window closes can be seen by some members and not others: the soak's straggler
    run had two peers wait out the 30 s exchange timeout for a groupmate whose slices named another group."""
    key = group_key(RUN_ID, 25)
    members = [p.member(weight=1.0) for p in peers]
    views = [members[:2], members, members]  # peer 0 did not see peer 2's entry in time, peers 1 and 2 did
    inputs = deltas(25, 3)
    started = time.monotonic()
    outcomes = concurrently(
        [
            lambda p=p, g=g, d=d: p.exchange.average(
                key=key, group=g, me=g[[m.peer_id for m in g].index(p.name)], delta=d, timeout_s=30.0
            )
            for p, g, d in zip(peers, views, inputs)
        ],
        timeout_s=60,
    )
    assert time.monotonic() - started < 10.0  # nobody waited out the 30 s timeout
    assert all(isinstance(o, ExchangeFailed) for o in outcomes), outcomes
    assert any("in another group" in str(o) for o in outcomes), outcomes  # the others may be told by an abort


def test_a_member_that_posts_but_never_exchanges_fails_the_others(peers: list[Peer]) -> None:
    # its own round: round 4's key also holds another test's entries (same peers, 60 s ttl), and a peer that read one
    # of those saw another group (a full suite failed so, with "averages in another group")
    key = group_key(RUN_ID, 34)
    planned = {p.name for p in peers}
    inputs = deltas(34, 3)
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
            return peers[i].exchange.average(
                key=key, group=group, me=members[i], delta=inputs[i], timeout_s=timeout_s
            ), time.monotonic() - started
        except ExchangeFailed as e:
            return e, time.monotonic() - started

    outcomes = results_of(concurrently([lambda: active(0), lambda: active(1), silent_member], timeout_s=60))

    assert [m.peer_id for m in outcomes[2]] == [p.name for p in peers]
    for outcome, seconds in outcomes[:2]:
        assert isinstance(outcome, ExchangeFailed), f"expected ExchangeFailed, got {outcome!r}"
        # its own timeout, or the first groupmate's to time out, which tells the others (abort); on a loaded machine
        # the dial to the silent member can fail first (a full suite saw it once): that ends it too, with its reason
        text = str(outcome)
        assert key in text
        unreachable = "cannot reach groupmate" in text
        assert "did not complete" in text or "no complete exchange within" in text or unreachable, text
        assert (unreachable or timeout_s - 1 <= seconds) and seconds < timeout_s + 3


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
            return peers[i].exchange.average(
                key=key, group=group, me=members[i], delta=inputs[i], timeout_s=timeout_s, on_phase=on_phase
            ), time.monotonic() - started
        except ExchangeFailed as e:
            return e, time.monotonic() - started

    outcomes = results_of(concurrently([lambda: member(0), lambda: member(1), lambda: member(2)], timeout_s=60))
    assert "injected" in str(outcomes[2][0])
    for outcome, seconds in outcomes[:2]:
        assert isinstance(outcome, ExchangeFailed), f"expected ExchangeFailed, got {outcome!r}"
        assert f"groupmate {peers[2].name} gave up (" in str(outcome) and "link is down" in str(outcome)
        assert seconds < 10, f"took {seconds:.1f}s: the abort did not reach it, it waited for its timeout"


def test_forged_group_entries_are_ignored_and_the_honest_group_still_forms(peers: list[Peer]) -> None:
    a, b, attacker = peers
    key = group_key(RUN_ID, 901)
    dht = attacker.transport.dht  # the forger stores through its own node; every node serves the key
    expires = get_dht_time() + 60
    victim = make_member(COORDINATOR, RUN_ID, "QmVictimNeverPosts")  # a planned member that crashed
    stranger = PeerKey.generate()  # never talked to the coordinator
    other_run = make_member(PeerKey.generate(), RUN_ID, attacker.transport.peer_id)  # another coordinator's

    def entry(peer_id: str, weight: float = 1e30) -> Member:
        return Member(
            peer_id=peer_id, dht_peer_id=attacker.transport.peer_id, index=0, weight=weight, numel=NUMEL, codec="fp32"
        )

    # no credential at all: the entry a bare DHT node could always store
    dht.store(key, subkey=stranger.peer_id, value=vars(entry(stranger.peer_id)), expiration_time=expires)
    # a well-signed entry, but under another coordinator's credential
    dht.store(
        key,
        subkey=other_run.peer_id,
        expiration_time=expires,
        value=sign_entry(other_run, key, entry(other_run.peer_id), expires_at=expires),
    )
    # a member of this run (the attacker's own credential) speaking for someone else
    dht.store(
        key,
        subkey=victim.peer_id,
        expiration_time=expires,
        value=sign_entry(attacker.credential, key, entry(victim.peer_id), expires_at=expires),
    )
    planned = {a.name, b.name, victim.peer_id, stranger.peer_id, other_run.peer_id}
    weights = [2.0, 3.0]
    inputs = deltas(901, 2)
    members = [a.member(weight=weights[0]), b.member(weight=weights[1])]

    results = results_of(
        concurrently(
            [
                lambda p=p, m=m, d=d: p.average(key, m, planned, d, window_s=2.0)
                for p, m, d in zip([a, b], members, inputs)
            ],
            timeout_s=60,
        )
    )

    for group, result in results:
        assert [m.peer_id for m in group] == [a.name, b.name]
        assert torch.equal(result.average, weighted_average(inputs, weights))


def test_an_entry_replayed_under_another_key_or_for_another_libp2p_id_is_ignored(peers: list[Peer]) -> None:
    a, b, attacker = peers
    expires = get_dht_time() + 60
    earlier, later = group_key(RUN_ID, 902), group_key(RUN_ID, 903)
    genuine = sign_entry(a.credential, earlier, a.member(weight=1.0), expires_at=expires)
    attacker.transport.dht.store(earlier, subkey=a.name, value=genuine, expiration_time=expires)
    attacker.transport.dht.store(later, subkey=a.name, value=genuine, expiration_time=expires)  # replayed
    # a's own signature, but its slices would go to the attacker's node
    elsewhere = Member(
        peer_id=a.name, dht_peer_id=attacker.transport.peer_id, index=0, weight=1.0, numel=NUMEL, codec="fp32"
    )
    attacker.transport.dht.store(
        later,
        subkey=b.name,
        expiration_time=expires,
        value=sign_entry(a.credential, later, elsewhere, expires_at=expires),
    )

    assert set(read_entries(b.transport.dht, earlier, Member, member=b.credential)) == {a.name}
    assert read_entries(b.transport.dht, later, Member, member=b.credential) == {}


def test_votes_forged_for_another_peer_are_ignored(peers: list[Peer]) -> None:
    a, b, attacker = peers
    key = group_key(RUN_ID, 904)
    honest = Vote(peer_id=b.name, dht_peer_id=b.transport.peer_id, ok=True, state_hash="h-honest")
    post_vote(b.transport.dht, key, honest, member=b.credential, ttl_s=60)
    forged = Vote(peer_id=a.name, dht_peer_id=attacker.transport.peer_id, ok=True, state_hash="h-forged")
    expires = get_dht_time() + 60
    attacker.transport.dht.store(
        vote_key(key),
        subkey=a.name,
        expiration_time=expires,
        value=sign_entry(attacker.credential, vote_key(key), forged, expires_at=expires),
    )

    assert collect_votes(a.transport.dht, key, [b.name], member=a.credential, timeout_s=5).votes == {b.name: honest}
    assert collect_votes(a.transport.dht, key, [a.name, b.name], member=a.credential, timeout_s=0.5) is None


def _forge(
    attacker: Peer, target: Peer, key: str, digest: str, phase: int, part: int, sender: int, payload: bytes
) -> Optional[bool]:
    """Send one slice to target as if from group position ``sender``; its acknowledgement (None: none came)."""
    message = exchange_pb2.TensorChunk(
        key=key, group_digest=digest, phase=phase, part=part, sender=sender, chunk=0, num_chunks=1, data=payload
    )
    try:
        ack = attacker.transport.run(
            attacker.transport.p2p.call_protobuf_handler(
                PeerID.from_base58(target.transport.peer_id),
                f"swarm_{RUN_ID}.part",
                as_aiter(message),
                exchange_pb2.ChunkAck,
            ),
            timeout_s=10,
        )
    except ValueError:  # hivemind sometimes closes the stream without the handler's reply
        return None
    return ack.ok


def _pair_exchange_while(
    a: Peer, b: Peer, key: str, members: list[Member], inputs: list[torch.Tensor], meanwhile: Callable[[], None]
) -> list[ExchangeResult]:
    """a and b average under ``key``; ``meanwhile`` runs on its own thread while a, its group known, waits 1.5 s
    before sending."""
    sending = threading.Event()

    def side() -> None:
        assert sending.wait(30)
        meanwhile()

    thread = threading.Thread(target=side, daemon=True)
    thread.start()

    def run(p: Peer, me: Member, delta: torch.Tensor) -> ExchangeResult:
        group = p.group(key, me, {a.name, b.name})
        hook = (lambda phase: (sending.set(), 1.5)[1] if phase == "sending" else None) if p is a else None
        return p.exchange.average(key=key, group=group, me=me, delta=delta, timeout_s=30, on_phase=hook)

    results = results_of(
        concurrently([lambda: run(a, members[0], inputs[0]), lambda: run(b, members[1], inputs[1])], timeout_s=60)
    )
    thread.join(10)
    return results


def test_slices_and_aborts_from_a_non_member_are_dropped_and_the_average_is_bit_identical(peers: list[Peer]) -> None:
    a, b, attacker = peers
    key = group_key(RUN_ID, 905)
    weights = [5.0, 7.0]
    inputs = deltas(905, 2)
    members = [a.member(weight=weights[0]), b.member(weight=weights[1])]
    digest = group_digest(members)
    bounds = part_bounds(NUMEL, 2, CODECS["fp32"].block)
    huge = [CODECS["fp32"].encode(torch.full((e - s,), 3e30)) for s, e in bounds]
    C, A, X = exchange_pb2.PHASE_CONTRIBUTION, exchange_pb2.PHASE_AVERAGED, exchange_pb2.PHASE_ABORT
    # before the group forms: b's contribution and average to a, a's to b, and an abort in each one's name
    for target, me, other in ((a, 0, 1), (b, 1, 0)):
        _forge(attacker, target, key, digest, C, me, other, huge[me])
        _forge(attacker, target, key, digest, A, other, other, huge[other])
        _forge(attacker, target, key, digest, X, 0, other, b"stop")
    acks: list[Optional[bool]] = []

    def during_the_exchange() -> None:
        acks.extend(
            _forge(attacker, a, key, digest, phase, part, 1, payload)
            for phase, part, payload in ((C, 0, huge[0]), (A, 1, huge[1]), (X, 0, b"stop"))
        )
        for other in range(906, 906 + 2 * MAX_OPEN_KEYS):  # early slices of other rounds must not evict this one
            _forge(attacker, a, group_key(RUN_ID, other), digest, C, 0, 1, huge[0])

    rejected_before = a.exchange.rejected_chunks
    results = _pair_exchange_while(a, b, key, members, inputs, during_the_exchange)

    expected = weighted_average(inputs, weights)
    assert all(torch.equal(r.average, expected) for r in results)
    assert acks and not any(acks), f"a slice from a non-member was acknowledged: {acks}"
    assert a.exchange.rejected_chunks - rejected_before >= 6  # three buffered before the group, three during


def test_a_members_message_for_a_part_its_exchange_does_not_have_is_refused_and_the_average_still_completes(
    peers: list[Peer],
) -> None:
    """A member may name only the exchange's own parts and phases: each other (phase, part) would take memory until
    the exchange ends. Such a message is refused with the reason, counted, and does not fail the exchange the way a
    member of another group does."""
    a, b, _ = peers
    key = group_key(RUN_ID, 915)
    inputs = deltas(915, 2)
    members = [a.member(weight=1.0), b.member(weight=1.0)]
    digest = group_digest(members)
    parts = 2 * stripe_count("fp32", NUMEL, 2)
    acks: list[Optional[bool]] = []
    refusals: list[str] = []

    def b_oversteps() -> None:  # b, a real member in its own position
        for phase, part in (
            (exchange_pb2.PHASE_CONTRIBUTION, parts),
            (exchange_pb2.PHASE_AVERAGED, 10**6),
            (7, 0),
            (exchange_pb2.PHASE_ABORT, 3),
        ):
            acks.append(_forge(b, a, key, digest, phase, part, 1, b"x" * 64))
        refusals.append(
            a.exchange.inbox.refusal(
                key, b.transport.peer_id, (digest, exchange_pb2.PHASE_CONTRIBUTION, parts, 1, b.transport.peer_id)
            )
        )

    rejected_before = a.exchange.rejected_chunks
    results = _pair_exchange_while(a, b, key, members, inputs, b_oversteps)
    expected = weighted_average(inputs, [1.0, 1.0])
    assert all(torch.equal(r.average, expected) for r in results)
    assert acks == [False] * 4, acks
    assert a.exchange.rejected_chunks - rejected_before == 4
    assert refusals == [
        f"this exchange has no phase 1 part {parts} (it has {parts} parts); the sender's exchange is"
        " cut otherwise, e.g. another Swarm version's"
    ]


def test_a_group_smaller_than_the_runs_live_peers_takes_a_proportionally_smaller_outer_step():
    from swarm.net.exchange.rendezvous import participation_scale

    def m(i: int, live: int) -> Member:
        return Member(
            peer_id=f"p{i}", dht_peer_id=f"d{i}", index=i, weight=8.0, numel=10, codec="fp32", live_peers=live
        )

    assert participation_scale([m(0, 5)]) == 0.2  # alone among five live peers
    assert participation_scale([m(0, 4), m(1, 5)]) == 0.4  # members that heard different counts agree on the max
    assert participation_scale([m(0, 2), m(1, 2)]) == 1.0  # the whole run
    assert participation_scale([m(0, 0), m(1, 0)]) == 1.0  # nobody knew (coordinator down): plain average
    assert group_digest([m(0, 4)]) != group_digest([m(0, 5)])  # a different view is caught, not merged


def _record(key: str, subkey: str, value, expiration_time: float) -> DHTRecord:
    """The record a DHT node validates when it is asked to store ``value`` (what hivemind builds)."""
    return DHTRecord(
        DHTID.generate(source=key).to_bytes(),
        MSGPackSerializer.dumps(subkey),
        MSGPackSerializer.dumps(value),
        expiration_time,
    )


def test_a_guarded_dht_node_refuses_to_store_anything_but_a_members_signed_entry_for_that_key() -> None:
    member = make_member(COORDINATOR, RUN_ID, "QmMember")
    other_coordinators = make_member(PeerKey.generate(), RUN_ID, "QmOther")
    validator = EntryValidator(coordinator_public_key=COORDINATOR.public_key, run_id=RUN_ID)
    key, other_key = group_key(RUN_ID, 950), group_key(RUN_ID, 951)
    entry = Member(peer_id=member.peer_id, dht_peer_id="QmMember", index=0, weight=1.0, numel=10, codec="fp32")
    expires = get_dht_time() + 60
    signed = sign_entry(member, key, entry, expires_at=expires)

    assert validator.validate(_record(key, member.peer_id, signed, expires))
    assert not validator.validate(_record(key, member.peer_id, vars(entry), expires))  # unsigned
    assert not validator.validate(_record(other_key, member.peer_id, signed, expires))  # replayed under another key
    swapped = dict(signed, key=other_key)
    assert not validator.validate(_record(other_key, member.peer_id, swapped, expires))  # key swapped
    assert not validator.validate(_record(key, "p-0123456789abcdef", signed, expires))  # under another peer's subkey
    forged = Member(
        peer_id=other_coordinators.peer_id, dht_peer_id="QmOther", index=0, weight=1e30, numel=10, codec="fp32"
    )
    forged_signed = sign_entry(other_coordinators, key, forged, expires_at=expires)
    assert not validator.validate(_record(key, forged.peer_id, forged_signed, expires))
    assert not validator.validate(DHTRecord(DHTID.generate(source=key).to_bytes(), b"\xc1", b"\xc1", 0.0))


def test_a_forged_entry_cannot_displace_a_members_entry_on_guarded_nodes() -> None:
    started: list[Transport] = []
    try:
        started.append(Transport(initial_peers=[]))
        started += [Transport(initial_peers=started[0].visible_maddrs) for _ in range(2)]
        a, b, attacker = started  # the attacker's node is not guarded: it stores whatever it is given
        members = [make_member(COORDINATOR, RUN_ID, t.peer_id) for t in (a, b)]
        for t, m in zip((a, b), members):
            guard(t.dht, m)
        key = group_key(RUN_ID, 960)
        honest = Member(peer_id=members[0].peer_id, dht_peer_id=a.peer_id, index=0, weight=1.0, numel=10, codec="fp32")
        store_entry(a.dht, key, honest, member=members[0], ttl_s=30)
        forged = dataclasses.replace(honest, weight=1e30, dht_peer_id=attacker.peer_id)
        attacker.dht.store(key, subkey=honest.peer_id, value=vars(forged), expiration_time=get_dht_time() + 600)

        assert read_entries(b.dht, key, Member, member=members[1]) == {honest.peer_id: honest}
        assert read_entries(a.dht, key, Member, member=members[0]) == {honest.peer_id: honest}
    finally:
        for t in reversed(started):
            t.shutdown()


def test_a_groupmate_of_another_exchange_protocol_fails_the_exchange_with_one_sentence() -> None:
    """A peer from before stripes cuts its slices differently: averaging with it would mix unrelated slices."""
    me = Member(peer_id="new", dht_peer_id="d1", index=0, weight=1.0, numel=NUMEL, codec="fp32", protocol=PROTOCOL)
    old = dataclasses.replace(me, peer_id="old", dht_peer_id="d2", index=1, protocol=0)  # its entry had no field
    with pytest.raises(ExchangeFailed, match="groupmate old runs another version of the exchange.*upgrade the older"):
        check_agreement("k", [me, old], me)
    check_agreement("k", [me, dataclasses.replace(old, protocol=PROTOCOL)], me)  # the same release: fine
    assert "protocol" not in entry_body(old).decode() and f'"protocol":{PROTOCOL}' in entry_body(me).decode()
    assert group_digest([old]) != group_digest([dataclasses.replace(old, protocol=PROTOCOL)])


def test_every_exchange_times_its_sends_receives_and_pings_per_groupmate(peers: list[Peer]) -> None:
    numel = 2_100_003  # in stripes (fp32: 8), a slice of one 1 MiB chunk is timed from its stream's opening
    inputs = deltas(90, 3, numel)
    planned = {p.name for p in peers}
    # libp2p's path: on loopback the bulk channel lands a slice in less than the 1 ms a timing needs
    # (test_bulk_channel times paced bulk transfers)
    members = [p.member(weight=1.0, numel=numel, bulk=False) for p in peers]

    for key in (group_key(RUN_ID, 90), group_key(RUN_ID, 91)):  # the second reports the pings the first sent
        results = results_of(
            concurrently(
                [lambda p=p, m=m, d=d: p.average(key, m, planned, d) for p, m, d in zip(peers, members, inputs)],
                timeout_s=60,
            )
        )

    expected = weighted_average(inputs, [1.0, 1.0, 1.0])
    for peer, (_, result) in zip(peers, results):
        assert torch.equal(result.average, expected)  # timing changes nothing that is averaged
        links = result.links
        others = planned - {peer.name}
        # two sends per groupmate and stripe (its contribution slice, this peer's averaged slice), all of bytes_sent
        assert sorted(t.peer for t in links.uploads) == sorted(list(others) * 2 * stripe_count("fp32", numel, 3))
        assert sum(t.bytes for t in links.uploads) == result.bytes_sent
        assert {t.peer for t in links.downloads} == others
        assert all(t.timed() for t in links.uploads), [(t.bytes, t.seconds) for t in links.uploads]
        assert any(t.timed() for t in links.downloads), [(t.bytes, t.seconds) for t in links.downloads]
        assert set(links.rtt_s) == others and all(0 < s < 1 for s in links.rtt_s.values())
        estimates = LinkEstimates()
        estimates.observe(links)
        for value in (estimates.upload_mbit_s, estimates.download_mbit_s, estimates.rtt_ms):
            assert math.isfinite(value) and value > 0


def test_a_joining_peer_gets_a_first_rtt_estimate_from_the_run_peers_it_is_connected_to(peers: list[Peer]) -> None:
    rtt_s = peers[0].transport.run(peers[0].exchange.probe.rtt_s_to_connected(), timeout_s=10)
    others = {p.transport.peer_id for p in peers[1:]}
    assert others <= set(rtt_s) and all(0 < rtt_s[o] < 1 for o in others)
    stranger = Transport(initial_peers=peers[0].transport.visible_maddrs)  # a node of no run: never answers
    try:
        connected = peers[0].transport.run(peers[0].transport.p2p.list_peers(), timeout_s=10)
        assert stranger.peer_id in {info.peer_id.to_base58() for info in connected}
        assert stranger.peer_id not in peers[0].transport.run(
            peers[0].exchange.probe.rtt_s_to_connected(), timeout_s=10
        )
    finally:
        stranger.shutdown()


def _with_shares(
    peers: list[Peer], key: str, members: list[Member], inputs: list[torch.Tensor], shares: list[float]
) -> list[Any]:
    planned = {p.name for p in peers}

    def run(i: int) -> Any:
        group = peers[i].group(key, members[i], planned)
        return peers[i].exchange.average(
            key=key, group=group, me=members[i], delta=inputs[i], timeout_s=30, shares=shares
        )

    return concurrently([lambda i=i: run(i) for i in range(len(peers))], timeout_s=60)


@pytest.mark.parametrize("codec", ["fp32", "int8"])
def test_unequal_shares_give_every_member_the_same_average_and_a_slow_uplink_sends_less(
    peers: list[Peer], codec: str
) -> None:
    """The controller's shares size the slices (a slow uplink owns a small one): the average is the same
    bits on every member and the same as with equal slices; the small owner sends less."""
    key = group_key(RUN_ID, 1101 if codec == "fp32" else 1102)
    weights, shares = [5.0, 3.0, 2.0], [0.6, 0.3, 0.1]
    inputs = deltas(11, 3)
    members = [dataclasses.replace(p.member(weight=w, codec=codec), plan="same-choice") for p, w in zip(peers, weights)]

    results = results_of(_with_shares(peers, key, members, inputs, shares))

    expected = butterfly_reference(inputs, weights, codec)  # equal slices: any block-aligned cut agrees
    for result in results:
        assert torch.equal(result.average, expected)
    sent = [r.bytes_sent for r in results]
    payload = CODECS[codec].encoded_size(NUMEL)
    for share, bytes_sent in zip(shares, sent):  # (1 − s) of its contribution out, then s to each of 2 others
        assert bytes_sent == pytest.approx(payload * ((1 - share) + 2 * share), rel=0.02)
    assert sent[2] < sent[1] < sent[0]


def test_members_holding_different_controller_choices_fail_loudly(peers: list[Peer]) -> None:
    key = group_key(RUN_ID, 1103)
    inputs = deltas(12, 3)
    members = [dataclasses.replace(p.member(weight=1.0), plan="a" if i < 2 else "b") for i, p in enumerate(peers)]

    outcomes = _with_shares(peers, key, members, inputs, [1.0, 1.0, 1.0])

    for outcome in outcomes:
        assert isinstance(outcome, ExchangeFailed) and "different controller choices" in str(outcome), outcome


def test_an_exchange_reuses_its_result_vector_only_once_nothing_holds_it(peers: list[Peer]) -> None:
    """The result goes into memory the last exchange used once its caller let go of it (a first touch costs a page
    fault per page), never while a tensor, a view or an array still shares it; every average stays exact."""
    a, b, _ = peers
    members = [a.member(weight=1.0), b.member(weight=1.0)]

    def a_result(round_no: int) -> torch.Tensor:
        key = group_key(RUN_ID, round_no)
        inputs = deltas(round_no, 2)

        def run(p: Peer, me: Member, delta: torch.Tensor) -> ExchangeResult:
            return p.exchange.average(
                key=key, group=p.group(key, me, {a.name, b.name}), me=me, delta=delta, timeout_s=30
            )

        results = results_of(
            concurrently([lambda: run(a, members[0], inputs[0]), lambda: run(b, members[1], inputs[1])], timeout_s=60)
        )
        assert all(torch.equal(r.average, weighted_average(inputs, [1.0, 1.0])) for r in results)
        return results[0].average

    held = a_result(921)[5:]  # a view of the first result, kept
    first_values = held.clone()
    reused = a.exchange._results.reused
    second = a_result(922)
    assert a.exchange._results.reused == reused  # the first is still held: a fresh vector
    assert torch.equal(held, first_values)  # and the second exchange did not write into it
    second_memory = second.data_ptr()
    del second  # as a peer does once its outer step is applied
    assert a_result(923).data_ptr() == second_memory and a.exchange._results.reused == reused + 1


def test_decoded_contributions_go_into_memory_the_last_exchange_let_go_and_every_average_stays_exact(
    peers: list[Peer],
) -> None:
    """An int4 butterfly decodes each contribution into memory an earlier stripe or exchange used (a first touch
    costs a page fault per page) and reduces straight into the result: the second exchange takes only such memory,
    and both averages are the simulator's, bit for bit, on every member."""
    weights = [3.0, 1.0, 2.0]
    members = [p.member(weight=w, codec="int4") for p, w in zip(peers, weights)]

    def exchange(round_no: int) -> None:
        key = group_key(RUN_ID, round_no)
        inputs = deltas(round_no, 3)
        results = results_of(
            concurrently(
                [
                    lambda p=p, me=me, d=d: p.exchange.average(
                        key=key, group=p.group(key, me, {q.name for q in peers}), me=me, delta=d, timeout_s=30
                    )
                    for p, me, d in zip(peers, members, inputs)
                ],
                timeout_s=60,
            )
        )
        expected = butterfly_reference(inputs, weights, "int4")
        assert all(torch.equal(r.average, expected) for r in results)

    exchange(931)
    gc.collect()  # a send that fell back from the bulk channel under load leaves a traceback cycle holding a frame
    taken = [p.exchange._scratch.reused for p in peers]
    exchange(932)
    takes = len(peers) * stripe_count("int4", NUMEL, len(peers))  # per stripe: 3 decodes (the reduction: the result)
    assert [p.exchange._scratch.reused - before for p, before in zip(peers, taken)] == [takes] * len(peers)


def test_fp32_averages_into_each_members_own_delta_bit_identically(peers: list[Peer]) -> None:
    """With ``into_delta`` every member's average is written into its own Δ's memory (no result vector beside it)
    and is still the simulator's, bit for bit."""
    key = group_key(RUN_ID, 940)
    weights = [2.0, 5.0, 1.0]
    inputs = deltas(940, 3)
    expected = butterfly_reference([d.clone() for d in inputs], weights, "fp32")
    members = [p.member(weight=w) for p, w in zip(peers, weights)]
    results = results_of(
        concurrently(
            [
                lambda p=p, me=me, d=d: p.exchange.average(
                    key=key,
                    group=p.group(key, me, {q.name for q in peers}),
                    me=me,
                    delta=d,
                    timeout_s=30,
                    into_delta=True,
                )
                for p, me, d in zip(peers, members, inputs)
            ],
            timeout_s=60,
        )
    )
    assert all(r.average.data_ptr() == d.data_ptr() for r, d in zip(results, inputs))
    assert all(torch.equal(r.average, expected) for r in results)


@pytest.mark.parametrize("codec", ["fp32", "int4"])
def test_a_group_of_one_averages_alone_sending_nothing(peers: list[Peer], codec: str) -> None:
    key = group_key(RUN_ID, 941 if codec == "fp32" else 942)
    me = peers[0].member(weight=3.0, codec=codec)
    mine = deltas(941, 1)[0]
    expected = butterfly_reference([mine.clone()], [3.0], codec)
    result = peers[0].exchange.average(key=key, group=[me], me=me, delta=mine, timeout_s=30, into_delta=True)
    assert torch.equal(result.average, expected) and result.bytes_sent == result.bytes_received == 0


def test_a_restarted_groupmate_that_the_abort_missed_is_told_the_exchange_already_failed(peers: list[Peer]) -> None:
    # b's process died as the round's exchange began: a averages with b's old process (its entry named another
    # libp2p id, here the third node's), fails and aborts to that id. b's restarted process then starts the same
    # round's exchange with a: a refuses its slices with the reason, so b fails at once instead of waiting for a's
    # slices for its whole timeout (the chaos soak lost 10 s of the swarm so)
    a, b, old_process = peers
    key = group_key(RUN_ID, 41)
    inputs = deltas(41, 2)
    me_a, me_b = a.member(weight=1.0), b.member(weight=1.0)
    b_then = dataclasses.replace(me_b, dht_peer_id=old_process.transport.peer_id, bulk="")

    def fail(phase: str) -> None:
        if phase == "sending":
            raise ExchangeFailed("injected: cannot reach groupmate b")

    with pytest.raises(ExchangeFailed, match="injected"):
        a.exchange.average(key=key, group=[me_a, b_then], me=me_a, delta=inputs[0], timeout_s=10, on_phase=fail)
    _b_is_refused_at_once_and_the_next_round_is_unaffected(
        a, b, key, inputs, f"this peer's exchange of {key} already failed (injected: cannot reach", next_round=42
    )


def _b_is_refused_at_once_and_the_next_round_is_unaffected(
    a: Peer, b: Peer, key: str, inputs: list[torch.Tensor], refusal: str, *, next_round: int
) -> None:
    """b's restarted process starts ``key``'s exchange with a: a refuses it with ``refusal`` (not as an intruder),
    b fails at once, and the next round between the two is bit-identical."""
    me_a, me_b = a.member(weight=1.0), b.member(weight=1.0)
    intruders_before = a.exchange.rejected_chunks
    started = time.monotonic()
    with pytest.raises(ExchangeFailed) as info:
        b.exchange.average(key=key, group=[me_a, me_b], me=me_b, delta=inputs[1], timeout_s=20)
    assert time.monotonic() - started < 5, "b waited for slices a will never send"
    assert f"{a.name} refused a slice: {refusal}" in str(info.value)
    assert a.exchange.rejected_chunks == intruders_before  # refused with the reason, not counted as an intruder's

    key = group_key(RUN_ID, next_round)
    results = results_of(
        concurrently(
            [
                lambda: a.exchange.average(key=key, group=[me_a, me_b], me=me_a, delta=inputs[0], timeout_s=30),
                lambda: b.exchange.average(key=key, group=[me_a, me_b], me=me_b, delta=inputs[1], timeout_s=30),
            ],
            timeout_s=60,
        )
    )
    assert torch.equal(results[0].average, results[1].average)
    assert torch.equal(results[0].average, weighted_average(inputs, [1.0, 1.0]))


def test_a_groupmate_whose_process_restarted_mid_exchange_fails_the_exchange_at_once(
    peers: list[Peer], monkeypatch: pytest.MonkeyPatch
) -> None:
    # b's process died as the round's exchange began, after a had its group: a waits for the old process's slices.
    # b's restarted process posts its signed entry for the round and sends its slices: a refuses them (not that
    # member's libp2p id), but the entry shows b was restarted, so a fails now instead of after its timeout (a chaos
    # soak: 8 s of three peers). A message from an id no entry names changes nothing.
    a, b, old_process = peers
    key = group_key(RUN_ID, 45)
    inputs = deltas(45, 2)
    me_a, me_b = a.member(weight=1.0), b.member(weight=1.0)
    b_then = dataclasses.replace(old_process.member(weight=1.0), peer_id=me_b.peer_id)
    a.exchange.read_entries_as(a.credential)
    monkeypatch.setattr(restarted_groupmates, "RECHECK_S", 0.0)  # b's second try is looked up again at once
    waiting = threading.Thread(
        target=lambda: outcome.append(
            _outcome(lambda: a.exchange.average(key=key, group=[me_a, b_then], me=me_a, delta=inputs[0], timeout_s=20))
        )
    )
    outcome: list = []
    started = time.monotonic()
    waiting.start()
    with pytest.raises(ExchangeFailed):  # an id with no entry (b before it posts): refused, a keeps waiting
        b.exchange.average(key=key, group=[me_a, me_b], me=me_b, delta=inputs[1], timeout_s=3)
    assert waiting.is_alive()
    store_entry(b.transport.dht, key, me_b, member=b.credential, ttl_s=60)  # then b's new process tries again
    with pytest.raises(ExchangeFailed):
        b.exchange.average(key=key, group=[me_a, me_b], me=me_b, delta=inputs[1], timeout_s=5)
    waiting.join(timeout=30)
    assert time.monotonic() - started < 12, "a waited out its timeout for the old process's slices"
    (failure,) = outcome
    assert isinstance(failure, ExchangeFailed)
    assert f"groupmate {me_b.peer_id} restarted: its new process sent this round's slices" in str(failure)


def _outcome(call: Callable[[], Any]) -> Any:
    try:
        return call()
    except Exception as e:  # the outcome is what the test checks
        return e


def test_a_restarted_process_sent_into_a_round_its_group_already_completed_is_told_so_at_once(
    peers: list[Peer],
) -> None:
    # b's old process and a completed a round's exchange (while their coordinator was away, say). b's process then
    # died, and the coordinator, restarted and not yet told how far the group got, sent b's new process into that
    # round: a refuses its slices with the reason, so b fails at once instead of waiting for a's slices for its
    # whole timeout (the chaos soak stalled the swarm 9 s so: the coordinator waited for b's report)
    a, b, old_process = peers
    key = group_key(RUN_ID, 43)
    inputs = deltas(43, 2)
    me_a, me_b = a.member(weight=1.0), b.member(weight=1.0)
    b_then = dataclasses.replace(old_process.member(weight=1.0), peer_id=me_b.peer_id)
    results_of(
        concurrently(
            [
                lambda: a.exchange.average(key=key, group=[me_a, b_then], me=me_a, delta=inputs[0], timeout_s=30),
                lambda: old_process.exchange.average(
                    key=key, group=[me_a, b_then], me=b_then, delta=inputs[1], timeout_s=30
                ),
            ],
            timeout_s=60,
        )
    )
    _b_is_refused_at_once_and_the_next_round_is_unaffected(
        a,
        b,
        key,
        inputs,
        f"this peer's exchange of {key} is over: it completed in a group without this sender",
        next_round=44,
    )
