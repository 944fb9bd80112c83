"""A peer's calls to an unreachable coordinator retry with backoff, and go at once when the heartbeat hears it again."""

from __future__ import annotations

import threading
import time

import pytest

from peer.link.retry import coordinator_back, with_retry
from swarm.control.client import CoordinatorUnreachable

pytestmark = pytest.mark.timeout(30)


def test_a_call_waiting_out_its_backoff_retries_as_soon_as_the_coordinator_is_back() -> None:
    """A chaos soak: a restarted peer's report waited 4 s of backoff after its heartbeat had heard the coordinator
    again, and the round with it."""
    up, tried = threading.Event(), threading.Event()

    def report() -> str:
        tried.set()
        if not up.is_set():
            raise CoordinatorUnreachable("cannot reach the coordinator (connection refused)")
        return "reported"

    result: list[str] = []
    caller = threading.Thread(
        target=lambda: result.append(
            with_retry(report, what="report round 3", stop=threading.Event(), first_backoff_s=20.0)
        )
    )
    started = time.monotonic()
    caller.start()
    assert tried.wait(10)  # the first try failed: the caller now waits out 20 s of backoff
    up.set()
    coordinator_back()  # the heartbeat got an answer
    caller.join(10)
    assert result == ["reported"] and time.monotonic() - started < 10


def test_a_stopped_peer_stops_waiting_at_once() -> None:
    stop = threading.Event()

    def unreachable() -> None:
        stop.set()  # the peer is told to leave while the coordinator is down
        raise CoordinatorUnreachable("cannot reach the coordinator")

    started = time.monotonic()
    assert with_retry(unreachable, what="report round 4", stop=stop, first_backoff_s=20.0) is None
    assert time.monotonic() - started < 5
