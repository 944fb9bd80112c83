"""Who this peer is: its Ed25519 key, ``<state-dir>/peer-key.pem``, made at its first start.

The peer id derives from the key, so a restarted peer is the same peer to the coordinator: it gets its
peer index back (same data shard, its checkpoint's data position still applies) in a new session, which
retires the process that joined before. Its libp2p identity is fresh at each start
(``<state-dir>/p2p-identity.key``, taken from the spare the start before made) and proven at join.
"""

from __future__ import annotations

import logging
from pathlib import Path

from peer.link.coordinator_link import PeerExit
from swarm.core.trust.credential import KEY_FILE, CredentialError, PeerKey
from swarm.net.link.libp2p_identity import IDENTITY_FILE, SPARE_FILE, Libp2pIdentity

logger = logging.getLogger(__name__)


def peer_key(state_dir: Path) -> PeerKey:
    """The peer's key, created the first time; an unreadable key file stops the peer with one sentence."""
    try:
        return PeerKey.load_or_create(Path(state_dir) / KEY_FILE)
    except (CredentialError, OSError) as e:
        logger.error("cannot use this peer's key: %s", e)
        raise PeerExit(2) from None


def fresh_libp2p_identity(state_dir: Path) -> Libp2pIdentity:
    """The spare identity an earlier start made (no process used it), else a new one."""
    return Libp2pIdentity.create(Path(state_dir) / IDENTITY_FILE, spare=Path(state_dir) / SPARE_FILE)


def make_spare_libp2p_identity(state_dir: Path) -> None:
    """The next start's libp2p identity, made ahead; a failure only means that start makes its own."""
    try:
        Libp2pIdentity.make_spare(Path(state_dir) / SPARE_FILE)
    except OSError as e:
        logger.warning("could not make a libp2p identity for the next start: %s", e)
