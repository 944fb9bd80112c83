"""The coordinator's heap against Python's cyclic garbage collector.

A full pass of the collector stops every thread while it scans every tracked object: the ~200,000 made while
starting (torch and hivemind are imported) and, at 10,000 peers, ~250,000 more (records, reports, the round's
answers). Such a pass took 0.1–0.2 s and ran every minute or so as the peers' records were replaced, and every call
in flight waited for it. ``HeapKeeper`` moves what survived into the collector's permanent generation
(``gc.freeze``) every ``FREEZE_EVERY_S``, after collecting the young generations, so that a full pass scans only
what was made since. A cycle that became garbage after it was frozen is freed by the rare pass over everything,
every ``FULL_EVERY_S``; garbage without a cycle (almost all of it: a replaced record) is freed at once by its
reference count, frozen or not.
"""

from __future__ import annotations

import gc
import time
from typing import Callable

FREEZE_EVERY_S = 30.0
FULL_EVERY_S = 3600.0


class HeapKeeper:
    """Owned by the coordinator's tick thread."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._frozen_at = self._full_at = -float("inf")

    def tick(self) -> None:
        """Freeze the survivors when ``FREEZE_EVERY_S`` passed, collect everything when ``FULL_EVERY_S`` did."""
        now = self._clock()
        if now - self._full_at >= FULL_EVERY_S:
            if self._full_at > -float("inf"):  # not the first: what this process froze before is looked at again
                gc.unfreeze()
            gc.collect()
            gc.freeze()
            self._full_at = self._frozen_at = now
        elif now - self._frozen_at >= FREEZE_EVERY_S:
            gc.collect(1)  # cycles among the young objects, before they are frozen
            gc.freeze()
            self._frozen_at = now
