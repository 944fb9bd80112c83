"""Single-use join challenges: a nonce the coordinator hands out and a join must sign, so that a recorded
join cannot be replayed. Kept in memory, bounded: the oldest pending ones go first."""

from __future__ import annotations

import secrets
import threading
from collections import OrderedDict

NONCE_BYTES = 32


class Challenges:
    """Thread-safe; ``_pending`` (nonce -> expiry, oldest first) is only touched under ``_lock``."""

    def __init__(self, *, ttl_s: float = 30.0, max_pending: int = 10_000) -> None:
        self.ttl_s, self.max_pending = ttl_s, max_pending
        self._lock = threading.Lock()
        self._pending: OrderedDict[bytes, float] = OrderedDict()

    def issue(self, now: float) -> bytes:
        nonce = secrets.token_bytes(NONCE_BYTES)
        with self._lock:
            self._drop_expired(now)
            while len(self._pending) >= self.max_pending:
                self._pending.popitem(last=False)
            self._pending[nonce] = now + self.ttl_s
        return nonce

    def take(self, nonce: bytes, now: float) -> bool:
        """True once for a nonce this coordinator issued less than ttl_s ago; False ever after."""
        with self._lock:
            expiry = self._pending.pop(bytes(nonce), None)
        return expiry is not None and now <= expiry

    def _drop_expired(self, now: float) -> None:
        while self._pending:
            nonce, expiry = next(iter(self._pending.items()))
            if expiry >= now:
                return
            del self._pending[nonce]
