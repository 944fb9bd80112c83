"""Who a peer is, and the coordinator's word that it is a member of a run.

Every peer holds an Ed25519 key (``PeerKey``), created at its first start in its state dir; its peer id
derives from the public key, so it can be neither guessed nor claimed without the key. At join the
coordinator signs a ``Credential`` for it (peer id, public key, libp2p id, run, role, site, expiry) with its own
Ed25519 key. Members get the coordinator's public key at join over the pinned TLS channel, so any member
checks a credential offline: on DHT entries, on state requests, on slices.

Every signature names its purpose (``sign(purpose, message)``), so a signature made for one kind of
message is never valid for another.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

KEY_FILE = "peer-key.pem"
PUBLIC_KEY_BYTES = 32
SIGNATURE_BYTES = 64
MAX_CREDENTIAL_BYTES = 2048  # an encoded credential is ~400 bytes; anything larger is refused unread
ROLES = ("peer", "status")


class CredentialError(ValueError):
    """A key, signature or credential that does not check out; the message says which and why."""


def peer_id_for(public_key: bytes) -> str:
    """The peer id a public key stands for: ``p-`` and 16 hex digits of its SHA-256."""
    return "p-" + hashlib.sha256(b"swarm-peer-id\0" + bytes(public_key)).hexdigest()[:16]


def _message(purpose: str, message: bytes) -> bytes:
    return b"swarm/" + purpose.encode() + b"\0" + message


class PeerKey:
    """An Ed25519 private key with the operations Swarm needs."""

    def __init__(self, private: Ed25519PrivateKey) -> None:
        self._private = private
        self.public_key: bytes = private.public_key().public_bytes(
            serialization.Encoding.Raw, serialization.PublicFormat.Raw
        )
        self.peer_id = peer_id_for(self.public_key)

    @classmethod
    def generate(cls) -> "PeerKey":
        return cls(Ed25519PrivateKey.generate())

    @classmethod
    def load_or_create(cls, path: str | Path) -> "PeerKey":
        """The key kept at ``path``, created there (directory 0700, file 0600) the first time.

        Raises CredentialError when the file exists but is not an Ed25519 private key.
        """
        path = Path(path)
        if path.exists():
            try:
                private = serialization.load_pem_private_key(path.read_bytes(), password=None)
            except (ValueError, TypeError, OSError) as e:
                raise CredentialError(
                    f"{path} is not a readable private key ({type(e).__name__}); move it away to start as a new peer."
                ) from None
            if not isinstance(private, Ed25519PrivateKey):
                raise CredentialError(
                    f"{path} holds a {type(private).__name__}, not an Ed25519 key; move it away to start as a new peer."
                )
            os.chmod(path, 0o600)
            return cls(private)
        path.parent.mkdir(parents=True, exist_ok=True)
        os.chmod(path.parent, 0o700)
        key = cls.generate()
        pem = key._private.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
        tmp = path.with_name(path.name + ".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(pem)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        return key

    def sign(self, purpose: str, message: bytes) -> bytes:
        return self._private.sign(_message(purpose, message))


def verify_signature(public_key: bytes, signature: bytes, purpose: str, message: bytes) -> bool:
    """True when ``signature`` is ``public_key``'s signature of ``message`` for ``purpose``."""
    if len(public_key) != PUBLIC_KEY_BYTES or len(signature) != SIGNATURE_BYTES:
        return False
    try:
        Ed25519PublicKey.from_public_bytes(bytes(public_key)).verify(bytes(signature), _message(purpose, message))
    except (InvalidSignature, ValueError):
        return False
    return True


@dataclass(frozen=True, kw_only=True)
class Credential:
    """The coordinator's statement that a key is a member of a run, until ``expires_at`` (unix seconds)."""

    run_id: str
    peer_id: str
    public_key: bytes  # the member's Ed25519 key (raw, 32 bytes)
    dht_peer_id: str  # its libp2p peer id (base58), proven at join
    role: str  # "peer"
    token_id: str  # the join token it was admitted with (revoking the token ends renewals)
    issued_at: float
    expires_at: float
    # Where the coordinator placed it ("": nowhere in particular): the site of its token when the token is
    # site-pinned, else the one it asked for at join. Two-level averaging groups peers by this, never by
    # what a peer says in the DHT.
    site: str = ""

    def body(self) -> bytes:
        fields = asdict(self)
        fields["public_key"] = self.public_key.hex()
        return json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()

    @classmethod
    def from_body(cls, body: bytes) -> "Credential":
        try:
            fields = json.loads(body.decode())
            fields["public_key"] = bytes.fromhex(fields["public_key"])
            credential = cls(**fields)
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise CredentialError(f"a credential is malformed ({type(e).__name__}).") from None
        if len(credential.public_key) != PUBLIC_KEY_BYTES or credential.peer_id != peer_id_for(credential.public_key):
            raise CredentialError("a credential's peer id does not belong to its public key.")
        if not isinstance(credential.site, str):
            raise CredentialError("a credential's site is not text.")
        return credential


CREDENTIAL_PURPOSE = "credential"


def issue(coordinator: PeerKey, credential: Credential) -> bytes:
    """The credential, signed by the coordinator, encoded for the wire: 64 bytes of signature, then the body."""
    body = credential.body()
    return coordinator.sign(CREDENTIAL_PURPOSE, body) + body


def verify_credential(data: bytes, coordinator_public_key: bytes, *, run_id: str, now: float) -> Credential:
    """The credential in ``data`` if the coordinator signed it for ``run_id`` and it has not expired.

    Raises CredentialError with the reason otherwise.
    """
    if not data or len(data) > MAX_CREDENTIAL_BYTES:
        raise CredentialError(f"a credential must be 1 to {MAX_CREDENTIAL_BYTES} bytes, got {len(data or b'')}.")
    signature, body = bytes(data[:SIGNATURE_BYTES]), bytes(data[SIGNATURE_BYTES:])
    if not verify_signature(coordinator_public_key, signature, CREDENTIAL_PURPOSE, body):
        raise CredentialError("a credential is not signed by this run's coordinator.")
    credential = Credential.from_body(body)
    if credential.run_id != run_id:
        raise CredentialError(f"a credential is for run {credential.run_id!r}, not {run_id!r}.")
    if now >= credential.expires_at:
        raise CredentialError(f"the credential of {credential.peer_id} expired {now - credential.expires_at:.0f}s ago.")
    return credential


class Member:
    """What a joined peer proves itself with on the data plane: its key, its current credential (renewed
    by the coordinator while the peer stays a member, so read ``credential`` when it is needed, not once),
    and the run's coordinator key that every member checks other members' credentials against."""

    def __init__(self, *, key: PeerKey, credential: bytes, coordinator_public_key: bytes, run_id: str) -> None:
        self.key = key
        self.credential = credential
        self.coordinator_public_key = coordinator_public_key
        self.run_id = run_id

    @property
    def peer_id(self) -> str:
        return self.key.peer_id

    @property
    def site(self) -> str:
        """The site the coordinator put in this peer's current credential."""
        return Credential.from_body(bytes(self.credential[SIGNATURE_BYTES:])).site

    def check(self, credential: bytes, *, now: float) -> Credential:
        """Another member's credential, verified against this run's coordinator (CredentialError if not)."""
        return verify_credential(credential, self.coordinator_public_key, run_id=self.run_id, now=now)
