"""Who this peer was before it restarted: its peer id, kept in ``<state-dir>/identity.json``.

A restarted peer hands the id to the coordinator when it joins again; the coordinator retires the old
id and gives the new one the same peer index, so the peer trains on the same data shard and its
checkpoint's data position still applies. A missing or unreadable file just means a new peer.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from swarm.core.state import write_atomically

logger = logging.getLogger(__name__)

FILE = "identity.json"


def previous_peer_id(state_dir: Path) -> str:
    path = Path(state_dir) / FILE
    if not path.exists():
        return ""
    try:
        record = json.loads(path.read_text())
        return str(record["peer_id"]) if isinstance(record, dict) else ""
    except (OSError, ValueError, KeyError) as e:
        logger.warning("ignoring %s (%s); this peer joins as a new one", path, e)
        return ""


def remember(state_dir: Path, *, run_id: str, peer_id: str) -> None:
    """Write the identity atomically; a failure is logged, never fatal (the peer then rejoins as new)."""
    path = Path(state_dir) / FILE
    try:
        write_atomically(path, json.dumps({"run_id": run_id, "peer_id": peer_id}).encode())
    except OSError as e:
        logger.warning("could not write %s: %s", path, e)
