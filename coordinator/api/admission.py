"""Who is a member: a joiner admitted by its token, a caller recognised by its key in its current
session, a member whose join token was revoked, and the signed credential a live member carries.

Pure functions over the records; the engine holds the records and the key, and saves what these return.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from coordinator import membership
from coordinator.api import auth, tokens
from coordinator.api.errors import NotAuthenticated
from coordinator.store.records import PeerRecord, RunRecord
from swarm.control import signing
from swarm.core.trust import credential
from swarm.core.trust.credential import peer_id_for

CREDENTIAL_TTL_S = 3600.0  # a member's credential lasts this long; heartbeats renew it at half its life


def admit(
    store: tokens.TokenStore,
    run: RunRecord,
    token: str,
    *,
    public_key: bytes,
    previous: Optional[PeerRecord],
    now: float,
    lease_s: float,
    dht_peer_id: str,
    name: str,
    site: str,
    device: str,
    swarm_version: str,
) -> tuple[RunRecord, PeerRecord]:
    """The holder of ``public_key`` (proven by the caller) admitted by ``token``, its use counted: a new
    member, or ``previous`` (this key's record) restarted; BadToken or TokenRefused when it may not join (the
    token's identities are all live, this key not among them)."""
    peer_id = peer_id_for(public_key)
    admitted = tokens.admit_joiner(store, token, now=now, peer_id=peer_id)
    return membership.new_peer(
        run,
        peer_id=peer_id,
        now=now,
        lease_s=lease_s,
        name=name,
        site=admitted.site or site,  # a site-pinned token decides where its peers are
        device=device,
        swarm_version=swarm_version,
        public_key=public_key,
        dht_peer_id=dht_peer_id,
        token_id=admitted.id,
        previous=previous,
    )


def check_caller(
    proof: Optional[signing.CallProof], peer_id: str, peer: Optional[PeerRecord], *, now: float
) -> PeerRecord:
    """``peer``, the record of ``peer_id`` (the request's peer id), if ``proof`` is a fresh signature by
    its key in its current session; NotAuthenticated, or PeerGone for a replaced session, otherwise."""
    if proof is None or proof.peer_id != peer_id:
        raise NotAuthenticated()
    peer = auth.check_call(proof, peer, now=now)
    membership.check_session(peer, proof.session)
    if proof.session != peer.session:
        raise NotAuthenticated()
    return peer


def revocation(store: tokens.TokenStore, peer: PeerRecord) -> Optional[str]:
    """Why the live member ``peer`` must go because its join token was revoked; None when it may stay."""
    if peer.alive and tokens.revoked(store, peer.token_id):
        return f"its join token {peer.token_id} was revoked"
    return None


def credential_due(peer: Optional[PeerRecord], now: float, *, ttl_s: float, renew_only: bool) -> bool:
    """A live member gets a credential; with ``renew_only``, only when less than half of its current
    one's life is left."""
    if peer is None or not peer.alive:
        return False
    return not renew_only or now >= peer.credential_expires_at - ttl_s / 2


def issue_credential(
    key: credential.PeerKey, run_id: str, peer: PeerRecord, *, now: float, ttl_s: float
) -> tuple[PeerRecord, bytes]:
    """``peer`` with its new credential's expiry, and that credential signed by ``key``."""
    expires_at = now + ttl_s
    signed = credential.issue(
        key,
        credential.Credential(
            run_id=run_id,
            peer_id=peer.peer_id,
            public_key=bytes.fromhex(peer.public_key),
            dht_peer_id=peer.dht_peer_id,
            role="peer",
            token_id=peer.token_id,
            issued_at=now,
            expires_at=expires_at,
            site=peer.site,
        ),
    )
    return dataclasses.replace(peer, credential_expires_at=expires_at), signed
