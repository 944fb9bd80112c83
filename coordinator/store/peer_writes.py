"""When a peer's record must reach the store: at once when something the run decides by changed, else
at most every ``METRICS_PERSIST_S`` (a heartbeat's usual news is only its lease and its counters).

The lease is never needed from disk: a restarted coordinator gives every live peer a fresh one.
"""

from __future__ import annotations

import dataclasses

from coordinator.store.records import PeerRecord

METRICS_PERSIST_S = 5.0

# The metrics the coordinator decides by (readiness, rounds, identity); a change to one is written at once.
_DURABLE_METRICS = (
    "state",
    "round",
    "state_round",
    "state_hash",
    "model_fingerprint",
    "param_count",
    "dht_peer_id",
    "dht_maddrs",
)


class PeerWrites:
    """Owned by the engine, under its lock."""

    def __init__(self) -> None:
        self._written_at: dict[str, float] = {}  # peer id -> its last_seen when last written

    def due(self, old: PeerRecord | None, new: PeerRecord) -> bool:
        """Whether ``new`` (replacing ``old``) must be written now; if so, counts it as written."""
        last = self._written_at.get(new.peer_id)
        if old is None or last is None or durable_change(old, new) or new.last_seen - last >= METRICS_PERSIST_S:
            self._written_at[new.peer_id] = new.last_seen
            return True
        return False


def durable_change(old: PeerRecord, new: PeerRecord) -> bool:
    """Anything beyond the lease and the counters changed between ``old`` and ``new``."""
    if dataclasses.replace(old, last_seen=new.last_seen, lease_expiry=new.lease_expiry, metrics=new.metrics) != new:
        return True
    return any(getattr(old.metrics, name) != getattr(new.metrics, name) for name in _DURABLE_METRICS)
