"""How loaded the coordinator's gRPC server is, and what it does about it: slow its peers down, shed calls by
priority, and tell the engine not to count a saturated while against anyone's lease.

The server (``coordinator.api.serving``) asks ``LoadMonitor.admit`` for every call as it arrives, with the calls
in flight (accepted, not yet answered), and tells ``waited`` how long calls wait for the event loop. A call is
refused with RESOURCE_EXHAUSTED when the calls in flight reach its method's share of ``max_in_flight``, or the
last wait its method's share of ``REFUSE_WAIT_S`` (joins, challenges and status first, heartbeats next, a round's
reports and polls last). The monitor turns the same measures into the slow-down factor of the peers' pace
(doubled at most once a second while calls queue past ``slow_down_at`` or wait longer than ``slow_wait_s``,
halved after ``CALM_S`` of calm) and into ``overloaded()``: while it is, the engine evicts nobody for a missed
lease.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable

logger = logging.getLogger(__name__)

MAX_IN_FLIGHT = 256  # calls accepted and not yet answered; the last share (reports, polls) is refused past it
# the share of MAX_IN_FLIGHT a method may fill before it is refused: work that can wait goes first
SHARES = {"Challenge": 0.5, "Join": 0.5, "GetStatus": 0.5, "GetHistory": 0.5, "Heartbeat": 0.75}
SLOW_DOWN_AT = MAX_IN_FLIGHT // 2  # calls in flight: the peers are asked to slow down (as joins are refused)
SLOW_WAIT_S = 0.25  # a call waited this long for the loop: the peers are asked to slow down
MAX_SLOWDOWN = 8.0
STEP_S = 1.0  # the factor doubles at most this often
CALM_S = 10.0  # and halves after this long without pressure
OVERLOAD_HOLD_S = 2.0  # after the last refusal or long wait, evictions stay paused this long
OVERLOAD_WAIT_S = 1.0  # a call that waited this long for the loop: the coordinator is overloaded
REFUSE_WAIT_S = 2.0  # while calls wait this long (times their method's share), calls are refused


class LoadMonitor:
    """Thread-safe: its fields are written under ``_lock`` (the server's loop, the engine's readers)."""

    def __init__(
        self,
        *,
        max_in_flight: int = MAX_IN_FLIGHT,
        slow_down_at: int = SLOW_DOWN_AT,
        slow_wait_s: float = SLOW_WAIT_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.max_in_flight, self.slow_down_at, self.slow_wait_s = max_in_flight, slow_down_at, slow_wait_s
        self._clock = clock
        self._lock = threading.Lock()
        self._factor = 1.0
        self._pressure_at = -float("inf")  # when calls last queued past slow_down_at (or waited past slow_wait_s)
        self._stepped_at = -float("inf")  # when the factor last changed
        self._overloaded_at = -float("inf")  # the last refusal or wait past OVERLOAD_WAIT_S
        self.refused: dict[str, int] = {}  # method -> calls refused for load, since the start
        self.slowdowns = 0  # times the factor was raised
        self.max_wait_s = 0.0  # the longest a call waited for the loop, since the start
        self._wait_s, self._waited_at = 0.0, -float("inf")  # the last wait measured, and when

    def admit(self, method: str, in_flight: int) -> bool:
        """Whether a call of ``method`` arriving with ``in_flight`` calls ahead of it is accepted."""
        now = self._clock()
        with self._lock:
            if in_flight >= self.slow_down_at:
                self._pressure_at = now
            share = SHARES.get(method, 1.0)
            waiting = self._wait_s if now - self._waited_at < STEP_S else 0.0
            allowed = in_flight < self.max_in_flight * share and waiting < REFUSE_WAIT_S * share
            if not allowed:
                self.refused[method] = self.refused.get(method, 0) + 1
                self._pressure_at = self._overloaded_at = now
            self._step(now)
        return allowed

    def waited(self, wait_s: float) -> None:
        """A call arriving now would have waited ``wait_s`` before its handler ran (the loop's lag)."""
        now = self._clock()
        with self._lock:
            self.max_wait_s = max(self.max_wait_s, wait_s)
            self._wait_s, self._waited_at = wait_s, now
            if wait_s >= self.slow_wait_s:
                self._pressure_at = now
            if wait_s >= OVERLOAD_WAIT_S:
                self._overloaded_at = now
            self._step(now)

    def slowdown(self) -> float:
        """How many times slower than its pace for the swarm's size the peers are asked to call (1: not slowed)."""
        with self._lock:
            self._step(self._clock())
            return self._factor

    def overloaded(self) -> bool:
        """True while calls are refused or wait long for the loop (and OVERLOAD_HOLD_S after)."""
        return self._clock() - self._overloaded_at < OVERLOAD_HOLD_S

    def snapshot(self) -> dict[str, Any]:
        """What /metrics exports."""
        with self._lock:
            return {
                "slowdown": self._factor,
                "slowdowns": self.slowdowns,
                "refused": dict(self.refused),
                "max_wait_s": self.max_wait_s,
                "overloaded": self.overloaded(),
            }

    def _step(self, now: float) -> None:
        if now - self._stepped_at < STEP_S:
            return
        if now - self._pressure_at < STEP_S and self._factor < MAX_SLOWDOWN:
            self._factor = min(MAX_SLOWDOWN, self._factor * 2)
            self.slowdowns += 1
            self._stepped_at = now
            logger.warning("coordinator saturated: peers asked to call %.0f× less often", self._factor)
        elif now - self._pressure_at >= CALM_S and self._factor > 1.0:
            self._factor = max(1.0, self._factor / 2)
            self._stepped_at = now
            logger.info("coordinator load eased: peers asked to call %.0f× less often than their pace", self._factor)
