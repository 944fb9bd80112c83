"""Who is calling: a join's proofs (its Ed25519 and libp2p signatures over the challenge) and each later
call's signature by the member's key. Pure checks; the engine holds the keys they are checked against."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from coordinator.api.errors import BadJoinProof, BadRequest, NotAuthenticated
from coordinator.store.records import PeerRecord
from swarm.control import signing
from swarm.core.trust.credential import PUBLIC_KEY_BYTES, peer_id_for, verify_signature
from swarm.net.link import libp2p_identity
from swarm.v1 import coordinator_pb2 as pb


@dataclass(frozen=True)
class JoinClaim:
    """What a join proved: the key the peer holds (its id derives from it) and its libp2p id."""

    public_key: bytes
    dht_peer_id: str

    @property
    def peer_id(self) -> str:
        return peer_id_for(self.public_key)


def verify_join(request: pb.JoinRequest) -> JoinClaim:
    """The identities a join request proves; raises BadRequest or BadJoinProof with the reason."""
    if len(request.public_key) != PUBLIC_KEY_BYTES:
        raise BadRequest(
            f"a join must carry a {PUBLIC_KEY_BYTES}-byte Ed25519 public key, got "
            f"{len(request.public_key)} bytes; update swarm on this peer."
        )
    message = signing.join_message(request)
    if not verify_signature(request.public_key, request.signature, signing.JOIN_PURPOSE, message):
        raise BadJoinProof(
            "the join request is not signed by the key it presents; the peer's key or its "
            "software is broken: move its peer-key.pem away or update swarm."
        )
    dht_peer_id = libp2p_identity.verified_peer_id(request.dht_public_key, request.dht_signature, message)
    if dht_peer_id is None or dht_peer_id != request.dht_peer_id:
        raise BadJoinProof(
            "the join request does not prove its libp2p id (no valid signature by the libp2p key "
            "it names); update swarm on this peer."
        )
    return JoinClaim(public_key=bytes(request.public_key), dht_peer_id=dht_peer_id)


def check_call(proof: Optional[signing.CallProof], peer: Optional[PeerRecord], *, now: float) -> PeerRecord:
    """The caller's record if ``proof`` is its fresh signature; NotAuthenticated otherwise, the same
    sentence whether the id is unknown or the signature wrong (no guessing which ids exist)."""
    if proof is None or peer is None or not peer.public_key:
        raise NotAuthenticated()
    if not proof.verify(bytes.fromhex(peer.public_key), now=now):
        raise NotAuthenticated()
    return peer
