"""The coordinator's certificate persists, and a peer trusts only the certificate its join string pins."""

import socket
import stat
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Iterator

import grpc
import pytest
from cryptography import x509

from swarm.control import tls
from swarm.v1 import coordinator_pb2 as pb
from swarm.v1 import coordinator_pb2_grpc as pb_grpc

pytestmark = pytest.mark.timeout(30)


class _StatusOnly(pb_grpc.CoordinatorServicer):
    def GetStatus(self, request, context):
        return pb.GetStatusResponse(run=pb.RunStatus(run_id="run-under-test"))


@pytest.fixture
def tls_server(tmp_path: Path) -> Iterator[tuple[int, bytes]]:
    cert_pem, key_pem = tls.ensure_certificate(tmp_path / "state")
    server = grpc.server(ThreadPoolExecutor(2))
    pb_grpc.add_CoordinatorServicer_to_server(_StatusOnly(), server)
    port = server.add_secure_port("127.0.0.1:0", tls.server_credentials(cert_pem, key_pem))
    server.start()
    yield port, cert_pem
    server.stop(0).wait()


def test_certificate_is_created_once_and_reused(tmp_path: Path) -> None:
    cert_pem, key_pem = tls.ensure_certificate(tmp_path)
    assert tls.ensure_certificate(tmp_path) == (cert_pem, key_pem)
    assert stat.S_IMODE((tmp_path / tls.KEY_FILE).stat().st_mode) == 0o600
    cert = x509.load_pem_x509_certificate(cert_pem)
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == ["swarm-coordinator"]
    assert (cert.not_valid_after_utc - cert.not_valid_before_utc).days >= 3649
    assert tls.fingerprint(cert_pem) == tls.fingerprint(cert_pem.decode())
    assert len(tls.fingerprint(cert_pem)) == 64


def test_another_state_dir_gets_another_certificate(tmp_path: Path) -> None:
    first, _ = tls.ensure_certificate(tmp_path / "a")
    second, _ = tls.ensure_certificate(tmp_path / "b")
    assert tls.fingerprint(first) != tls.fingerprint(second)


def test_pinned_channel_talks_to_the_pinned_server(tls_server: tuple[int, bytes]) -> None:
    port, cert_pem = tls_server
    channel = tls.pinned_channel("127.0.0.1", port, tls.fingerprint(cert_pem), timeout_s=5)
    try:
        reply = pb_grpc.CoordinatorStub(channel).GetStatus(pb.GetStatusRequest(), timeout=5)
    finally:
        channel.close()
    assert reply.run.run_id == "run-under-test"


def test_wrong_fingerprint_is_refused(tls_server: tuple[int, bytes]) -> None:
    port, _ = tls_server
    with pytest.raises(tls.TLSPinError, match="different certificate.*impostor.*fresh join string"):
        tls.pinned_channel("127.0.0.1", port, "0" * 64, timeout_s=5)


def test_nothing_listening_is_an_os_error(tmp_path: Path) -> None:
    cert_pem, _ = tls.ensure_certificate(tmp_path)
    with socket.socket() as bound_not_listening:  # holds a port that refuses connections, without races
        bound_not_listening.bind(("127.0.0.1", 0))
        port = bound_not_listening.getsockname()[1]
        with pytest.raises(ConnectionRefusedError):
            tls.pinned_channel("127.0.0.1", port, tls.fingerprint(cert_pem), timeout_s=5)
