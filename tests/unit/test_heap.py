"""The coordinator's heap: what survives is frozen out of the collector's full passes every so often, and a cycle
that became garbage after it was frozen is still freed by the rare pass over everything. Checked in a fresh
interpreter: the collector's state is the whole process's, and other tests' threads change it."""

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.timeout(120), pytest.mark.slow]  # starts an interpreter

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = """
import gc, weakref
from coordinator.heap import FREEZE_EVERY_S, FULL_EVERY_S, HeapKeeper

class Node:
    def __init__(self):
        self.other = self  # a cycle: only the collector frees it

def frozen(obj):  # the permanent generation is not among the objects the collector looks at
    return gc.is_tracked(obj) and not any(o is obj for o in gc.get_objects())

now = [0.0]
keeper = HeapKeeper(clock=lambda: now[0])
old = Node()
keeper.tick()  # the first: everything collected, then frozen
print("old frozen", frozen(old))
cycle = Node()
gone = weakref.ref(cycle)
now[0] += FREEZE_EVERY_S / 2
keeper.tick()
print("new frozen before the interval", frozen(cycle))
now[0] += FREEZE_EVERY_S / 2
keeper.tick()
print("new frozen after the interval", frozen(cycle))
del cycle
gc.collect()
print("frozen garbage freed by a full pass", gone() is None)
now[0] += FULL_EVERY_S
keeper.tick()
print("frozen garbage freed by the hourly pass", gone() is None)
"""


def test_survivors_are_frozen_every_interval_and_a_frozen_cycle_is_freed_by_the_hourly_pass() -> None:
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True, text=True, timeout=100, check=True
    ).stdout
    assert out.splitlines() == [
        "old frozen True",
        "new frozen before the interval False",
        "new frozen after the interval True",
        "frozen garbage freed by a full pass False",
        "frozen garbage freed by the hourly pass True",
    ], out
