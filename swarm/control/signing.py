"""What a peer signs on the control plane, written once for the peer that signs and the coordinator that checks.

A join is signed over the coordinator's fresh challenge (no replay) by the peer's Ed25519 key and by its
libp2p key (which proves the libp2p id it claims). Every later call carries, in gRPC metadata, the peer
id, the session its join started, a timestamp and an Ed25519 signature over the method, those and the
SHA-256 of the request serialized deterministically: a call cannot be made for another peer, moved to
another method or altered.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass
from typing import Optional, Protocol, Sequence

from google.protobuf.message import Message

from swarm.core.trust.credential import PeerKey, verify_signature
from swarm.core.wire_protocol import PROTOCOL
from swarm.v1 import coordinator_pb2 as pb

JOIN_PURPOSE = "join"
CALL_PURPOSE = "call"
DHT_JOIN_PREFIX = b"swarm/join-libp2p\0"  # what the libp2p key signs: never a valid libp2p message itself

PEER_ID_KEY = "swarm-peer-id"
SESSION_KEY = "swarm-session"
TIMESTAMP_KEY = "swarm-timestamp"
SIGNATURE_KEY = "swarm-signature-bin"  # "-bin": gRPC carries the value as bytes
MAX_CLOCK_SKEW_S = 60.0


def join_message(request: pb.JoinRequest) -> bytes:
    """The bytes both join signatures cover: the request without its signatures, serialized deterministically."""
    unsigned = pb.JoinRequest()
    unsigned.CopyFrom(request)
    unsigned.ClearField("signature")
    unsigned.ClearField("dht_signature")
    return unsigned.SerializeToString(deterministic=True)


def call_message(method: str, peer_id: str, session: int, timestamp: str, request: Message) -> bytes:
    digest = hashlib.sha256(request.SerializeToString(deterministic=True)).digest()
    return f"{method}\0{peer_id}\0{session}\0{timestamp}\0".encode() + digest


@dataclass(frozen=True)
class CallProof:
    """What a call says about who sent it (read from its metadata; checked by the coordinator)."""

    method: str
    peer_id: str
    session: int
    timestamp: str
    signature: bytes
    message: bytes  # call_message(...) for the request as received

    @classmethod
    def from_metadata(
        cls, method: str, metadata: Sequence[tuple[str, object]], request: Message
    ) -> Optional["CallProof"]:
        """The proof a call carries, or None when its metadata lacks one or it is malformed."""
        values = {key: value for key, value in metadata or ()}
        peer_id, session, timestamp = values.get(PEER_ID_KEY), values.get(SESSION_KEY), values.get(TIMESTAMP_KEY)
        signature = values.get(SIGNATURE_KEY)
        if (
            not (
                isinstance(peer_id, str)
                and isinstance(session, str)
                and isinstance(timestamp, str)
                and isinstance(signature, bytes)
            )
            or len(peer_id) > 64
            or len(timestamp) > 32
        ):
            return None
        try:
            session_number = int(session)
        except ValueError:
            return None
        return cls(
            method=method,
            peer_id=peer_id,
            session=session_number,
            timestamp=timestamp,
            signature=signature,
            message=call_message(method, peer_id, session_number, timestamp, request),
        )

    def verify(self, public_key: bytes, *, now: float) -> bool:
        """Signed by ``public_key`` and made within MAX_CLOCK_SKEW_S of ``now``."""
        try:
            made_at = float(self.timestamp)
        except ValueError:
            return False
        if not abs(now - made_at) <= MAX_CLOCK_SKEW_S:  # also False for NaN
            return False
        return verify_signature(public_key, self.signature, CALL_PURPOSE, self.message)


class CallSigner:
    """A joined peer's signature on each of its calls."""

    def __init__(self, key: PeerKey, session: int) -> None:
        self.key, self.session = key, session

    def metadata(self, method: str, request: Message, *, now: Optional[float] = None) -> list[tuple[str, object]]:
        timestamp = f"{time.time() if now is None else now:.3f}"
        message = call_message(method, self.key.peer_id, self.session, timestamp, request)
        return [
            (PEER_ID_KEY, self.key.peer_id),
            (SESSION_KEY, str(self.session)),
            (TIMESTAMP_KEY, timestamp),
            (SIGNATURE_KEY, self.key.sign(CALL_PURPOSE, message)),
        ]


class Libp2pSigner(Protocol):
    """The peer's libp2p identity as a join needs it (``swarm.net.link.libp2p_identity.Libp2pIdentity``)."""

    peer_id: str
    public_key: bytes

    def sign(self, message: bytes) -> bytes: ...


def signed_join(
    *,
    token: str,
    nonce: bytes,
    key: PeerKey,
    libp2p: Libp2pSigner,
    site: str = "",
    device: str = "",
    name: str = "",
    swarm_version: str = "",
    protocol: int = PROTOCOL,
) -> pb.JoinRequest:
    """A JoinRequest over ``nonce``, signed by the peer's key and by its libp2p key."""
    request = pb.JoinRequest(
        token=token,
        site=site,
        device=device,
        name=name,
        swarm_version=swarm_version,
        public_key=key.public_key,
        nonce=nonce,
        dht_peer_id=libp2p.peer_id,
        dht_public_key=libp2p.public_key,
        protocol=protocol,
    )
    message = join_message(request)
    request.signature = key.sign(JOIN_PURPOSE, message)
    request.dht_signature = libp2p.sign(message)
    return request
