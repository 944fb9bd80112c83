"""A peer's start, timed and overlapped: where the seconds from launch to the first round go, and the
slow imports the trainer build needs, done in a background thread while the peer waits on the network.

``StartupClock`` marks each step of a start (join, trainer build, DHT start, sync) and logs one line
when the peer starts training its first round, so that a restart's cost is visible in every peer log.
"""

from __future__ import annotations

import importlib
import logging
import os
import threading
import time
from typing import Callable, Optional

logger = logging.getLogger(__name__)

# Imported by the first optimizer built (torch.optim wraps its __init__ to keep dynamo away from it):
# about as slow as importing torch itself, and pure CPU work the join's network waits can hide.
WARM_MODULES = ("torch._dynamo",)


def seconds_since_launch() -> Optional[float]:
    """How long ago this process was started (Linux /proc; None elsewhere)."""
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return max(0.0, uptime - int(fields[19]) / os.sysconf("SC_CLK_TCK"))  # field 22: starttime
    except (OSError, ValueError, IndexError):
        return None


def _import_quietly(names: tuple[str, ...]) -> None:
    for name in names:
        try:
            importlib.import_module(name)
        except Exception as e:  # the trainer build imports it again and reports any real problem
            logger.debug("warm-up import of %s failed: %s", name, e)


def warm_imports(names: tuple[str, ...] = WARM_MODULES) -> threading.Thread:
    """Start importing ``names`` in a daemon thread; join it before forking (no import may be in flight)."""
    thread = threading.Thread(target=_import_quietly, args=(names,), name="swarm-warm-imports", daemon=True)
    thread.start()
    return thread


class StartupClock:
    """Marks of one start, in seconds since the process was launched (or since the clock was made)."""

    def __init__(self) -> None:
        self._t0 = time.monotonic()
        self.before = seconds_since_launch()  # interpreter start and imports before the clock existed
        self.steps: list[tuple[str, float]] = []
        self._last = self._t0
        self.reported = False
        self._warming: list[threading.Thread] = []

    def warm(self, *tasks: Callable[[], None]) -> None:
        """Start the warm-up imports and ``tasks`` in daemon threads."""
        self._warming = [warm_imports()] + [threading.Thread(target=task, name="swarm-warm-up", daemon=True)
                                            for task in tasks]
        for thread in self._warming[1:]:
            thread.start()

    def warmed(self, step: str) -> None:
        """Wait for the warm-up work (none may be in flight when the DHT process forks), then mark."""
        for thread in self._warming:
            thread.join()
        self.mark(step)

    def mark(self, step: str) -> None:
        now = time.monotonic()
        self.steps.append((step, now - self._last))
        self._last = now

    def since_launch(self) -> float:
        return (self.before or 0.0) + time.monotonic() - self._t0

    def first_round(self, tag: str) -> None:
        """The peer starts training its first round: log where the start's seconds went (once)."""
        if not self.reported:
            self.reported = True
            self.mark("sync and wait")
            logger.info("%s first round: training %s", tag, self.summary())

    def summary(self) -> str:
        parts = [f"imports {self.before:.1f}s"] if self.before is not None else []
        parts += [f"{step} {seconds:.1f}s" for step, seconds in self.steps]
        return f"{self.since_launch():.1f}s after launch ({', '.join(parts)})"
