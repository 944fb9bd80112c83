"""Peer keys and coordinator-signed credentials: what a forger cannot do."""

from __future__ import annotations

import os
import stat

import pytest

from swarm.core.trust.credential import (
    Credential,
    CredentialError,
    PeerKey,
    issue,
    peer_id_for,
    verify_credential,
    verify_signature,
)

pytestmark = pytest.mark.timeout(30)


def _credential(key: PeerKey, **overrides) -> Credential:
    fields = dict(
        run_id="run-1",
        peer_id=key.peer_id,
        public_key=key.public_key,
        dht_peer_id="QmX",
        role="peer",
        token_id="default",
        issued_at=100.0,
        expires_at=200.0,
    )
    fields.update(overrides)
    return Credential(**fields)


def test_key_is_created_private_and_kept(tmp_path):
    path = tmp_path / "state" / "peer-key.pem"
    key = PeerKey.load_or_create(path)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(path.parent).st_mode) == 0o700
    again = PeerKey.load_or_create(path)
    assert again.peer_id == key.peer_id == peer_id_for(key.public_key)
    assert key.peer_id.startswith("p-") and len(key.peer_id) == 18


def test_unreadable_key_file_is_one_sentence(tmp_path):
    path = tmp_path / "peer-key.pem"
    path.write_text("not a key")
    with pytest.raises(CredentialError, match="move it away"):
        PeerKey.load_or_create(path)


def test_signature_is_bound_to_key_purpose_and_message():
    key, other = PeerKey.generate(), PeerKey.generate()
    sig = key.sign("heartbeat", b"hello")
    assert verify_signature(key.public_key, sig, "heartbeat", b"hello")
    assert not verify_signature(other.public_key, sig, "heartbeat", b"hello")
    assert not verify_signature(key.public_key, sig, "join", b"hello")
    assert not verify_signature(key.public_key, sig, "heartbeat", b"hellO")
    assert not verify_signature(key.public_key, b"short", "heartbeat", b"hello")


def test_credential_verifies_only_for_its_coordinator_run_and_lifetime():
    coordinator, member = PeerKey.generate(), PeerKey.generate()
    data = issue(coordinator, _credential(member))
    assert verify_credential(data, coordinator.public_key, run_id="run-1", now=150.0).peer_id == member.peer_id
    with pytest.raises(CredentialError, match="expired"):
        verify_credential(data, coordinator.public_key, run_id="run-1", now=250.0)
    with pytest.raises(CredentialError, match="run"):
        verify_credential(data, coordinator.public_key, run_id="run-2", now=150.0)
    with pytest.raises(CredentialError, match="not signed"):
        verify_credential(data, PeerKey.generate().public_key, run_id="run-1", now=150.0)
    forged = data[:64] + data[64:].replace(b'"role":"peer"', b'"role":"boss"')
    with pytest.raises(CredentialError, match="not signed"):
        verify_credential(forged, coordinator.public_key, run_id="run-1", now=150.0)
    with pytest.raises(CredentialError, match="bytes"):
        verify_credential(b"x" * 5000, coordinator.public_key, run_id="run-1", now=150.0)


def test_credential_for_someone_elses_id_is_refused_even_when_signed():
    coordinator, member = PeerKey.generate(), PeerKey.generate()
    data = issue(coordinator, _credential(member, peer_id="p-0000000000000000"))
    with pytest.raises(CredentialError, match="does not belong"):
        verify_credential(data, coordinator.public_key, run_id="run-1", now=150.0)
