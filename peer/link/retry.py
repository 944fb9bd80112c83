"""Calling the coordinator (or joining the DHT through its node) from a peer: retry with backoff while it is unreachable, say so once per wait."""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Optional, TypeVar

from swarm.control.client import CoordinatorUnreachable

logger = logging.getLogger(__name__)
T = TypeVar("T")

_back = threading.Condition()  # notified when the coordinator answers again (``coordinator_back``)
_times_back = 0
PAUSE_SLICE_S = 0.1  # how often a backoff checks ``stop`` (nothing notifies the condition when it is set)


def coordinator_back() -> None:
    """The coordinator answered again (the heartbeat saw it): every call waiting out a backoff retries now, instead of
    up to ``max_backoff_s`` later (a chaos soak: a restarted peer's report waited 4 s more, and its round with it)."""
    global _times_back
    with _back:
        _times_back += 1
        _back.notify_all()


def clause(error: BaseException) -> str:
    """An error's sentence as a clause inside a longer log line: without its final period (no "running.; retrying")."""
    return str(error).rstrip().rstrip(".")


def _pause(stop: threading.Event, seconds: float, seen: int) -> None:
    """Wait ``seconds``, less when ``stop`` is set or the coordinator was back since ``_times_back`` was ``seen``."""
    with _back:
        until = time.monotonic() + seconds
        while not stop.is_set() and _times_back == seen and (left := until - time.monotonic()) > 0:
            _back.wait(min(left, PAUSE_SLICE_S))


def with_retry(
    call: Callable[[], T],
    *,
    what: str,
    stop: threading.Event,
    give_up_after_s: Optional[float] = None,
    first_backoff_s: float = 0.5,
    max_backoff_s: float = 10.0,
    retry_on: type[Exception] = CoordinatorUnreachable,
) -> Optional[T]:
    """Return call()'s result, retrying on ``retry_on`` (the coordinator being unreachable); None if
    stopped or given up.

    CoordinatorRejected and other errors propagate: they are not fixed by waiting.
    """
    backoff, waited = first_backoff_s, 0.0
    while not stop.is_set():
        seen = _times_back  # the coordinator back after the call began (it failed meanwhile): retry at once
        try:
            result = call()
            if waited:
                logger.info("%s: succeeded after %.0fs of retrying", what, waited)
            return result
        except retry_on as e:
            if stop.is_set() or (give_up_after_s is not None and waited >= give_up_after_s):
                return None  # stopped meanwhile (the peer is leaving): no retry to announce
            logger.warning("%s: %s; retrying in %.1fs", what, clause(e), backoff)
            started = time.monotonic()
            _pause(stop, backoff, seen)
            waited += time.monotonic() - started
            backoff = min(max_backoff_s, backoff * 2)
    return None
