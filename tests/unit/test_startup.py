"""A peer's start is timed step by step, and the warm-up import never breaks a start."""

from __future__ import annotations

import re
import sys

import pytest

from peer.startup import StartupClock, seconds_since_launch, warm_imports

pytestmark = pytest.mark.timeout(30)


def test_the_summary_names_every_step_and_adds_up_to_the_time_since_launch():
    clock = StartupClock()
    for step in ("join", "trainer", "DHT"):
        clock.mark(step)
    line = clock.summary()
    assert re.fullmatch(r"[\d.]+s after launch \(imports [\d.]+s, join [\d.]+s, trainer [\d.]+s, DHT [\d.]+s\)", line), line
    launched = seconds_since_launch()
    assert launched is not None and 0 < launched < 3600  # this test process started moments ago
    assert clock.since_launch() >= sum(seconds for _, seconds in clock.steps)


def test_a_module_that_cannot_be_imported_only_costs_the_warm_up():
    thread = warm_imports(("json", "no_such_module_for_swarm"))
    thread.join(timeout=10)
    assert not thread.is_alive() and "json" in sys.modules
