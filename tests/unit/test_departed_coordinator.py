"""A peer never waits forever for a coordinator that is gone: once the run is known finished it gives up at
once (Departed), otherwise after ``give_up_after_s`` with one sentence (exit 1); a stop ends every wait (exit 0)."""

from __future__ import annotations

import logging
import threading

import pytest

from peer.faults import FaultPlan
from peer.link.coordinator_link import CoordinatorLink, Departed, PeerExit
from swarm.control.client import CoordinatorUnreachable
from swarm.v1 import coordinator_pb2 as pb

pytestmark = pytest.mark.timeout(30)


class GoneClient:
    """A coordinator that answered ``answers`` and is unreachable since."""

    def __init__(self, *answers: pb.RoundInfo) -> None:
        self.answers = list(answers)
        self.calls = 0

    def get_round(self, *, peer_id: str, round_no: int) -> pb.RoundInfo:
        self.calls += 1
        if self.answers:
            return self.answers.pop(0)
        raise CoordinatorUnreachable("cannot reach the coordinator (connection refused)")


def link(client, *, stop=None, give_up_after_s=None) -> CoordinatorLink:
    return CoordinatorLink(
        client,
        stop=stop or threading.Event(),
        faults=FaultPlan(),
        poll_s=0.01,
        leave_grace_s=10.0,
        tag=lambda r: "[p]",
        give_up_after_s=give_up_after_s,
    )


def test_a_coordinator_gone_after_it_said_the_run_finished_is_not_waited_for(monkeypatch):
    monkeypatch.setattr("peer.link.coordinator_calls.FINISHED_RETRY_S", 0.2)
    finished = pb.RoundInfo(round=3, last_committed_round=3, last_committed_hash="ab" * 32, finished=True)
    c = link(GoneClient(finished))
    assert c.round_info(0).finished
    assert c.final == (3, "ab" * 32)
    with pytest.raises(Departed):
        c.round_info(0)
    with pytest.raises(Departed):
        c.holders(3)


def test_a_peer_with_nothing_to_do_gives_up_on_an_unreachable_coordinator_in_one_sentence(caplog):
    c = link(GoneClient(), give_up_after_s=0.3)
    with caplog.at_level(logging.ERROR), pytest.raises(PeerExit) as exited:
        c.round_info(0)
    assert exited.value.code == 1
    [record] = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert "has not answered for" in record.getMessage() and "(get round)" in record.getMessage()


def test_a_stop_ends_the_wait_for_a_decision_within_the_leave_grace_cap(monkeypatch):
    monkeypatch.setattr("peer.link.coordinator_link.STOP_DECISION_WAIT_S", 0.2)
    stop = threading.Event()
    c = CoordinatorLink(
        GoneClient(), stop=stop, faults=FaultPlan(), poll_s=0.01, leave_grace_s=10.0, tag=lambda r: "[p]"
    )
    assert c.leave_grace_s == 0.2  # a leaving peer waits seconds, not the 10 s option
    stop.set()
    with pytest.raises(PeerExit) as exited:
        c.await_decision(2)
    assert exited.value.code == 0


def test_a_stopped_peer_stops_training_the_round():
    stop = threading.Event()
    c = link(GoneClient(), stop=stop)
    assert not c.passed_over(2, None)
    stop.set()
    assert c.passed_over(2, None)
