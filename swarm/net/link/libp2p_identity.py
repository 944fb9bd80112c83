"""A peer's libp2p identity (hivemind's RSA key) and the proof that a libp2p id is the sender's.

A peer takes a fresh identity at each start, signs its join with it, and starts its DHT with it
(``Transport(identity_path=...)``), so the libp2p id the coordinator puts in its credential is the one
the peer's DHT node really has. Fresh means no process used it before: each start makes a spare for the
next one in the background, so that a restart does not wait for an RSA key. The coordinator derives the
id from the presented public key exactly as ``hivemind.p2p.PeerID.from_identity`` does.

Nothing here imports hivemind: a peer signs its join with this key before its DHT exists, and importing
hivemind (with the scipy it pulls in) is a large part of a restart. The key file is libp2p's protobuf
``PrivateKey`` (``KEY_TYPE_RSA``, PKCS#1 DER), written and read by the two-field codec below, byte for byte
what ``hivemind.P2P.generate_identity`` writes (tests/unit/test_startup.py compares them).
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Optional

import base58
import multihash
from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import padding, rsa

IDENTITY_FILE = "p2p-identity.key"
SPARE_FILE = "p2p-identity.spare.key"  # made by one start, taken by the next
SIGNED_PREFIX = b"swarm/join-libp2p\0"  # what the libp2p key signs here is never a libp2p message
MAX_PUBLIC_KEY_BYTES = 1024  # a 4096-bit RSA key in libp2p's encoding is ~550 bytes
MIN_RSA_BITS = 2048
RSA_BITS = 2048  # what hivemind generates
KEY_TYPE_RSA = 0  # libp2p crypto.proto: enum KeyType { RSA = 0; ... }


class KeyDecodeError(ValueError):
    """Bytes that are not a libp2p ``PublicKey`` / ``PrivateKey`` message."""


def encode_key(key_type: int, data: bytes) -> bytes:
    """libp2p's ``message PublicKey/PrivateKey { required KeyType key_type = 1; required bytes data = 2; }``
    (proto2: both fields are always written, in field order, as protobuf does)."""
    return b"\x08" + _varint(key_type) + b"\x12" + _varint(len(data)) + data


def decode_key(message: bytes) -> tuple[int, bytes]:
    """(key_type, data) of a message ``encode_key`` wrote; KeyDecodeError for anything else."""
    key_type, at = _read_field(message, 0, tag=0x08)
    length, at = _read_field(message, at, tag=0x12)
    if at + length != len(message):
        raise KeyDecodeError(f"a libp2p key message of {len(message)} bytes has a {length}-byte key at {at}")
    return key_type, message[at:]


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        low, value = value & 0x7F, value >> 7
        out.append(low | (0x80 if value else 0))
        if not value:
            return bytes(out)


def _read_field(message: bytes, at: int, *, tag: int) -> tuple[int, int]:
    """The varint after ``tag`` at ``at`` (a field number and wire type), and where it ends."""
    if message[at : at + 1] != bytes([tag]):
        raise KeyDecodeError(f"expected protobuf tag {tag:#x} at byte {at}")
    value, shift, at = 0, 0, at + 1
    while at < len(message) and shift < 64:
        byte = message[at]
        value |= (byte & 0x7F) << shift
        at, shift = at + 1, shift + 7
        if not byte & 0x80:
            return value, at
    raise KeyDecodeError(f"a truncated varint at byte {at}")


def _encoded_public_key(public_key: rsa.RSAPublicKey) -> bytes:
    der = public_key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    return encode_key(KEY_TYPE_RSA, der)


def generate_identity(path: str | Path) -> None:
    """A new RSA libp2p identity at ``path``, as ``hivemind.P2P.generate_identity`` makes one (read-only)."""
    private = rsa.generate_private_key(public_exponent=65537, key_size=RSA_BITS)
    der = private.private_bytes(
        encoding=serialization.Encoding.DER,
        format=serialization.PrivateFormat.TraditionalOpenSSL,
        encryption_algorithm=serialization.NoEncryption(),
    )
    Path(path).write_bytes(encode_key(KEY_TYPE_RSA, der))
    os.chmod(path, 0o400)


def peer_id_of(encoded_public_key: bytes) -> str:
    """The base58 libp2p peer id of a public key in libp2p's protobuf encoding (as PeerID.from_identity)."""
    digest = multihash.encode(hashlib.sha256(encoded_public_key).digest(), multihash.coerce_code("sha2-256"))
    return base58.b58encode(digest).decode()


class Libp2pIdentity:
    """The RSA key at ``path``, the libp2p id it stands for, and signatures with it."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        key_type, data = decode_key(self.path.read_bytes())
        if key_type != KEY_TYPE_RSA:
            raise KeyDecodeError(f"{self.path} holds a libp2p key of type {key_type}, not RSA")
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
        generate_identity(path)
        return cls(path)

    @classmethod
    def _take(cls, spare: Path, path: Path) -> Optional["Libp2pIdentity"]:
        try:
            os.replace(spare, path)  # atomic: two starts never take the same spare
        except FileNotFoundError:
            return None
        try:
            return cls(path)
        except (ValueError, TypeError, AssertionError, UnsupportedAlgorithm):  # KeyDecodeError is a ValueError
            return None  # a damaged spare (a crash while it was written elsewhere): a new key replaces it

    @staticmethod
    def make_spare(spare: str | Path) -> None:
        """Write a new identity to ``spare`` for the next start, whole or not at all (written aside, then
        renamed). RSA key generation releases the GIL: a background thread costs the start little."""
        spare = Path(spare)
        aside = spare.with_name(spare.name + ".tmp")
        if aside.exists():
            aside.unlink()  # left by a process killed while writing it
        generate_identity(aside)
        os.replace(aside, spare)

    def sign(self, message: bytes) -> bytes:
        return self._private.sign(SIGNED_PREFIX + message, padding.PKCS1v15(), hashes.SHA256())


def verified_peer_id(encoded_public_key: bytes, signature: bytes, message: bytes) -> Optional[str]:
    """The libp2p id of ``encoded_public_key`` if ``signature`` is its signature of ``message``; else None."""
    if not encoded_public_key or len(encoded_public_key) > MAX_PUBLIC_KEY_BYTES or len(signature) > 1024:
        return None
    try:
        key_type, data = decode_key(encoded_public_key)
        if key_type != KEY_TYPE_RSA:
            return None
        public = serialization.load_der_public_key(data)
        if not isinstance(public, rsa.RSAPublicKey) or public.key_size < MIN_RSA_BITS:
            return None
        public.verify(signature, SIGNED_PREFIX + message, padding.PKCS1v15(), hashes.SHA256())
    except (ValueError, UnsupportedAlgorithm, InvalidSignature, TypeError):  # KeyDecodeError is a ValueError
        return None
    return peer_id_of(encoded_public_key)
