"""TLS for the control plane: the coordinator's self-signed certificate and the peers' pinned channel.

The coordinator makes one certificate per state directory and keeps it, so the fingerprint in its
join string stays valid across restarts.  A peer trusts exactly the certificate whose SHA-256 the
join string names; it never talks to the coordinator in plaintext.
"""

from __future__ import annotations

import datetime
import hashlib
import logging
import os
import socket
import ssl
from pathlib import Path

import grpc
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

logger = logging.getLogger(__name__)

SERVER_NAME = "swarm-coordinator"  # the certificate's DNS name; clients override the target name to it
CERT_FILE = "coordinator-cert.pem"
KEY_FILE = "coordinator-key.pem"
_VALIDITY = datetime.timedelta(days=3650)


class TLSPinError(Exception):
    """The coordinator presented a certificate other than the one the join string pins."""


def ensure_certificate(state_dir: str | Path) -> tuple[bytes, bytes]:
    """Return (cert_pem, key_pem), creating and saving them in ``state_dir`` the first time."""
    state_dir = Path(state_dir)
    cert_path, key_path = state_dir / CERT_FILE, state_dir / KEY_FILE
    if cert_path.exists() and key_path.exists():
        return cert_path.read_bytes(), key_path.read_bytes()
    state_dir.mkdir(parents=True, exist_ok=True)
    cert_pem, key_pem = _make_certificate()
    # The key is written before the certificate so a crash in between leaves no orphan certificate.
    fd = os.open(key_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(key_pem)
    os.chmod(key_path, 0o600)
    cert_path.write_bytes(cert_pem)
    logger.info("created TLS certificate %s (fingerprint %s)", cert_path, fingerprint(cert_pem))
    return cert_pem, key_pem


def _make_certificate() -> tuple[bytes, bytes]:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, SERVER_NAME)])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))  # tolerate small clock skew
        .not_valid_after(now + _VALIDITY)
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(SERVER_NAME)]), critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .sign(key, hashes.SHA256())
    )
    key_pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    return cert.public_bytes(serialization.Encoding.PEM), key_pem


def fingerprint(cert_pem: bytes | str) -> str:
    """SHA-256 hex of the certificate's DER encoding (what the join string's ``fp`` holds)."""
    return _cert_sha256(cert_pem)


def _cert_sha256(cert_pem: bytes | str) -> str:
    if isinstance(cert_pem, str):
        cert_pem = cert_pem.encode()
    der = x509.load_pem_x509_certificate(cert_pem).public_bytes(serialization.Encoding.DER)
    return hashlib.sha256(der).hexdigest()


def server_credentials(cert_pem: bytes, key_pem: bytes) -> grpc.ServerCredentials:
    return grpc.ssl_server_credentials([(key_pem, cert_pem)])


def fetch_certificate(host: str, port: int, *, timeout_s: float) -> bytes:
    """The PEM certificate the server at host:port presents (not verified; the caller pins it).

    Raises OSError (ConnectionRefusedError, TimeoutError, ssl.SSLError, ...) when no TLS server
    answers there.
    """
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE  # trust comes from the pinned fingerprint, checked by the caller
    context.set_alpn_protocols(["h2"])  # gRPC servers expect HTTP/2
    with socket.create_connection((host, port), timeout=timeout_s) as sock:
        with context.wrap_socket(sock, server_hostname=SERVER_NAME) as tls_sock:
            der = tls_sock.getpeercert(binary_form=True)
    if not der:
        raise ssl.SSLError(f"the server at {host}:{port} presented no certificate")
    return ssl.DER_cert_to_PEM_cert(der).encode()


def pinned_channel(host: str, port: int, fingerprint: str, *, timeout_s: float) -> grpc.Channel:
    """A TLS gRPC channel that trusts only the certificate with the given SHA-256 fingerprint.

    Raises TLSPinError on a different certificate, OSError when nothing answers at host:port.
    """
    cert_pem = fetch_certificate(host, port, timeout_s=timeout_s)
    presented = _cert_sha256(cert_pem)
    if presented != fingerprint.lower():
        raise TLSPinError(
            f"the coordinator at {host}:{port} presented a different certificate "
            f"(fingerprint {presented[:16]}…) than the join string names ({fingerprint[:16]}…), "
            "so it may be an impostor; get a fresh join string from the operator."
        )
    credentials = grpc.ssl_channel_credentials(root_certificates=cert_pem)
    target = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    return grpc.secure_channel(target, credentials, options=[("grpc.ssl_target_name_override", SERVER_NAME)])
