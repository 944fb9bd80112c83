"""Calling the coordinator (or joining the DHT through its node) from a peer: retry with backoff while it is unreachable, say so once per wait."""

from __future__ import annotations

import logging
import threading
from typing import Callable, Optional, TypeVar

from swarm.control.client import CoordinatorUnreachable

logger = logging.getLogger(__name__)
T = TypeVar("T")


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
        try:
            result = call()
            if waited:
                logger.info("%s: succeeded after %.0fs of retrying", what, waited)
            return result
        except retry_on as e:
            if give_up_after_s is not None and waited >= give_up_after_s:
                return None
            logger.warning("%s: %s; retrying in %.1fs", what, e, backoff)
            stop.wait(backoff)
            waited += backoff
            backoff = min(max_backoff_s, backoff * 2)
    return None
