"""How loaded the coordinator's gRPC server is, and what it does about it: slow its peers down, shed calls by
priority, and tell the engine not to count a saturated while against anyone's lease.

``CountingPool`` is the server's thread pool, counting the calls in flight (accepted, not yet answered: queued or
running). ``LoadInterceptor`` sees every call as it arrives (on gRPC's polling thread): it refuses one with
RESOURCE_EXHAUSTED when the calls in flight reach its method's share of ``max_in_flight`` (joins, challenges and
status first, heartbeats next, a round's reports and polls last), and times how long each accepted call waited
for a thread. ``LoadMonitor`` turns that into the slow-down factor of the peers' pace (doubled at most once a
second while calls queue past ``slow_down_at`` or wait longer than ``slow_wait_s``, halved after ``calm_s`` of
calm) and into ``overloaded()``: while it is, the engine evicts nobody for a missed lease.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Optional

import grpc

logger = logging.getLogger(__name__)

MAX_IN_FLIGHT = 256  # calls accepted and not yet answered; the last share (reports, polls) is refused past it
# the share of MAX_IN_FLIGHT a method may fill before it is refused: work that can wait goes first
SHARES = {"Challenge": 0.5, "Join": 0.5, "GetStatus": 0.5, "GetHistory": 0.5, "Heartbeat": 0.75}
SLOW_DOWN_AT = MAX_IN_FLIGHT // 2  # calls in flight: the peers are asked to slow down (as joins are refused)
SLOW_WAIT_S = 0.25  # a call waited this long for a thread: the peers are asked to slow down
MAX_SLOWDOWN = 8.0
STEP_S = 1.0  # the factor doubles at most this often
CALM_S = 10.0  # and halves after this long without pressure
OVERLOAD_HOLD_S = 2.0  # after the last refusal or long wait, evictions stay paused this long
OVERLOAD_WAIT_S = 1.0  # a call that waited this long for a thread: the coordinator is overloaded


class CountingPool(ThreadPoolExecutor):
    """A thread pool that counts the calls submitted and not yet finished (gRPC submits each accepted call once)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._count_lock = threading.Lock()
        self.in_flight = 0  # guarded by _count_lock for writes; a plain int read anywhere

    def submit(self, fn: Callable, /, *args: Any, **kwargs: Any) -> Future:
        with self._count_lock:
            self.in_flight += 1
        try:
            future = super().submit(fn, *args, **kwargs)
        except BaseException:
            self._finished(None)
            raise
        future.add_done_callback(self._finished)
        return future

    def _finished(self, _future: Optional[Future]) -> None:
        with self._count_lock:
            self.in_flight -= 1


class LoadMonitor:
    """Thread-safe: its fields are written under ``_lock`` (the polling thread, the worker threads)."""

    def __init__(self, *, max_in_flight: int = MAX_IN_FLIGHT, slow_down_at: int = SLOW_DOWN_AT,
                 slow_wait_s: float = SLOW_WAIT_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.max_in_flight, self.slow_down_at, self.slow_wait_s = max_in_flight, slow_down_at, slow_wait_s
        self._clock = clock
        self._lock = threading.Lock()
        self._factor = 1.0
        self._pressure_at = -float("inf")  # when calls last queued past slow_down_at (or waited past slow_wait_s)
        self._stepped_at = -float("inf")  # when the factor last changed
        self._overloaded_at = -float("inf")  # the last refusal or wait past OVERLOAD_WAIT_S
        self.refused: dict[str, int] = {}  # method -> calls refused for load, since the start
        self.slowdowns = 0  # times the factor was raised
        self.max_wait_s = 0.0  # the longest a call waited for a thread, since the start

    def admit(self, method: str, in_flight: int) -> bool:
        """Whether a call of ``method`` arriving with ``in_flight`` calls ahead of it is accepted."""
        now = self._clock()
        with self._lock:
            if in_flight >= self.slow_down_at:
                self._pressure_at = now
            allowed = in_flight < self.max_in_flight * SHARES.get(method, 1.0)
            if not allowed:
                self.refused[method] = self.refused.get(method, 0) + 1
                self._pressure_at = self._overloaded_at = now
            self._step(now)
        return allowed

    def waited(self, wait_s: float) -> None:
        """An accepted call waited ``wait_s`` between its arrival and a thread taking it."""
        now = self._clock()
        with self._lock:
            self.max_wait_s = max(self.max_wait_s, wait_s)
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
        """True while calls are refused or wait long for a thread (and OVERLOAD_HOLD_S after)."""
        return self._clock() - self._overloaded_at < OVERLOAD_HOLD_S

    def snapshot(self) -> dict[str, Any]:
        """What /metrics exports."""
        with self._lock:
            return {"slowdown": self._factor, "slowdowns": self.slowdowns, "refused": dict(self.refused),
                    "max_wait_s": self.max_wait_s, "overloaded": self.overloaded()}

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


class LoadInterceptor(grpc.ServerInterceptor):
    """Refuses calls beyond their method's share of the thread pool's capacity; times the queue of the others."""

    def __init__(self, monitor: LoadMonitor, pool: CountingPool, clock: Callable[[], float] = time.monotonic) -> None:
        self._monitor, self._pool, self._clock = monitor, pool, clock

    def intercept_service(self, continuation, handler_call_details):
        method = handler_call_details.method.rpartition("/")[2]
        handler = continuation(handler_call_details)
        if handler is None or handler.unary_unary is None:
            return handler
        if not self._monitor.admit(method, self._pool.in_flight):
            return handler._replace(unary_unary=_refuse)
        arrived, behavior = self._clock(), handler.unary_unary

        def timed(request, context):
            self._monitor.waited(self._clock() - arrived)
            return behavior(request, context)

        return handler._replace(unary_unary=timed)


def _refuse(request, context: grpc.ServicerContext):
    context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                  "the coordinator is saturated and sheds calls that can wait; retry in a few seconds.")
