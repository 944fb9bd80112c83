"""A peer's libp2p identity (hivemind's RSA key) and the proof that a libp2p id is the sender's.

A peer takes a fresh identity at each start, signs its join with it, and starts its DHT with it
(``Transport(identity_path=...)``), so the libp2p id the coordinator puts in its credential is the one
the peer's DHT node really has. Fresh means no process used it before: each start makes a spare for the
next one in the background, so that a restart does not wait for an RSA key. The coordinator derives the id from the presented public key exactly as
``hivemind.p2p.PeerID.from_identity`` does.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Optional

import multihash
from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import padding, rsa
from google.protobuf.message import DecodeError
from hivemind.p2p import P2P, PeerID
from hivemind.proto import crypto_pb2

IDENTITY_FILE = "p2p-identity.key"
SPARE_FILE = "p2p-identity.spare.key"  # made by one start, taken by the next
SIGNED_PREFIX = b"swarm/join-libp2p\0"  # what the libp2p key signs here is never a libp2p message
MAX_PUBLIC_KEY_BYTES = 1024  # a 4096-bit RSA key in libp2p's encoding is ~550 bytes
MIN_RSA_BITS = 2048


def _encoded_public_key(public_key: rsa.RSAPublicKey) -> bytes:
    der = public_key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    return crypto_pb2.PublicKey(key_type=crypto_pb2.RSA, data=der).SerializeToString()


def peer_id_of(encoded_public_key: bytes) -> str:
    """The base58 libp2p peer id of a public key in libp2p's protobuf encoding (as PeerID.from_identity)."""
    digest = multihash.encode(hashlib.sha256(encoded_public_key).digest(), multihash.coerce_code("sha2-256"))
    return PeerID(digest).to_base58()


class Libp2pIdentity:
    """The RSA key at ``path``, the libp2p id it stands for, and signatures with it."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        data = crypto_pb2.PrivateKey.FromString(self.path.read_bytes()).data
        private = serialization.load_der_private_key(data, password=None)
        assert isinstance(private, rsa.RSAPrivateKey), "hivemind identities are RSA keys"
        self._private = private
        self.public_key = _encoded_public_key(private.public_key())
        self.peer_id = peer_id_of(self.public_key)

    @classmethod
    def create(cls, path: str | Path, *, spare: Optional[Path] = None) -> "Libp2pIdentity":
        """A new identity at ``path`` (replacing any earlier one: a libp2p id lives one process): the unused
        ``spare`` an earlier start made when there is a readable one, else one generated now."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        taken = cls._take(Path(spare), path) if spare is not None else None
        if taken is not None:
            return taken
        if path.exists():
            path.unlink()  # hivemind writes it read-only
        P2P.generate_identity(str(path))
        return cls(path)

    @classmethod
    def _take(cls, spare: Path, path: Path) -> Optional["Libp2pIdentity"]:
        try:
            os.replace(spare, path)  # atomic: two starts never take the same spare
        except FileNotFoundError:
            return None
        try:
            return cls(path)
        except (DecodeError, ValueError, TypeError, AssertionError, UnsupportedAlgorithm):
            return None  # a damaged spare (a crash while it was written elsewhere): a new key replaces it

    @staticmethod
    def make_spare(spare: str | Path) -> None:
        """Write a new identity to ``spare`` for the next start, whole or not at all (written aside, then
        renamed). RSA key generation releases the GIL: a background thread costs the start little."""
        spare = Path(spare)
        aside = spare.with_name(spare.name + ".tmp")
        if aside.exists():
            aside.unlink()  # left by a process killed while writing it
        P2P.generate_identity(str(aside))
        os.replace(aside, spare)

    def sign(self, message: bytes) -> bytes:
        return self._private.sign(SIGNED_PREFIX + message, padding.PKCS1v15(), hashes.SHA256())


def verified_peer_id(encoded_public_key: bytes, signature: bytes, message: bytes) -> Optional[str]:
    """The libp2p id of ``encoded_public_key`` if ``signature`` is its signature of ``message``; else None."""
    if not encoded_public_key or len(encoded_public_key) > MAX_PUBLIC_KEY_BYTES or len(signature) > 1024:
        return None
    try:
        encoded = crypto_pb2.PublicKey.FromString(encoded_public_key)
        if encoded.key_type != crypto_pb2.RSA:
            return None
        public = serialization.load_der_public_key(encoded.data)
        if not isinstance(public, rsa.RSAPublicKey) or public.key_size < MIN_RSA_BITS:
            return None
        public.verify(signature, SIGNED_PREFIX + message, padding.PKCS1v15(), hashes.SHA256())
    except (DecodeError, ValueError, UnsupportedAlgorithm, InvalidSignature, TypeError):
        return None
    return peer_id_of(encoded_public_key)

