"""In-process fakes for a peer's network parts, so the peer daemon's lifecycle runs in threads of one
process: the real coordinator engine and servicer behind a fake client (no gRPC), and a fake network
for the group exchange, the DHT votes and the state transfer (no hivemind). Trainers are real."""

from __future__ import annotations

import itertools
import math
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable, Optional

import torch

from coordinator.api.servicer import CoordinatorServicer
from coordinator.engine import CoordinatorEngine
from coordinator.store.database import Store
from peer.daemon import PeerDaemon
from peer.link.coordinator_link import GroupDecided
from peer.options import PeerOptions
from peer.parts import PeerParts
from swarm.config import RunConfig
from swarm.control.client import CoordinatorClient, CoordinatorRejected, CoordinatorUnreachable
from swarm.control.joinstring import JoinString
from swarm.control.signing import CallSigner, signed_join
from swarm.core.average import butterfly_reference
from swarm.core.codecs.codec import get_codec
from swarm.core.state import GlobalState
from swarm.core.trust import commit_rule
from swarm.core.trust.credential import PeerKey
from swarm.net.bulk.state_transfer import StateUnavailable
from swarm.net.dht_entries import sign_entry
from swarm.net.exchange.group import signed_votes
from swarm.net.exchange.rendezvous import group_key
from swarm.net.link.libp2p_identity import Libp2pIdentity
from swarm.net.votes import Vote as DhtVote
from swarm.net.votes import group_id, vote_key
from swarm.train.contribution import Contribution
from swarm.train.round import Averaged, SyncFailed, Vote
from swarm.v1 import coordinator_pb2 as pb

JOIN = JoinString.parse("swarm://127.0.0.1:7000?token=t&fp=" + "0" * 64)


class _Context:
    def __init__(self, metadata=None) -> None:
        self.metadata = metadata or []

    def invocation_metadata(self):
        return self.metadata

    def peer(self) -> str:
        return "ipv4:127.0.0.1:50000"

    def abort(self, code, details):
        raise CoordinatorRejected(details, code)


class FakeCoordinator:
    """The real engine and servicer; ``down`` makes every call fail as if the coordinator were gone."""

    def __init__(self, run: RunConfig, store: Optional[Store] = None) -> None:
        self.engine = CoordinatorEngine(store or Store(":memory:"), config=run, lease_s=30.0, heartbeat_interval_s=0.2)
        self.servicer = CoordinatorServicer(self.engine, dht_initial_peers=[])
        self.down = threading.Event()

    def call(self, method: str, request, metadata=None):
        if self.down.is_set():
            raise CoordinatorUnreachable("the coordinator is down (test)")
        self.engine.tick()
        return getattr(self.servicer, method)(request, _Context(metadata))

    def status(self) -> pb.GetStatusResponse:
        return self.engine.status(self.engine.run.token)


class FakeClient:
    """CoordinatorClient's calls, signed the same way, straight into the servicer."""

    def __init__(self, coordinator: FakeCoordinator, token: Optional[str] = None) -> None:
        self.coordinator = coordinator
        self.token = token if token is not None else coordinator.engine.run.token
        self.signer: Optional[CallSigner] = None

    def join(self, *, key, libp2p, site="", device="", name="", swarm_version=None):
        nonce = self.coordinator.call("Challenge", pb.ChallengeRequest()).nonce
        joined = self.coordinator.call(
            "Join",
            signed_join(token=self.token, nonce=nonce, key=key, libp2p=libp2p, site=site, device=device, name=name),
        )
        self.signer = CallSigner(key, joined.session)
        return joined

    def _signed(self, method: str, request):
        metadata = self.signer.metadata(method, request) if self.signer is not None else None
        return self.coordinator.call(method, request, metadata)

    def heartbeat(self, request):
        return self._signed("Heartbeat", request)

    def get_round(self, peer_id: str, round_no: int = 0):
        return self._signed("GetRound", pb.GetRoundRequest(peer_id=peer_id, round=round_no))

    def report_round(self, request):
        return self._signed("ReportRound", request)

    def leave(self, peer_id: str, reason: str = ""):
        return self._signed("Leave", pb.LeaveRequest(peer_id=peer_id, reason=reason))

    def close(self) -> None:
        pass


_FAKE_LIBP2P_ID = "QmXoypizjW3WknFiJnKLwHCnL72vedxjQkDDP1mXWo6uco"


class FakeTransport:
    def __init__(self, peer_id: str) -> None:
        # a well-formed multiaddr (the coordinator refuses others); nothing dials it
        self.peer_id, self.visible_maddrs = peer_id, [f"/dns/{peer_id}.fake/tcp/4001/p2p/{_FAKE_LIBP2P_ID}"]

    def shutdown(self) -> None:
        pass


class FakeNet:
    """The DHT and libp2p of all peers of one test: groups form from whoever the coordinator planned
    (or, while it is down, the last group), votes are kept per round, and states are served by holder."""

    def __init__(self, run: RunConfig) -> None:
        self.run, self.cond = run, threading.Condition()
        self.contributions: dict[tuple, dict[str, tuple[int, Contribution]]] = {}
        self.groups: dict[tuple, tuple[list[str], torch.Tensor]] = {}
        self.votes: dict[tuple, dict[str, tuple[Vote, str, Optional[dict]]]] = {}  # vote, DHT id, signed value
        self.published: dict[str, GlobalState] = {}
        self.codecs: dict[tuple, dict[str, str]] = {}  # key -> peer id -> the codec it sent with
        self.links: Callable[[str, int], tuple[float, float]] = lambda peer_id, round_no: (math.nan, math.nan)
        self.transports = 0
        self.drop_votes_from: Optional[int] = None  # votes of this round and later are lost (never stored)
        self.dropped: dict[int, set[str]] = {}  # round -> peers whose vote was lost

    def transport(self, peer_id: str) -> FakeTransport:
        with self.cond:
            self.transports += 1
            return FakeTransport(peer_id)

    def average(
        self,
        key: tuple,
        peer_id: str,
        index: int,
        contribution: Contribution,
        planned: Callable[[], Optional[set[str]]],
        codec: Optional[str] = None,
    ) -> Averaged:
        """``codec``: the round plan's (the controller's choice), else the run's; members that disagree fail."""
        codec = codec or self.run.rounds.codec
        with self.cond:
            if key in self.groups:
                raise SyncFailed(f"{key}: the group already formed without this peer")
            self.contributions.setdefault(key, {})[peer_id] = (index, contribution)
            self.codecs.setdefault(key, {})[peer_id] = codec
            self.cond.notify_all()
            deadline = time.monotonic() + 5.0
            while key not in self.groups and time.monotonic() < deadline:
                expected = planned() or set()
                if expected and expected <= set(self.contributions[key]):
                    break
                self.cond.wait(0.05)
            if key not in self.groups:
                members = sorted(self.contributions[key], key=lambda p: self.contributions[key][p][0])
                parts = [self.contributions[key][m][1] for m in members]
                if len({self.codecs[key][m] for m in members}) > 1:
                    raise SyncFailed(f"{key}: groupmates disagree on the codec {self.codecs[key]}")
                average = butterfly_reference(
                    [c.delta for c in parts], [float(c.samples) for c in parts], get_codec(codec)
                )
                self.groups[key] = (members, average)
                self.cond.notify_all()
            members, average = self.groups[key]
            if peer_id not in members:
                raise SyncFailed(f"{key}: the group formed without this peer")
            up, down = self.links(peer_id, key[0])
            return Averaged(
                average=average,
                group=list(members),
                bytes_sent=4 * average.numel(),
                upload_mbit_s=up,
                download_mbit_s=down,
            )

    def post(self, key: tuple, peer_id: str, dht_id: str, vote: Vote, signed: Optional[dict] = None) -> None:
        with self.cond:
            if self.drop_votes_from is not None and key[0] >= self.drop_votes_from:
                self.dropped.setdefault(key[0], set()).add(peer_id)
                self.cond.notify_all()
                return
            self.votes.setdefault(key, {})[peer_id] = (vote, dht_id, signed)
            self.cond.notify_all()

    def group_decision(self, key: tuple, group: list[str]):
        """Like collecting the DHT votes: waits a while for every groupmate's vote."""
        with self.cond:
            if not group or not self.cond.wait_for(lambda: set(group) <= set(self.votes.get(key, {})), timeout=5.0):
                return None
            votes = {p: self.votes[key][p] for p in group}  # the DHT read keeps the group's votes only
            members = frozenset(group)
            committed = commit_rule.decide(
                [commit_rule.Claim(p, v.ok, v.state_hash, members) for p, (v, _, _) in votes.items()], members
            ).committed_hash
            holders = [d for v, d, _ in votes.values() if v.ok and v.state_hash == committed]
            signed = {p: value for p, (_, _, value) in votes.items() if value is not None}
            return GroupDecided(committed, holders, signed_votes(signed) if len(signed) == len(votes) else [])


class FakeGroup:
    def __init__(
        self,
        net: FakeNet,
        transport: FakeTransport,
        *,
        peer_id: str,
        peer_index: int,
        planned,
        member=None,
        run_id: str = "",
    ) -> None:
        self.net, self.transport, self.peer_id, self.peer_index, self.planned = (
            net,
            transport,
            peer_id,
            peer_index,
            planned,
        )
        self.member, self.run_id = member, run_id  # with a member, votes are signed as in the DHT
        self.live_peers = 0

    def average(self, round_no: int, contribution: Contribution) -> Averaged:
        return self.net.average(
            (round_no, contribution.fragment),
            self.peer_id,
            self.peer_index,
            contribution,
            lambda: self.planned(round_no),
            codec=contribution.plan.codec,
        )

    def post(self, vote: Vote) -> None:
        signed = None
        if self.member is not None:
            entry = DhtVote(
                peer_id=self.peer_id,
                dht_peer_id=self.transport.peer_id,
                ok=vote.ok,
                state_hash=vote.state_hash,
                group=group_id(vote.group) if vote.ok else "",
            )
            signed = sign_entry(self.member, vote_key(group_key(self.run_id, vote.round_no, vote.fragment)), entry)
        self.net.post((vote.round_no, vote.fragment), self.peer_id, self.transport.peer_id, vote, signed)

    def group_decision(self, vote: Vote):
        return self.net.group_decision((vote.round_no, vote.fragment), vote.group)

    def probe_rtt_ms(self) -> float:
        return float("nan")  # no network to measure


class FakeTransfer:
    def __init__(self, net: FakeNet, transport: FakeTransport) -> None:
        self.net, self.transport = net, transport

    def publish(self, state: GlobalState) -> None:
        with self.net.cond:
            self.net.published[self.transport.peer_id] = state

    def download(self, holders: list[str], *, round_no: int, expected_hash: str, like: GlobalState):
        with self.net.cond:
            for holder in holders:
                state = self.net.published.get(holder)
                if state is not None and state.round_no == round_no and state.state_hash == expected_hash:
                    copy = GlobalState(
                        round_no, [p.clone() for p in state.params], [t.clone() for t in state.outer_state]
                    )
                    return copy, 4 * sum(p.numel() for p in state.params)
        raise StateUnavailable(f"no holder serves round {round_no}")


_IDENTITIES: list[Libp2pIdentity] = []  # made once per process and reused: an RSA key takes a while to make


def pooled_identity(index: int) -> Libp2pIdentity:
    while len(_IDENTITIES) <= index:
        _IDENTITIES.append(libp2p_identity())
    return _IDENTITIES[index]


class FakeParts(PeerParts):
    """Each peer of one test gets its own libp2p identity, made ahead: a peer's join is then as quick as a
    real one on a machine that made its key already (the tests' timing assumes joins are quick)."""

    def __init__(self, coordinator: FakeCoordinator, net: FakeNet, *, peers: int = 4) -> None:
        self.coordinator, self.net = coordinator, net
        self._identities = itertools.count()
        pooled_identity(peers - 1)

    def libp2p_identity(self, state_dir) -> Libp2pIdentity:
        return pooled_identity(next(self._identities))

    def spare_libp2p_identity(self, state_dir) -> None:
        """Fake peers take pooled identities: no RSA key made in the background to slow the tests' rounds."""

    def client(self, join) -> FakeClient:
        return FakeClient(self.coordinator)

    def transport(self, options, initial_peers, *, stop, tag, identity, member=None) -> FakeTransport:
        return self.net.transport(identity.peer_id)

    # processes=dict: the fake DHT keeps no entry of a dead process
    def group(
        self, transport, run, *, run_id, peer_id, peer_index, planned, faults, member=None, processes=dict
    ) -> FakeGroup:
        return FakeGroup(
            self.net, transport, peer_id=peer_id, peer_index=peer_index, planned=planned, member=member, run_id=run_id
        )

    def state_transfer(self, transport, *, run_id, timeout_s, member=None) -> FakeTransfer:
        return FakeTransfer(self.net, transport)


class PeerThread(threading.Thread):
    """One peer daemon on a thread; ``code`` is its exit code once it ends."""

    def __init__(self, parts: FakeParts, state_dir, **options) -> None:
        super().__init__(daemon=True, name=f"peer-{state_dir}")
        options.setdefault("poll_s", 0.02)
        options.setdefault("final_serve_s", 10.0)
        self.daemon_ = PeerDaemon(PeerOptions(join=JOIN, state_dir=state_dir, **options), parts)
        self.code: Optional[int] = None
        self.states: list = []  # every lifecycle state the daemon entered, in order
        enter = self.daemon_.enter

        def recording(state) -> None:
            if not self.states or self.states[-1] is not state:
                self.states.append(state)
            enter(state)

        self.daemon_.enter = recording

    def run(self) -> None:
        self.code = self.daemon_.run()

    @property
    def trainer(self):
        return self.daemon_.runner.trainer


def wait_until(predicate: Callable[[], bool], *, timeout_s: float = 60.0, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def engine_join(engine: CoordinatorEngine, token: Optional[str] = None, *, key: Optional[PeerKey] = None, **fields):
    """``engine.join`` for a new key (or ``key``), as the servicer calls it once a join's signatures check out."""
    key = key or PeerKey.generate()
    return engine.join(engine.run.token if token is None else token, public_key=key.public_key, **fields)


def libp2p_identity() -> Libp2pIdentity:
    """A fresh libp2p identity in a temporary file (as a peer makes at each start)."""
    return Libp2pIdentity.create(Path(tempfile.mkdtemp(prefix="swarm-p2p-")) / "p2p-identity.key")


def member_client(
    join: JoinString, *, key: Optional[PeerKey] = None, **fields
) -> tuple[CoordinatorClient, pb.JoinResponse]:
    """A real client joined as a new peer (or as ``key``): each peer has its own client, since its calls
    are signed with its own key."""
    client = CoordinatorClient(join, request_timeout_s=5, connect_timeout_s=5)
    try:
        return client, client.join(key=key or PeerKey.generate(), libp2p=libp2p_identity(), **fields)
    except BaseException:
        client.close()
        raise
