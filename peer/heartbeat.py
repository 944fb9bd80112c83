"""The peer's heartbeat thread: renews its lease and reports its numbers while the loop trains."""

from __future__ import annotations

import logging
import threading
from typing import Callable, Optional

from peer.faults import FaultPlan
from peer.retry import clause, coordinator_back
from peer.stats import PeerStats
from swarm.control.client import CoordinatorClient, CoordinatorRejected, CoordinatorUnreachable
from swarm.net.transport import FORK_LOCK
from swarm.v1 import coordinator_pb2 as pb

logger = logging.getLogger(__name__)


class HeartbeatThread(threading.Thread):
    def __init__(self, client: CoordinatorClient, peer_id: str, stats: PeerStats, stop: threading.Event,
                 *, interval_s: float, faults: Optional[FaultPlan] = None,
                 renewed: Callable[[bytes], None] = lambda credential: None):
        super().__init__(name="swarm-heartbeat", daemon=True)
        self.client, self.peer_id, self.stats, self.stop = client, peer_id, stats, stop
        self.interval_s = max(0.2, interval_s)
        self.faults = faults or FaultPlan()
        self.renewed = renewed  # called with each fresh credential a heartbeat answer brings
        self.rejection: Optional[str] = None  # set when the coordinator refuses this peer for good
        self.heard: Optional[pb.RoundInfo] = None  # the round the last answer was about (the open or latest one)
        self._wake = threading.Event()
        self._unreachable_since_logged = False

    def beat_now(self) -> None:
        self._wake.set()

    def run(self) -> None:
        while not self.stop.is_set() and self.rejection is None:
            try:
                if not self.faults.drops(self.stats.metrics().round, "heartbeat"):
                    with FORK_LOCK:  # never in a gRPC call while the transport forks its DHT process
                        answer = self.client.heartbeat(self.stats.heartbeat_request(self.peer_id))
                    self.heard = answer.round
                    if answer.credential:
                        self.renewed(answer.credential)
                if self._unreachable_since_logged:
                    logger.info("[%s] coordinator reachable again; heartbeats resumed", self.peer_id)
                    self._unreachable_since_logged = False
                    coordinator_back()  # the report waiting out its backoff goes now
            except CoordinatorUnreachable as e:
                if not self._unreachable_since_logged:
                    logger.warning("[%s] %s; training continues, heartbeats will retry", self.peer_id, clause(e))
                    self._unreachable_since_logged = True
            except CoordinatorRejected as e:
                self.rejection = str(e)
                self.stop.set()
                return
            self._wake.wait(self.interval_s)
            self._wake.clear()
