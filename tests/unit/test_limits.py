"""Strangers' requests: every oversized or malformed field is refused in one sentence, never a traceback."""

from __future__ import annotations

import logging
import math
from typing import Any, Iterator

import grpc
import pytest
from google.protobuf.descriptor import FieldDescriptor
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from coordinator.api import limits
from coordinator.api.load import LoadMonitor
from coordinator.api.rate_limit import JoinLimits, Rate
from coordinator.api.servicer import CoordinatorServicer
from coordinator.api.serving import LoopServer
from coordinator.api.views import MAX_PAGE_SIZE
from coordinator.engine import CoordinatorEngine
from coordinator.server import SERVICE, servicer_handlers
from coordinator.store.database import Store
from swarm.app.status import fetch_all_pages
from swarm.config import RoundConfig, RunConfig
from swarm.control.signing import CallSigner, signed_join
from swarm.core.trust.credential import PeerKey
from swarm.core.wire_protocol import PROTOCOL
from swarm.v1 import coordinator_pb2 as pb
from tests.unit.fake_swarm import pooled_identity

pytestmark = pytest.mark.timeout(60)

PEER_ID = "QmXoypizjW3WknFiJnKLwHCnL72vedxjQkDDP1mXWo6uco"
GOOD_MADDR = f"/ip4/127.0.0.1/tcp/4001/p2p/{PEER_ID}"


class Aborted(Exception):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code, self.details = code, details


class FakeContext:
    def __init__(self, metadata=None) -> None:
        self.metadata = metadata or []

    def invocation_metadata(self):
        return self.metadata

    def peer(self) -> str:
        return "ipv4:127.0.0.1:50000"

    def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise Aborted(code, details)


def libp2p():
    """One libp2p identity for every peer of these tests (an RSA key takes a while to make)."""
    return pooled_identity(0)


class Coordinator:
    """An engine and its servicer in this process; calls go through the servicer's wrapper, signed as the
    peer they name signs them when that peer joined through ``join``."""

    def __init__(self) -> None:
        config = RunConfig(rounds=RoundConfig(min_peers=1, inner_steps=5))
        self.engine = CoordinatorEngine(Store(":memory:"), config=config, lease_s=30.0)
        many = Rate(per_s=1000.0, burst=100_000)  # these tests join hundreds of peers from one address
        self.servicer = CoordinatorServicer(
            self.engine,
            dht_initial_peers=[GOOD_MADDR],
            join_limits=JoinLimits(challenges_per_address=many, joins_per_address=many, joins_per_token=many),
        )
        self.token = self.engine.run.token
        self.signers: dict[str, CallSigner] = {}

    def call(self, method: str, request: Any) -> Any:
        signer = self.signers.get(getattr(request, "peer_id", None) or "")
        metadata = signer.metadata(method, request, now=self.engine._clock()) if signer else None
        return getattr(self.servicer, method)(request, FakeContext(metadata))

    def refusal(self, method: str, request: Any) -> Aborted:
        with pytest.raises(Aborted) as info:
            self.call(method, request)
        return info.value

    def join(self, **fields: Any) -> str:
        key = PeerKey.generate()
        nonce = self.call("Challenge", pb.ChallengeRequest()).nonce
        joined = self.call("Join", signed_join(token=self.token, nonce=nonce, key=key, libp2p=libp2p(), **fields))
        self.signers[joined.peer_id] = CallSigner(key, joined.session)
        return joined.peer_id


@pytest.fixture
def coordinator() -> Coordinator:
    return Coordinator()


@pytest.fixture(autouse=True)
def fresh_warnings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(limits, "_WARNINGS", limits.WarningLimiter())


def _malformed(peer: str, token: str) -> list[tuple[str, Any, str]]:
    """(method, request, words the refusal names) for each kind of bad field of each RPC."""
    big = "x" * 3 * 1024 * 1024
    metrics = pb.PeerMetrics
    return [
        ("Join", pb.JoinRequest(token=token, name=big), "name is 3145728 bytes"),
        ("Join", pb.JoinRequest(token=token, site="s" * 257), "site is 257 bytes"),
        ("Join", pb.JoinRequest(token=token, device="cpu\x1b[31m"), "device contains control characters"),
        ("Join", pb.JoinRequest(token=token, swarm_version="v" * 300), "swarm_version"),
        ("Join", pb.JoinRequest(token=token, dht_peer_id="p-1/../x"), "dht_peer_id may only hold"),
        ("Join", pb.JoinRequest(token="t" * 1000), "token is 1000 characters"),
        (
            "Heartbeat",
            pb.HeartbeatRequest(peer_id=peer, metrics=metrics(dht_maddrs=["garbage-not-a-multiaddr"])),
            "not a multiaddr ending in /p2p/<peer id>",
        ),
        (
            "Heartbeat",
            pb.HeartbeatRequest(peer_id=peer, metrics=metrics(dht_maddrs=["/ip4/1.2.3.4/tcp/5"])),
            "metrics.dht_maddrs",
        ),
        ("Heartbeat", pb.HeartbeatRequest(peer_id=peer, metrics=metrics(dht_maddrs=[GOOD_MADDR] * 65)), "65 entries"),
        ("Heartbeat", pb.HeartbeatRequest(peer_id=peer, metrics=metrics(state_hash="ab" * 100)), "state_hash is 200"),
        (
            "Heartbeat",
            pb.HeartbeatRequest(peer_id=peer, metrics=metrics(model_fingerprint="<b>")),
            "model_fingerprint may only hold",
        ),
        ("Heartbeat", pb.HeartbeatRequest(peer_id=peer, metrics=metrics(tokens=-5)), "metrics.tokens is -5"),
        ("Heartbeat", pb.HeartbeatRequest(peer_id=peer, metrics=metrics(bytes_sent=2**62)), "metrics.bytes_sent"),
        ("Heartbeat", pb.HeartbeatRequest(peer_id=peer, metrics=metrics(loss=math.inf)), "not a finite number"),
        ("Heartbeat", pb.HeartbeatRequest(peer_id=peer, metrics=metrics(wall_time_s=math.nan)), "wall_time_s is NaN"),
        ("Heartbeat", pb.HeartbeatRequest(peer_id=peer, metrics=metrics(step_time_s=-1.0)), "step_time_s"),
        ("Heartbeat", pb.HeartbeatRequest(peer_id=peer, metrics=metrics(state=99)), "not a known PeerState"),
        ("Heartbeat", pb.HeartbeatRequest(peer_id=peer, metrics=metrics(state_round=-7)), "state_round is -7"),
        ("Heartbeat", pb.HeartbeatRequest(peer_id="x" * 129), "peer_id is 129 characters"),
        ("Leave", pb.LeaveRequest(peer_id=peer, reason="r" * 5000), "reason is 5000 bytes"),
        ("Leave", pb.LeaveRequest(peer_id=peer, reason="bye\nINFO forged log line"), "reason contains control"),
        ("ReportRound", pb.ReportRoundRequest(peer_id=peer, round=1, error="e" * 2000), "error is 2000 bytes"),
        ("ReportRound", pb.ReportRoundRequest(peer_id=peer, round=1, group=["p"] * 2000), "group has 2000 entries"),
        ("ReportRound", pb.ReportRoundRequest(peer_id=peer, round=1, group=["p 1"]), "group may only hold"),
        ("ReportRound", pb.ReportRoundRequest(peer_id=peer, round=2**40), "round is 1099511627776"),
        ("ReportRound", pb.ReportRoundRequest(peer_id=peer, round=1, samples=-1), "samples is -1"),
        ("ReportRound", pb.ReportRoundRequest(peer_id=peer, round=1, exchange_time_s=math.inf), "exchange_time_s"),
        ("GetRound", pb.GetRoundRequest(peer_id=peer, round=-(2**40)), "round is"),
        ("GetRound", pb.GetRoundRequest(peer_id="\u202e"), "peer_id may only hold"),
        ("GetStatus", pb.GetStatusRequest(token=token, page_token="abc"), "page_token may only hold"),
        ("GetStatus", pb.GetStatusRequest(token=token, page_size=-1), "page_size is -1"),
    ]


def test_every_rpc_refuses_oversized_and_malformed_fields_in_one_sentence_without_a_traceback(
    coordinator: Coordinator, caplog: pytest.LogCaptureFixture
) -> None:
    peer = coordinator.join(name="honest")
    caplog.set_level(logging.INFO)
    cases = _malformed(peer, coordinator.token)
    for method, request, words in cases:
        refusal = coordinator.refusal(method, request)
        assert refusal.code == grpc.StatusCode.INVALID_ARGUMENT, (method, refusal.details)
        assert words in refusal.details, refusal.details
        assert "\n" not in refusal.details and len(refusal.details) < 300 and refusal.details.endswith(".")
    assert not [r for r in caplog.records if r.exc_info], "a traceback was logged"
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING and "malformed request" in r.getMessage()]
    assert {r.getMessage().split(":")[0] for r in warnings} == {m for m, _, _ in cases}  # one line per method...
    assert len(warnings) == len({m for m, _, _ in cases})  # ...within a second: the rest are counted
    assert all(len(r.getMessage()) < 400 for r in caplog.records)  # 3 MiB names never reach the log
    assert coordinator.call(
        "Heartbeat",
        pb.HeartbeatRequest(
            peer_id=peer,
            metrics=pb.PeerMetrics(
                state=pb.PEER_STATE_READY,
                state_round=0,
                state_hash=coordinator.engine.run.initial_hash,
                dht_maddrs=[GOOD_MADDR],
            ),
        ),
    )


def test_warnings_are_one_line_per_second_per_method_with_a_count(caplog: pytest.LogCaptureFixture) -> None:
    now = [0.0]
    limiter = limits.WarningLimiter(interval_s=1.0, clock=lambda: now[0])
    caplog.set_level(logging.WARNING)
    for _ in range(100):
        limiter.warn("Heartbeat", "bad")
    limiter.warn("Join", "bad")
    now[0] = 1.5
    limiter.warn("Heartbeat", "bad")
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        "Heartbeat: refused a malformed request: bad",
        "Join: refused a malformed request: bad",
        "Heartbeat: refused a malformed request: bad (and 99 more since the last such line)",
    ]


def test_a_peer_keeps_at_most_eight_dht_addresses(coordinator: Coordinator) -> None:
    peer = coordinator.join()
    many = [f"/ip4/10.0.0.{i}/tcp/4001/p2p/{PEER_ID}" for i in range(20)]
    coordinator.call("Heartbeat", pb.HeartbeatRequest(peer_id=peer, metrics=pb.PeerMetrics(dht_maddrs=many)))
    assert coordinator.engine.peer_dht_addresses() == many[: limits.MAX_DHT_MADDRS]


def test_status_is_paged_and_bounded_whatever_the_peers_send(coordinator: Coordinator) -> None:
    label = "é" * 128  # 256 bytes: the most a label may be
    maddrs = [f"/dns/{'a' * 40}.example/tcp/4001/p2p/{PEER_ID}"] * 8
    for _ in range(MAX_PAGE_SIZE + 50):
        peer = coordinator.join(name=label, site=label, device=label)
        coordinator.call(
            "Heartbeat",
            pb.HeartbeatRequest(
                peer_id=peer,
                metrics=pb.PeerMetrics(
                    dht_maddrs=maddrs,
                    state_round=3,
                    state_hash="f" * 128,
                    model_fingerprint=coordinator.engine.run.model_fingerprint,  # any other fingerprint is evicted
                    dht_peer_id="d" * 128,
                ),
            ),
        )
    pages = []

    def get_page(token: str) -> pb.GetStatusResponse:
        page = coordinator.call(
            "GetStatus", pb.GetStatusRequest(token=coordinator.token, page_size=10_000, page_token=token)
        )
        pages.append(page)
        return page

    everything = fetch_all_pages(get_page)
    assert len(everything.peers) == MAX_PAGE_SIZE + 50 and len(pages) == 2
    assert max(p.ByteSize() for p in pages) < 1_000_000  # the client's limit is 4 MB


def test_peers_gone_long_ago_are_counted_not_listed(coordinator: Coordinator) -> None:
    clock = [1000.0]
    coordinator.engine._clock = lambda: clock[0]
    stays, goes = coordinator.join(name="stays"), coordinator.join(name="goes")
    coordinator.call("Leave", pb.LeaveRequest(peer_id=goes, reason="done"))
    clock[0] += 20.0
    coordinator.call("Heartbeat", pb.HeartbeatRequest(peer_id=stays))
    status = coordinator.call("GetStatus", pb.GetStatusRequest(token=coordinator.token))
    assert [p.name for p in status.peers] == ["stays", "goes"] and status.peers_omitted == 0
    for _ in range(30):  # ten minutes of heartbeats
        clock[0] += 20.0
        coordinator.call("Heartbeat", pb.HeartbeatRequest(peer_id=stays))
    status = coordinator.call("GetStatus", pb.GetStatusRequest(token=coordinator.token))
    assert [p.name for p in status.peers] == ["stays"] and status.peers_omitted == 1


@pytest.fixture
def grpc_server(coordinator: Coordinator) -> Iterator[tuple[Coordinator, grpc.Channel]]:
    # the coordinator's serving path, without TLS
    server = LoopServer(
        LoadMonitor(),
        options=[("grpc.max_receive_message_length", limits.MAX_REQUEST_BYTES)],
        maximum_concurrent_rpcs=16,
    )
    server.add_handlers(SERVICE, servicer_handlers(coordinator.servicer))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    yield coordinator, channel
    channel.close()
    server.stop(grace_s=None)


def test_bytes_that_are_not_protobuf_are_refused_in_one_sentence(
    grpc_server: tuple[Coordinator, grpc.Channel], caplog: pytest.LogCaptureFixture
) -> None:
    coordinator, channel = grpc_server
    caplog.set_level(logging.INFO)
    raw = channel.unary_unary("/swarm.v1.Coordinator/Heartbeat")  # no serializers: bytes in, bytes out
    with pytest.raises(grpc.RpcError) as info:
        raw(b"\xff\xff\xff\xff", timeout=5)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "not a valid swarm.v1.HeartbeatRequest message" in info.value.details()
    with pytest.raises(grpc.RpcError) as info:
        raw(b"\x0a" + b"\xff" * 10 + b"x" * (limits.MAX_REQUEST_BYTES + 10), timeout=5)
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED  # over the receive limit: never parsed
    assert not [r for r in caplog.records if r.exc_info]
    challenge = channel.unary_unary(
        "/swarm.v1.Coordinator/Challenge",
        request_serializer=pb.ChallengeRequest.SerializeToString,
        response_deserializer=pb.ChallengeResponse.FromString,
    )
    join = channel.unary_unary(
        "/swarm.v1.Coordinator/Join",
        request_serializer=pb.JoinRequest.SerializeToString,
        response_deserializer=pb.JoinResponse.FromString,
    )
    key = PeerKey.generate()
    nonce = challenge(pb.ChallengeRequest(), timeout=5).nonce
    request = signed_join(token=coordinator.token, nonce=nonce, key=key, libp2p=libp2p())
    assert join(request, timeout=5).peer_id == key.peer_id


# --- fuzz: any request a stranger can build -----------------------------------------------------------

_METHODS = {
    "Challenge": pb.ChallengeRequest,
    "Join": pb.JoinRequest,
    "Heartbeat": pb.HeartbeatRequest,
    "Leave": pb.LeaveRequest,
    "ReportRound": pb.ReportRoundRequest,
    "GetRound": pb.GetRoundRequest,
    "GetStatus": pb.GetStatusRequest,
}
_INTS = st.one_of(st.integers(-2, 10), st.integers(-(2**63), 2**63 - 1))
_FLOATS = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.just(1.0))
_TEXT = st.one_of(st.text(max_size=20), st.text(max_size=300), st.sampled_from(["", GOOD_MADDR, "00ff", "[/oops]"]))


def _value(field: FieldDescriptor, known: dict[str, str]) -> st.SearchStrategy:
    if field.message_type is not None:
        return _message(field.message_type._concrete_class, known)  # type: ignore[attr-defined]
    if field.name == "protocol":  # a join of this release's protocol gets past the protocol check
        return st.one_of(st.just(PROTOCOL), st.integers(-(2**31), 2**31 - 1))
    if field.name in known:
        return st.one_of(st.just(known[field.name]), _TEXT)
    if field.type == FieldDescriptor.TYPE_STRING:
        return _TEXT
    if field.type == FieldDescriptor.TYPE_BOOL:
        return st.booleans()
    if field.type in (FieldDescriptor.TYPE_DOUBLE, FieldDescriptor.TYPE_FLOAT):
        return _FLOATS
    if field.type == FieldDescriptor.TYPE_ENUM:
        return st.integers(-1, 8)
    if field.type in (FieldDescriptor.TYPE_INT32, FieldDescriptor.TYPE_UINT32):
        return st.integers(-(2**31), 2**31 - 1)
    if field.type == FieldDescriptor.TYPE_BYTES:
        return st.binary(max_size=64)
    return _INTS


def _message(cls: type, known: dict[str, str]) -> st.SearchStrategy:
    fields = {}
    for field in cls.DESCRIPTOR.fields:
        value = _value(field, known)
        fields[field.name] = st.lists(value, max_size=4) if field.is_repeated else value
    return st.fixed_dictionaries({}, optional=fields).map(lambda kw: cls(**kw))


def test_fuzzed_requests_never_fail_internally_nor_log_a_traceback_and_honest_calls_still_work(
    caplog: pytest.LogCaptureFixture,
) -> None:
    coordinator = Coordinator()
    known = {"token": coordinator.token, "peer_id": coordinator.join(name="early")}
    caplog.set_level(logging.INFO)
    requests = st.one_of(*(st.tuples(st.just(m), _message(c, known)) for m, c in _METHODS.items()))
    raw = st.tuples(st.sampled_from(sorted(_METHODS)), st.binary(max_size=200))

    @settings(max_examples=150, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(st.one_of(requests, raw))
    def one(call: tuple[str, Any]) -> None:
        method, request = call
        if isinstance(request, bytes):
            request = limits.tolerant(_METHODS[method].FromString)(request)
        try:
            coordinator.call(method, request)
        except Aborted as refusal:
            assert refusal.code != grpc.StatusCode.INTERNAL, refusal.details

    one()
    # the coordinator's own records: a thread another test left behind in this worker (asyncio, hivemind) may log
    # an error of its own meanwhile
    assert not [
        r
        for r in caplog.records
        if r.name.split(".")[0] in ("coordinator", "swarm", "grpc") and (r.exc_info or r.levelno >= logging.ERROR)
    ]
    peer = coordinator.join(name="after the fuzz")
    info = coordinator.call(
        "Heartbeat",
        pb.HeartbeatRequest(peer_id=peer, metrics=pb.PeerMetrics(state=pb.PEER_STATE_JOINING, dht_maddrs=[GOOD_MADDR])),
    )
    assert info.round.live_peers >= 1
    status = coordinator.call("GetStatus", pb.GetStatusRequest(token=coordinator.token))
    assert peer in [p.id for p in status.peers]
