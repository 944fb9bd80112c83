"""Token buckets per key (a client address, a join token): how many joins the coordinator takes from one
source before it asks it to wait. Bounded: the least recently used keys are forgotten first."""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True, kw_only=True)
class Rate:
    per_s: float  # refill
    burst: int  # bucket size: this many at once after a quiet while


@dataclass(frozen=True, kw_only=True)
class JoinLimits:
    challenges_per_address: Rate = Rate(per_s=2.0, burst=20)
    joins_per_address: Rate = Rate(per_s=1.0, burst=10)
    joins_per_token: Rate = Rate(per_s=3.0, burst=30)


class RateLimiter:
    """Thread-safe; ``_buckets`` (key -> (tokens, last refill)) is only touched under ``_lock``."""

    def __init__(self, rate: Rate, *, max_keys: int = 10_000, clock: Callable[[], float] = time.monotonic) -> None:
        self.rate, self.max_keys, self._clock = rate, max_keys, clock
        self._lock = threading.Lock()
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()

    def allow(self, key: str) -> bool:
        """Take one from ``key``'s bucket; False when it is empty."""
        now = self._clock()
        with self._lock:
            tokens, last = self._buckets.pop(key, (float(self.rate.burst), now))
            tokens = min(float(self.rate.burst), tokens + (now - last) * self.rate.per_s)
            allowed = tokens >= 1.0
            self._buckets[key] = (tokens - 1.0 if allowed else tokens, now)
            while len(self._buckets) > self.max_keys:
                self._buckets.popitem(last=False)
        return allowed


def client_address(peer: str) -> str:
    """The address part of gRPC's ``context.peer()`` ("ipv4:1.2.3.4:5678" -> "ipv4:1.2.3.4")."""
    address, colon, port = peer.rpartition(":")
    return address if colon and port.isdigit() else peer
