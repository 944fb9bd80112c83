"""The control plane against an attacker, in process (the real servicer and engine, calls signed as the
real client signs them): replayed joins, forged signatures, calls for another peer's id without its key,
a restarted peer keeping its id and index, credentials renewed by heartbeats."""

from __future__ import annotations

import time

import grpc
import pytest

from coordinator.api.errors import StateMismatch
from coordinator.api.rate_limit import JoinLimits, Rate, RateLimiter, client_address
from coordinator.api.servicer import CoordinatorServicer
from coordinator.engine import CoordinatorEngine
from coordinator.store.database import Store
from swarm.config import RoundConfig, RunConfig
from swarm.control.client import CoordinatorRejected
from swarm.control.signing import CallSigner, signed_join
from swarm.core.trust.credential import PeerKey, verify_credential
from swarm.train.trainer import LocalTrainer
from swarm.v1 import coordinator_pb2 as pb
from tests.unit.fake_swarm import FakeClient, FakeCoordinator, engine_join, libp2p_identity

pytestmark = pytest.mark.timeout(60)

RUN = RunConfig(rounds=RoundConfig(min_peers=2, max_rounds=3, inner_steps=5))


@pytest.fixture(scope="module")
def libp2p():
    return libp2p_identity()  # RSA key generation is the slow part: one identity serves every test here


@pytest.fixture
def coordinator() -> FakeCoordinator:
    return FakeCoordinator(RUN)


def joined(coordinator: FakeCoordinator, libp2p, key: PeerKey | None = None) -> tuple[FakeClient, pb.JoinResponse]:
    client = FakeClient(coordinator)
    return client, client.join(key=key or PeerKey.generate(), libp2p=libp2p, name="honest")


def refused(call) -> CoordinatorRejected:
    with pytest.raises(CoordinatorRejected) as info:
        call()
    return info.value


def test_a_join_brings_a_credential_the_coordinator_signed(coordinator, libp2p) -> None:
    key = PeerKey.generate()
    _, response = joined(coordinator, libp2p, key)
    credential = verify_credential(
        response.credential, response.coordinator_public_key, run_id=response.run_id, now=time.time()
    )
    assert (credential.peer_id, credential.public_key, credential.dht_peer_id) == (
        key.peer_id,
        key.public_key,
        libp2p.peer_id,
    )
    assert response.peer_id == key.peer_id and response.session == 1


def test_a_replayed_join_is_refused(coordinator, libp2p) -> None:
    nonce = coordinator.call("Challenge", pb.ChallengeRequest()).nonce
    request = signed_join(token=coordinator.engine.run.token, nonce=nonce, key=PeerKey.generate(), libp2p=libp2p)
    coordinator.call("Join", request)
    error = refused(lambda: coordinator.call("Join", request))
    assert error.code == grpc.StatusCode.ABORTED and "challenge was already used or has expired" in error.details


def test_a_join_with_a_forged_signature_or_a_borrowed_libp2p_id_is_refused(coordinator, libp2p) -> None:
    token = coordinator.engine.run.token

    def challenge() -> bytes:
        return coordinator.call("Challenge", pb.ChallengeRequest()).nonce

    forged = signed_join(token=token, nonce=challenge(), key=PeerKey.generate(), libp2p=libp2p)
    forged.public_key = PeerKey.generate().public_key  # claims a key it cannot sign with
    error = refused(lambda: coordinator.call("Join", forged))
    assert error.code == grpc.StatusCode.UNAUTHENTICATED and "not signed by the key it presents" in error.details

    victim = libp2p_identity()

    class Borrowing:  # names another node's libp2p id and key, but can only sign with its own
        peer_id, public_key = victim.peer_id, victim.public_key
        sign = staticmethod(libp2p.sign)

    borrowed = signed_join(token=token, nonce=challenge(), key=PeerKey.generate(), libp2p=Borrowing())
    error = refused(lambda: coordinator.call("Join", borrowed))
    assert error.code == grpc.StatusCode.UNAUTHENTICATED and "does not prove its libp2p id" in error.details
    assert not coordinator.status().peers


def test_a_call_for_another_peers_id_without_its_key_is_refused_and_the_victim_is_unaffected(
    coordinator, libp2p
) -> None:
    victim_client, victim = joined(coordinator, libp2p)
    attacker_client, _ = joined(coordinator, libp2p)
    hb = pb.HeartbeatRequest(peer_id=victim.peer_id, metrics=pb.PeerMetrics(state=pb.PEER_STATE_READY))
    attempts = [
        lambda: attacker_client.heartbeat(hb),  # its own valid key, the victim's id
        lambda: attacker_client.leave(victim.peer_id, "forged"),
        lambda: attacker_client.report_round(pb.ReportRoundRequest(peer_id=victim.peer_id, round=1, ok=True)),
        lambda: coordinator.call("Heartbeat", hb),  # unsigned
        lambda: coordinator.call("Leave", pb.LeaveRequest(peer_id="p-0000000000000000")),  # unknown id
    ]
    answers = {(e.code, e.details) for e in (refused(a) for a in attempts)}
    assert len(answers) == 1  # unknown id, wrong key, no signature: one answer, nothing to enumerate
    ((code, _),) = answers
    assert code == grpc.StatusCode.UNAUTHENTICATED
    # a signature for one request does not carry over to another
    tampered = pb.LeaveRequest(peer_id=victim.peer_id, reason="forged")
    metadata = victim_client.signer.metadata("Leave", pb.LeaveRequest(peer_id=victim.peer_id, reason="x"))
    assert refused(lambda: coordinator.call("Leave", tampered, metadata)).code == grpc.StatusCode.UNAUTHENTICATED
    # a stale signature (outside the clock window) is refused too
    old = CallSigner(victim_client.signer.key, victim.session).metadata("Heartbeat", hb, now=time.time() - 3600)
    assert refused(lambda: coordinator.call("Heartbeat", hb, old)).code == grpc.StatusCode.UNAUTHENTICATED
    victim_client.heartbeat(hb)
    states = {p.id: p.state for p in coordinator.status().peers}
    assert states[victim.peer_id] == "ready"


def test_a_restarted_peer_keeps_its_id_and_index_and_the_old_process_is_told_it_was_replaced(
    coordinator, libp2p
) -> None:
    key = PeerKey.generate()
    joined(coordinator, libp2p)  # another peer first: the restarted one's index is not 0 by chance
    old_client, before = joined(coordinator, libp2p, key)
    _, after = joined(coordinator, libp2p, key)
    assert (after.peer_id, after.peer_index, after.session) == (before.peer_id, before.peer_index, 2)
    assert before.peer_index == 1
    error = refused(lambda: old_client.get_round(before.peer_id))
    assert error.code == grpc.StatusCode.FAILED_PRECONDITION
    assert "another process joined with its state dir" in error.details


def test_a_credential_is_renewed_once_past_half_its_life() -> None:
    now = [1000.0]
    engine = CoordinatorEngine(Store(":memory:"), config=RUN, lease_s=1e6, clock=lambda: now[0], credential_ttl_s=3600)
    peer, _ = engine_join(engine)
    first = engine.issue_credential(peer.peer_id)
    now[0] += 1700
    assert engine.issue_credential(peer.peer_id, renew_only=True) == b""  # more than half its life left
    now[0] += 200
    renewed = engine.issue_credential(peer.peer_id, renew_only=True)
    credential = verify_credential(renewed, engine.public_key, run_id=engine.run.run_id, now=now[0])
    assert credential.expires_at == now[0] + 3600 and renewed != first


def test_the_coordinator_derives_the_run_model_and_the_first_heartbeat_decides_nothing() -> None:
    engine = CoordinatorEngine(Store(":memory:"), config=RUN, lease_s=60)
    trainer = LocalTrainer(RUN, peer_index=0)  # what an honest peer builds from the same config
    assert (engine.run.model_fingerprint, engine.run.initial_hash, engine.run.param_count) == (
        trainer.fingerprint,
        trainer.state.state_hash,
        trainer.param_count,
    )
    liar, _ = engine_join(engine)
    honest, _ = engine_join(engine)
    with pytest.raises(StateMismatch, match=r"initial model state \(hash ffff.*\) differs from the run's"):
        engine.heartbeat(
            pb.HeartbeatRequest(
                peer_id=liar.peer_id,
                metrics=pb.PeerMetrics(
                    state=pb.PEER_STATE_READY,
                    state_round=0,
                    state_hash="ffffffffffffffff",
                    model_fingerprint=trainer.fingerprint,
                ),
            )
        )
    engine.heartbeat(
        pb.HeartbeatRequest(
            peer_id=honest.peer_id,
            metrics=pb.PeerMetrics(
                state=pb.PEER_STATE_READY,
                state_round=0,
                state_hash=trainer.state.state_hash,
                model_fingerprint=trainer.fingerprint,
            ),
        )
    )
    states = {p.id: p.state for p in engine.status(engine.run.token).peers}
    assert states == {liar.peer_id: "evicted", honest.peer_id: "ready"}


def test_joins_are_rate_limited_per_address_and_per_token(libp2p) -> None:
    coordinator = FakeCoordinator(RUN)
    coordinator.servicer = CoordinatorServicer(
        coordinator.engine, dht_initial_peers=[], join_limits=JoinLimits(joins_per_address=Rate(per_s=1e-3, burst=3))
    )
    for _ in range(3):
        joined(coordinator, libp2p)
    flood = refused(lambda: joined(coordinator, libp2p))
    assert flood.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert flood.details == "too many joins from ipv4:127.0.0.1; wait a few seconds and join again."
    assert len(coordinator.status().peers) == 3

    per_token = RateLimiter(Rate(per_s=10.0, burst=2), clock=lambda: now[0])
    now = [0.0]
    assert [per_token.allow("t-1") for _ in range(3)] == [True, True, False]
    assert per_token.allow("t-2")  # another token has its own bucket
    now[0] += 0.1  # refilled one
    assert per_token.allow("t-1") and not per_token.allow("t-1")
    assert client_address("ipv6:[::1]:50123") == "ipv6:[::1]" and client_address("unix:/tmp/s") == "unix:/tmp/s"
