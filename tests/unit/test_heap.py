"""The coordinator's heap: what survives is frozen out of the collector's full passes every so often, and a cycle
that became garbage after it was frozen is still freed by the rare pass over everything."""

import gc
import weakref

import pytest

from coordinator.heap import FREEZE_EVERY_S, FULL_EVERY_S, HeapKeeper

pytestmark = [
    pytest.mark.timeout(60),
    # the full pass frees what earlier tests in this process left frozen, e.g. DHT clients whose loop is closed
    pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning"),
]


class Node:
    def __init__(self) -> None:
        self.other = self  # a cycle: only the collector frees it


def test_survivors_are_frozen_every_interval_and_a_frozen_cycle_is_freed_by_the_full_pass() -> None:
    now = [0.0]
    keeper = HeapKeeper(clock=lambda: now[0])
    try:
        keeper.tick()  # the first: everything collected, then frozen
        start = gc.get_freeze_count()
        assert start > 0
        cycle = Node()
        gone = weakref.ref(cycle)
        now[0] += FREEZE_EVERY_S / 2
        keeper.tick()
        assert gc.get_freeze_count() == start  # not yet
        now[0] += FREEZE_EVERY_S / 2
        keeper.tick()
        assert gc.get_freeze_count() > start  # the cycle, alive, among the frozen
        del cycle
        gc.collect()
        assert gone() is not None  # frozen: a full pass of the collector does not see it
        now[0] += FULL_EVERY_S
        keeper.tick()
        assert gone() is None  # the pass over everything freed it
    finally:
        gc.unfreeze()
