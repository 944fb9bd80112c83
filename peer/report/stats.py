"""What a peer measures about itself (a ``PeerMetrics``), shared by the training loop and the heartbeat thread.

The loop writes with ``update`` and ``add``, whose keywords are PeerMetrics field names; the heartbeat
thread sends a copy with ``heartbeat_request``.  A new metric is a field in the proto and one call
where it is measured.
"""

from __future__ import annotations

import math
import threading
import time
from typing import Any

from swarm.v1 import coordinator_pb2 as pb


class PeerStats:
    """Thread-safe; ``_metrics`` is only touched under ``_lock``."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._started = time.monotonic()
        self._metrics = pb.PeerMetrics(
            state=pb.PEER_STATE_JOINING,
            # NaN: none yet
            loss=math.nan,
            eval_loss=math.nan,
            upload_mbit_s=math.nan,
            download_mbit_s=math.nan,
            rtt_ms=math.nan,
        )

    def update(self, **fields: Any) -> None:
        """Set metrics, e.g. ``update(state=pb.PEER_STATE_READY, state_round=3)``."""
        changed = pb.PeerMetrics(**fields)  # raises ValueError for a name PeerMetrics lacks
        with self._lock:
            for name in fields:
                self._metrics.ClearField(name)
            self._metrics.MergeFrom(changed)

    def probed(self, step_time_s: float) -> None:
        """A step time from the start-up probe (``swarm.train.step_probe``), not yet a round's measurement."""
        self.update(step_time_s=step_time_s, step_time_probed=True)

    def add(self, **increments: Any) -> None:
        """Add to cumulative metrics, e.g. ``add(bytes_sent=n, tokens=t)``."""
        with self._lock:
            for name, value in increments.items():
                setattr(self._metrics, name, getattr(self._metrics, name) + value)

    def metrics(self) -> pb.PeerMetrics:
        """A copy of the metrics as they are now."""
        with self._lock:
            copy = pb.PeerMetrics()
            copy.CopyFrom(self._metrics)
        copy.wall_time_s = time.monotonic() - self._started
        return copy

    def heartbeat_request(self, peer_id: str) -> pb.HeartbeatRequest:
        return pb.HeartbeatRequest(peer_id=peer_id, metrics=self.metrics())
