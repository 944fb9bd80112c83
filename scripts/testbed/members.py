"""Members of a test run: a coordinator key and coordinator-signed credentials for peers' transports."""

from __future__ import annotations

import time

from swarm.core.trust.credential import Credential, Member, PeerKey, issue


def make_member(
    coordinator: PeerKey,
    run_id: str,
    dht_peer_id: str,
    *,
    key: PeerKey | None = None,
    expires_in_s: float = 3600.0,
    coordinator_public_key: bytes | None = None,
) -> Member:
    """A member of ``run_id`` whose credential ``coordinator`` signed for the libp2p id ``dht_peer_id``;
    it checks others against ``coordinator_public_key`` (``coordinator``'s by default)."""
    key = key or PeerKey.generate()
    now = time.time()
    signed = issue(
        coordinator,
        Credential(
            run_id=run_id,
            peer_id=key.peer_id,
            public_key=key.public_key,
            dht_peer_id=dht_peer_id,
            role="peer",
            token_id="default",
            issued_at=now,
            expires_at=now + expires_in_s,
        ),
    )
    return Member(
        key=key,
        credential=signed,
        run_id=run_id,
        coordinator_public_key=coordinator_public_key or coordinator.public_key,
    )
