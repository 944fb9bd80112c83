"""The peer's heartbeat thread: renews its lease and reports its numbers while the loop trains.

It heartbeats at the coordinator's pace: the interval of the join's answer, then of each heartbeat's answer
(a coordinator stretches it as its swarm grows or while it is saturated; one that sends none keeps the join's),
a tenth earlier or later at random so that peers that joined together do not call together. Told the
coordinator is busy (RESOURCE_EXHAUSTED), it waits twice as long each time, up to 8 intervals, until a call
goes through.
"""

from __future__ import annotations

import logging
import random
import threading
from typing import Callable, Optional

from peer.faults import FaultPlan
from peer.link.retry import clause, coordinator_back
from peer.report.stats import PeerStats
from swarm.control.client import CoordinatorBusy, CoordinatorClient, CoordinatorRejected, CoordinatorUnreachable
from swarm.net.bulk.transport import FORK_LOCK
from swarm.v1 import coordinator_pb2 as pb

logger = logging.getLogger(__name__)

MIN_INTERVAL_S = 0.2
MAX_INTERVAL_S = 600.0  # a paced interval beyond this (a coordinator's mistake) is taken as this
MAX_BACKOFF = 8  # intervals a peer told the coordinator is busy waits at most
JITTER = 0.1


class HeartbeatThread(threading.Thread):
    def __init__(
        self,
        client: CoordinatorClient,
        peer_id: str,
        stats: PeerStats,
        stop: threading.Event,
        *,
        interval_s: float,
        faults: Optional[FaultPlan] = None,
        renewed: Callable[[bytes], None] = lambda credential: None,
    ):
        super().__init__(name="swarm-heartbeat", daemon=True)
        self.client, self.peer_id, self.stats, self.stop = client, peer_id, stats, stop
        self.interval_s = _bounded(interval_s)  # the coordinator's pace; this thread's only
        self.faults = faults or FaultPlan()
        self.renewed = renewed  # called with each fresh credential a heartbeat answer brings
        self.rejection: Optional[str] = None  # set when the coordinator refuses this peer for good
        self.heard: Optional[pb.RoundInfo] = None  # the round the last answer was about (the open or latest one)
        self._wake = threading.Event()
        self._unreachable_since_logged = False
        self._backoff = 1  # doubled while the coordinator says it is busy

    def beat_now(self) -> None:
        self._wake.set()

    def run(self) -> None:
        while not self.stop.is_set() and self.rejection is None:
            try:
                if not self.faults.drops(self.stats.metrics().round, "heartbeat"):
                    with FORK_LOCK:  # never in a gRPC call while the transport forks its DHT process
                        answer = self.client.heartbeat(self.stats.heartbeat_request(self.peer_id))
                    self.heard = answer.round
                    if answer.heartbeat_interval_s > 0:
                        self.interval_s = _bounded(answer.heartbeat_interval_s)
                    if answer.credential:
                        self.renewed(answer.credential)
                if self._unreachable_since_logged:
                    logger.info("[%s] coordinator reachable again; heartbeats resumed", self.peer_id)
                    self._unreachable_since_logged = False
                    coordinator_back()  # the report waiting out its backoff goes now
                self._backoff = 1
            except CoordinatorBusy as e:
                self._backoff = min(MAX_BACKOFF, self._backoff * 2)
                logger.debug("[%s] %s; the next heartbeat in %d intervals", self.peer_id, clause(e), self._backoff)
            except CoordinatorUnreachable as e:
                if not self._unreachable_since_logged:
                    logger.warning("[%s] %s; training continues, heartbeats will retry", self.peer_id, clause(e))
                    self._unreachable_since_logged = True
            except CoordinatorRejected as e:
                self.rejection = str(e)
                self.stop.set()
                return
            self._wake.wait(self.interval_s * self._backoff * random.uniform(1 - JITTER, 1 + JITTER))
            self._wake.clear()


def _bounded(interval_s: float) -> float:
    return min(MAX_INTERVAL_S, max(MIN_INTERVAL_S, interval_s))
