"""The bulk channel (swarm.net.bulk.bulk_channel) under the butterfly all-reduce, three real hivemind peers in one
process: slices that go over it give every member the simulator's bits; bytes that an on-path attacker changes
are refused while the exchange still completes; a member without a reachable bulk address still exchanges; bytes
not yet verified stay under the channel's cap."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import socket
import sys
import threading
import time
from typing import Iterator

import pytest
import torch
from hivemind.p2p import PeerID

from swarm.core.average import butterfly_reference, stripe_count
from swarm.net.bulk.bulk_channel import (
    BAD_FRAME,
    MAGIC,
    MAX_CLAIMS_PER_SENDER,
    MISMATCH,
    NO_CLAIM,
    OK,
    OVER_CAP,
    PREFIX,
    BulkChannel,
    fresh_claim_secrets,
    parse_bulk_address,
    tag,
)
from swarm.net.bulk.tcp_congestion import CONGESTION_CONTROL, try_congestion
from swarm.net.exchange.rendezvous import Member, group_digest, group_key
from swarm.net.link.link_stats import throughput_mbit_s
from swarm.v1 import exchange_pb2
from tests.unit.test_exchange import Peer, concurrently, results_of, three_peers

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

RUN_ID = "run-test-exchange"  # the Peer helper's credentials are for this run
NUMEL = 600_001  # fp32 slices of ~0.8 MB


@pytest.fixture(scope="module")
def trio() -> Iterator[list[Peer]]:
    yield from three_peers()


def exchange(trio: list[Peer], key: str, group: list[Member], inputs: list[torch.Tensor]) -> list:
    """Every peer averages with ``group`` as given (no rendezvous: the members' entries are the test's)."""
    return [
        r.average
        for r in results_of(
            concurrently(
                [
                    lambda p=p, m=m, d=d: p.exchange.average(key=key, group=group, me=m, delta=d, timeout_s=60)
                    for p, m, d in zip(trio, group, inputs)
                ],
                timeout_s=90,
            )
        )
    ]


def frames_taken(trio: list[Peer]) -> list[int]:
    return [p.exchange.bulk.frames_taken for p in trio]


# ternary@0.5's payloads have sizes that depend on their values (an entropy code): the claim carries the most a
# slice may take, its frame the length it has (1_500_001 ternary@0.5 elements: ~95 KB slices)
@pytest.mark.parametrize(
    "round_number, codec, numel", [(201, "fp32", NUMEL), (202, "int4", NUMEL), (203, "ternary@0.5", 1_500_001)]
)
def test_slices_over_the_bulk_channel_give_every_member_the_simulators_bits(
    trio: list[Peer], round_number: int, codec: str, numel: int
) -> None:
    weights = [5.0, 2.0, 1.0]
    inputs = [torch.randn(numel, generator=torch.Generator().manual_seed(round_number + i)) for i in range(3)]
    group = [p.member(weight=w, codec=codec, numel=numel) for p, w in zip(trio, weights)]
    before = frames_taken(trio)

    averages = exchange(trio, group_key(RUN_ID, round_number), group, inputs)

    expected = butterfly_reference(inputs, weights, codec)
    assert all(torch.equal(a, expected) for a in averages)
    # each peer took its two groupmates' contributions and their two averaged slices over the channel, in each
    # stripe (fp32: 4 of ~200 KB slices, the others 1)
    stripes = stripe_count(codec, numel, 3)
    assert stripes == (4 if codec == "fp32" else 1)
    assert [after - b for after, b in zip(frames_taken(trio), before)] == [4 * stripes] * 3


class TamperingProxy:
    """An on-path attacker in front of a peer's bulk channel: it sees every frame's header and bytes, tries each
    frame first with one byte changed, then passes the real one on (and its answer back)."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.listener.getsockname()[1]}"
        self.tampered_answers: list[int] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return  # closed
            threading.Thread(target=self._relay, args=(client,), daemon=True).start()

    def _relay(self, client: socket.socket) -> None:
        upstream = socket.create_connection(self.target)
        with client, upstream:
            while True:
                prefix = _read(client, PREFIX.size)
                if prefix is None:
                    return
                head = _read(client, PREFIX.unpack(prefix)[1])
                header = exchange_pb2.BulkHeader.FromString(head)
                body = bytearray(_read(client, header.length))
                forged = bytearray(body)
                forged[len(forged) // 2] ^= 0x01
                with socket.create_connection(self.target) as attacker:
                    attacker.sendall(prefix + head + forged)
                    self.tampered_answers.append(_read(attacker, 1)[0])
                upstream.sendall(prefix + head + body)
                client.sendall(_read(upstream, 1))

    def close(self) -> None:
        self.listener.close()


def _read(sock: socket.socket, size: int) -> bytes | None:
    data = b""
    while len(data) < size:
        more = sock.recv(size - len(data))
        if not more:
            return None
        data += more
    return data


def test_bytes_changed_on_the_way_are_refused_and_the_exchange_still_gives_the_simulators_bits(
    trio: list[Peer],
) -> None:
    round_number, weights = 203, [1.0, 3.0, 2.0]
    inputs = [torch.randn(NUMEL, generator=torch.Generator().manual_seed(round_number + i)) for i in range(3)]
    proxy = TamperingProxy(parse_bulk_address(trio[0].exchange.bulk_address))
    try:
        group = [p.member(weight=w, numel=NUMEL) for p, w in zip(trio, weights)]
        group[0] = dataclasses.replace(group[0], bulk=proxy.address)  # what the others dial to reach peer 0
        refused_before = trio[0].exchange.bulk.drops.counts.get(MISMATCH, 0)

        averages = exchange(trio, group_key(RUN_ID, round_number), group, inputs)
    finally:
        proxy.close()

    expected = butterfly_reference(inputs, weights, "fp32")
    assert all(torch.equal(a, expected) for a in averages)
    frames = 4 * stripe_count("fp32", NUMEL, 3)  # both groupmates' contribution and averaged slice, per stripe
    assert proxy.tampered_answers == [MISMATCH] * frames
    assert trio[0].exchange.bulk.drops.counts[MISMATCH] - refused_before == frames


def test_a_frame_no_member_claimed_is_refused_before_its_bytes_are_read(trio: list[Peer]) -> None:
    head = exchange_pb2.BulkHeader(
        key=group_key(RUN_ID, 204),
        group_digest="0" * 16,
        phase=exchange_pb2.PHASE_CONTRIBUTION,
        part=0,
        sender=1,
        tag=os.urandom(16),
        length=1 << 30,
        ticket=os.urandom(16),
    ).SerializeToString()
    with socket.create_connection(parse_bulk_address(trio[0].exchange.bulk_address)) as stranger:
        stranger.sendall(PREFIX.pack(MAGIC, len(head)) + head)
        assert stranger.recv(1) == bytes([NO_CLAIM])  # answered at once: the GiB it announced was never awaited
        assert stranger.recv(1) == b""  # and the connection closed
    assert trio[0].exchange.bulk.pending_bytes == 0


def test_a_claim_of_several_slots_is_taken_only_from_the_member_of_every_slot(trio: list[Peer]) -> None:
    """A member claims all its slots with one groupmate in one message (``bulk_claims``); a groupmate that names
    another member's position in any slot of it gets nothing registered, and is told why."""
    key = group_key(RUN_ID, 208)
    group = [p.member(weight=1.0) for p in trio]
    digest = group_digest(group)
    receiver = trio[0]
    receiver.transport.run(
        receiver.exchange.inbox.expect(key, [m.dht_peer_id for m in group], digest, parts=200), timeout_s=5
    )

    def claim(sender: Peer, position: int, parts: list[int]) -> exchange_pb2.ChunkAck:
        claims = [
            exchange_pb2.BulkClaim(
                phase=exchange_pb2.PHASE_CONTRIBUTION,
                part=part,
                max_bytes=1 << 20,
                **dict(zip(("mac_key", "ticket"), fresh_claim_secrets())),
            )
            for part in parts
        ]
        message = exchange_pb2.TensorChunk(
            key=key, group_digest=digest, sender=position, chunk=0, num_chunks=1, bulk_claims=claims
        )

        async def one():
            yield message

        return sender.transport.run(
            sender.transport.p2p.call_protobuf_handler(
                PeerID.from_base58(receiver.transport.peer_id), f"swarm_{RUN_ID}.part", one(), exchange_pb2.ChunkAck
            ),
            timeout_s=10,
        )

    def registered() -> set[tuple[int, int]]:
        async def read():
            return {(slot[2], slot[3]) for slot in receiver.exchange.bulk._claims.get(key, {})}

        return receiver.transport.run(read(), timeout_s=5)

    try:
        forged = claim(trio[2], 1, [0, 3])  # position 1 is trio[1], not trio[2]
        assert not forged.ok and forged.error, forged  # (a groupmate naming another's position: "another group")
        assert registered() == set()
        honest = claim(trio[1], 1, [0, 3])
        assert honest.ok, honest.error
        assert registered() == {(0, 1), (3, 1)}  # (part, sender position)
        # past the per-sender cap part way through a claim: none of it stays registered
        assert claim(trio[1], 1, list(range(6, 6 + MAX_CLAIMS_PER_SENDER - 4))).ok  # two short of the cap
        over = claim(trio[1], 1, list(range(100, 105)))  # the first two fit, the third does not
        assert not over.ok and "too many bulk claims" in over.error
        assert len(registered()) == MAX_CLAIMS_PER_SENDER - 2 and not {p for p, _ in registered()} & set(
            range(100, 105)
        )
    finally:
        receiver.transport.run(receiver.exchange.inbox.forget(key), timeout_s=5)


def test_a_member_claims_its_bulk_slots_before_it_encodes_a_byte(trio: list[Peer]) -> None:
    """The claims' round trips (one RTT each, tens of ms through p2pd on a busy host) overlap the encoding
    instead of following it: while peer 0 is held before it encodes, each groupmate already holds peer 0's
    claims for its contribution and for peer 0's averaged slice; the exchange then gives the simulator's bits."""
    round_number, weights = 206, [1.0, 2.0, 3.0]
    key = group_key(RUN_ID, round_number)
    inputs = [torch.randn(NUMEL, generator=torch.Generator().manual_seed(round_number + i)) for i in range(3)]
    group = [p.member(weight=w, numel=NUMEL) for p, w in zip(trio, weights)]
    held = threading.Event()
    stripes = stripe_count("fp32", NUMEL, 3)  # slice i is position i % 3's

    def claims_from_peer0(peer: Peer) -> list[tuple[int, int]]:
        async def read() -> list[tuple[int, int]]:  # on the loop that owns the channel
            return sorted(
                (slot[1], slot[2])
                for slot, claim in peer.exchange.bulk._claims.get(key, {}).items()
                if claim.sender_id == trio[0].transport.peer_id
            )

        return peer.transport.run(read(), timeout_s=5)

    def peer0() -> torch.Tensor:
        hold = lambda phase: (held.set(), 3.0)[1] if phase == "sending" else None  # noqa: E731
        return (
            trio[0]
            .exchange.average(key=key, group=group, me=group[0], delta=inputs[0], timeout_s=60, on_phase=hold)
            .average
        )

    def watcher() -> list[list[tuple[int, int]]]:
        assert held.wait(30)
        deadline = time.monotonic() + 2.5  # well inside the 3 s that peer 0 is held
        while time.monotonic() < deadline:
            seen = [claims_from_peer0(p) for p in trio[1:]]
            if all(len(claims) == 2 * stripes for claims in seen):
                return seen
            time.sleep(0.02)
        return [claims_from_peer0(p) for p in trio[1:]]

    others = [
        lambda p=p, m=m, d=d: p.exchange.average(key=key, group=group, me=m, delta=d, timeout_s=60).average
        for p, m, d in zip(trio[1:], group[1:], inputs[1:])
    ]
    outcomes = results_of(concurrently([peer0, *others, watcher], timeout_s=90))

    contribution, averaged = exchange_pb2.PHASE_CONTRIBUTION, exchange_pb2.PHASE_AVERAGED
    assert outcomes[-1] == [
        sorted([(contribution, 3 * s + j) for s in range(stripes)] + [(averaged, 3 * s) for s in range(stripes)])
        for j in (1, 2)
    ]
    expected = butterfly_reference(inputs, weights, "fp32")
    assert all(torch.equal(a, expected) for a in outcomes[:3])


def test_members_without_a_reachable_bulk_address_exchange_over_libp2p(trio: list[Peer]) -> None:
    round_number, weights = 205, [2.0, 1.0, 1.0]
    inputs = [torch.randn(NUMEL, generator=torch.Generator().manual_seed(round_number + i)) for i in range(3)]
    with socket.create_server(("127.0.0.1", 0)) as closed:
        dead_address = f"127.0.0.1:{closed.getsockname()[1]}"  # nothing listens there once closed
    group = [p.member(weight=w, numel=NUMEL) for p, w in zip(trio, weights)]
    group[1] = dataclasses.replace(group[1], bulk=dead_address)  # announced, but unreachable (a firewall)
    group[2] = dataclasses.replace(group[2], bulk="")  # none announced (behind NAT)
    before = frames_taken(trio)

    averages = exchange(trio, group_key(RUN_ID, round_number), group, inputs)

    assert all(torch.equal(a, butterfly_reference(inputs, weights, "fp32")) for a in averages)
    # peer 0 still took its groupmates' slices over its bulk channel; the other two took theirs over libp2p
    assert [after - b for after, b in zip(frames_taken(trio), before)] == [4 * stripe_count("fp32", NUMEL, 3), 0, 0]


def test_a_group_without_bulk_addresses_keeps_its_digest() -> None:
    member = Member(peer_id="p", dht_peer_id="d", index=0, weight=1.0, numel=3, codec="fp32")
    assert group_digest([member]) == "d80333662a81b173"  # as before bulk addresses existed
    assert group_digest([dataclasses.replace(member, bulk="127.0.0.1:9")]) != group_digest([member])


def test_only_addresses_to_dial_are_taken_from_an_entry() -> None:
    assert parse_bulk_address("10.0.0.7:4001") == ("10.0.0.7", 4001)
    assert parse_bulk_address("[::1]:4001") == ("::1", 4001)
    for text in ["", "10.0.0.7", "10.0.0.7:0", "10.0.0.7:70000", "0.0.0.0:4001", "a b:1", "host/evil:1", "x:1\n"]:
        assert parse_bulk_address(text) is None, text


def test_bytes_beyond_the_unverified_cap_are_refused_and_counted() -> None:
    """A channel alone (no hivemind): claims for two slots, a cap that holds one of them at a time; a frame
    that names a claimed slot's ticket with more bytes than the claim allows, or another ticket, is refused."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    channel, taken = BulkChannel(max_pending_bytes=150_000), []

    async def deliver(payload, sizes, arrivals) -> bool:
        taken.append(bytes(payload))
        return True

    def frame(part: int, body: bytes, ticket: bytes, mac_key: bytes, length: int = 0) -> bytes:
        head = exchange_pb2.BulkHeader(
            key="k",
            group_digest="d",
            phase=exchange_pb2.PHASE_CONTRIBUTION,
            part=part,
            sender=1,
            tag=tag(mac_key, body),
            length=length or len(body),
            ticket=ticket,
        ).SerializeToString()
        return PREFIX.pack(MAGIC, len(head)) + head

    def answer(data: bytes) -> int:
        with socket.create_connection(address) as sock:
            sock.sendall(data)
            return sock.recv(1)[0]

    try:
        asyncio.run_coroutine_threadsafe(channel.start("127.0.0.1", None), loop).result(10)
        bodies = [os.urandom(100_000), os.urandom(100_000)]
        secrets = [fresh_claim_secrets() for _ in bodies]  # claimed before the bytes exist, as an exchange does
        for part, (body, (mac_key, ticket)) in enumerate(zip(bodies, secrets)):
            slot = ("d", exchange_pb2.PHASE_CONTRIBUTION, part, 1, ticket)
            loop.call_soon_threadsafe(channel.claim, "k", slot, len(body), mac_key, "sender", deliver)
        address = parse_bulk_address(channel.address)
        (key0, ticket0), (key1, ticket1) = secrets
        assert answer(frame(0, bodies[0], ticket0, key0, length=len(bodies[0]) + 1)) == BAD_FRAME  # over the claim
        assert answer(frame(0, bodies[0], os.urandom(16), key0)) == NO_CLAIM  # a ticket no one claimed
        with socket.create_connection(address) as first, socket.create_connection(address) as second:
            first.sendall(frame(0, bodies[0], ticket0, key0) + bodies[0][:50_000])  # half of it: held, unverified
            while channel.pending_bytes == 0:  # the loop thread has taken the header and holds the buffer
                threading.Event().wait(0.01)
            second.sendall(frame(1, bodies[1], ticket1, key1))
            assert second.recv(1) == bytes([OVER_CAP])  # 100 kB more would pass the 150 kB cap
            first.sendall(bodies[0][50_000:])
            assert first.recv(1) == bytes([OK])
        assert taken == [bodies[0]] and channel.pending_bytes == 0
        assert channel.drops.counts == {BAD_FRAME: 1, NO_CLAIM: 1, OVER_CAP: 1}
    finally:
        loop.call_soon_threadsafe(channel.close)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="pacing is Linux's SO_MAX_PACING_RATE")
@pytest.mark.parametrize("declared", ["pace", "uplink"])
def test_paced_bulk_connections_send_no_faster_than_the_pace(trio: list[Peer], declared: str) -> None:
    """The pace given as such, or from the uplink an operator declares (swarm peer --uplink-mbit): each of the
    K − 1 = 2 connections then gets 0.95 × uplink / 2."""
    round_number, weights, pace_mbit_s = 206 if declared == "pace" else 207, [1.0, 1.0, 1.0], 80.0
    numel = 4_500_000  # 6 MB per groupmate, 0.6 s at the pace: loopback's first window (~0.6 MB) goes unpaced
    inputs = [torch.randn(numel, generator=torch.Generator().manual_seed(round_number + i)) for i in range(3)]
    group = [p.member(weight=w, numel=numel) for p, w in zip(trio, weights)]
    try:
        for p in trio:
            if declared == "pace":
                p.exchange.pace_mbit_s = pace_mbit_s
            else:
                p.exchange.uplink_mbit_s = pace_mbit_s * 2 / 0.95
        results = results_of(
            concurrently(
                [
                    lambda p=p, m=m, d=d: p.exchange.average(
                        key=group_key(RUN_ID, round_number), group=group, me=m, delta=d, timeout_s=60
                    )
                    for p, m, d in zip(trio, group, inputs)
                ],
                timeout_s=90,
            )
        )
    finally:
        for p in trio:
            p.exchange.pace_mbit_s = p.exchange.uplink_mbit_s = 0.0
    assert all(torch.equal(r.average, butterfly_reference(inputs, weights, "fp32")) for r in results)
    # per groupmate, the frames of every stripe and both phases, which take turns on one connection
    stripes = stripe_count("fp32", numel, 3)
    assert all(len(r.links.uploads) == 2 * 2 * stripes for r in results)
    rates = [
        throughput_mbit_s(t for t in r.links.uploads if t.peer == peer)
        for r in results
        for peer in {t.peer for t in r.links.uploads}
    ]
    # unpaced, loopback moves Gbit/s. The sender's clock stops when a frame's last byte is in the socket buffer, and
    # the gaps between frames are not counted: a buffer that drained in a gap takes the next frame's first bytes at
    # once, so under load (longer gaps) the sender reads up to ~1.4x the pace (seen in a full suite run); the
    # receiver's timing below is the tight check.
    assert len(rates) == 6 and max(rates) < 2 * pace_mbit_s, rates
    # the receiving side times them too: what the link estimates take as the download rate
    received = [
        throughput_mbit_s(t for t in r.links.downloads if t.peer == peer)
        for r in results
        for peer in {t.peer for t in r.links.downloads}
    ]
    assert len(received) == 6 and all(0.5 * pace_mbit_s < rate < 1.25 * pace_mbit_s for rate in received), received
    # the connections run Swarm's congestion control, not the system's default (BBR on some: it overruns the
    # receivers' queues when K − 1 flows converge on a link)
    if try_congestion(CONGESTION_CONTROL) is None:  # where this process may pick it
        in_use = {
            pipe.sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, 16).rstrip(b"\0").decode()
            for p in trio
            for pipe in p.transport.bulk_sender._pipes.values()
        }
        assert in_use == {CONGESTION_CONTROL}
