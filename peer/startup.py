"""A peer's start, timed and overlapped: where the seconds from launch to the first round go; the slow
imports the trainer build needs, done in a background thread while the peer waits on the network; and
the DHT start, in another thread while the trainer builds.

``StartupClock`` marks each step of a start (join, trainer build, DHT start, sync) and logs one line
when the peer starts training its first round, so that a restart's cost is visible in every peer log. When the
start-up probe's passes are the first step's own (``swarm.train.step_probe``), the peer's training began with
them: the line counts from launch to the probe then, and says when the round opened.

Forking (the DHT process) while another thread imports is safe here: ``os.fork`` holds the interpreter's
import lock, and the DHT process runs only hivemind code its starting thread imported before it forked.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import threading
import time
from typing import Callable, Optional, TypeVar

logger = logging.getLogger(__name__)
T = TypeVar("T")


# time.monotonic() at which this peer was launched, when that is not this process's start: a supervised peer's
# first child counts from its parent's launch, which did the imports (peer/restarts.py)
launched_at: Optional[float] = None
# called once when the peer starts training its first round (a supervised child tells its parent it started)
on_first_round: Optional[Callable[[], object]] = None


def seconds_since_launch() -> Optional[float]:
    """How long ago this peer was launched: ``launched_at``, else this process's start (Linux /proc; None
    elsewhere)."""
    if launched_at is not None:
        return max(0.0, time.monotonic() - launched_at)
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return max(0.0, uptime - int(fields[19]) / os.sysconf("SC_CLK_TCK"))  # field 22: starttime
    except (OSError, ValueError, IndexError):
        return None


def result_or_none(future: "Optional[concurrent.futures.Future[T]]", timeout_s: float) -> Optional[T]:
    """What an overlapped task returned, waiting at most ``timeout_s``; None if it failed or is still running."""
    if future is None:
        return None
    try:
        return future.result(timeout=timeout_s)
    except BaseException:  # noqa: BLE001  its failure was the start's, already reported there
        return None


class StartupClock:
    """Marks of one start, in seconds since the process was launched (or since the clock was made)."""

    def __init__(self) -> None:
        self._t0 = time.monotonic()
        self.before = seconds_since_launch()  # interpreter start and imports before the clock existed
        self.steps: list[tuple[str, float]] = []
        self._last = self._t0
        self.reported = False
        self._warming: list[threading.Thread] = []
        # whether the first step will use the passes the "probe" step made ahead (then training began with them)
        self.first_passes: Optional[Callable[[], bool]] = None

    def warm(self, *tasks: Callable[[], None]) -> None:
        """Start ``tasks`` in daemon threads (nobody waits for them)."""
        self._warming = [threading.Thread(target=task, name="swarm-warm-up", daemon=True) for task in tasks]
        for thread in self._warming:
            thread.start()

    @staticmethod
    def overlap(task: Callable[[], T], name: str = "swarm-dht-start") -> "concurrent.futures.Future[T]":
        """Run ``task`` in a daemon thread while the caller goes on; its result (or exception) in the future."""
        future: concurrent.futures.Future[T] = concurrent.futures.Future()

        def run() -> None:
            if not future.set_running_or_notify_cancel():
                return
            try:
                future.set_result(task())
            except BaseException as e:  # PeerExit too: the caller re-raises it from result()
                future.set_exception(e)

        threading.Thread(target=run, name=name, daemon=True).start()
        return future

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
            if on_first_round is not None:
                on_first_round()

    def summary(self) -> str:
        parts = [f"imports {self.before:.1f}s"] if self.before is not None else []
        parts += [f"{step} {seconds:.1f}s" for step, seconds in self.steps]
        since = self.since_launch()
        began = since
        opened = ""
        names = [step for step, _ in self.steps]
        if "probe" in names and self.first_passes is not None and self.first_passes():
            began = (self.before or 0.0) + sum(seconds for _, seconds in self.steps[: names.index("probe")])
            parts[names.index("probe") + len(parts) - len(names)] += " (the first step's passes)"
            opened = f"; the round opened {since:.1f}s after launch"
        # the CPU seconds of this process (all its threads): a loaded machine shows as wall ≫ CPU
        return f"{began:.1f}s after launch ({', '.join(parts)}{opened}; {time.process_time():.1f} CPU-s)"
