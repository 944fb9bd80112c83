"""The peer's lifecycle table (peer.lifecycle): which event a pass runs, and where each event leads."""

from __future__ import annotations

import inspect
import logging

import pytest

from peer import daemon, joining, lifecycle
from peer.lifecycle import TRANSITIONS, BadTransition, Event, PeerState, View, after, next_event
from swarm.v1 import coordinator_pb2 as pb

pytestmark = [pytest.mark.timeout(30)]

S, E = PeerState, Event


def info(**fields) -> pb.RoundInfo:
    return pb.RoundInfo(**fields)


@pytest.mark.parametrize(
    "view, event",
    [
        (View(rejected=True, carrying=True, info=info(finished=True)), E.REJECTED),  # a refusal ends everything
        (View(carrying=True, info=None), E.CARRIED),  # a round in flight trains on, reachable or not
        (View(info=None, offline_next=3), E.GROUP_GOES_ON),
        (View(info=None, offline_next=3, final_known=True), E.COORDINATOR_DOWN),  # the run is over: no round alone
        (View(info=None), E.COORDINATOR_DOWN),
        (View(info=info(last_committed_round=5, finished=True), backlog=True, held_round=1), E.BACKLOG),
        (View(info=info(last_committed_round=2), held_round=1), E.BEHIND),
        (View(info=info(last_committed_round=1), held_round=1, behind=True), E.BEHIND),  # its group was contradicted
        (View(info=info(last_committed_round=4, finished=True), held_round=4), E.FINISHED),
        (
            View(
                info=info(open_round=3, round=3, participants=["me"], last_committed_round=2),
                held_round=2,
                peer_id="me",
            ),
            E.PLANNED,
        ),
        (
            View(
                info=info(open_round=3, round=3, participants=["other"], last_committed_round=2),
                held_round=2,
                peer_id="me",
            ),
            E.UNPLANNED,
        ),
        # an answer about another round than the open one
        (
            View(
                info=info(open_round=3, round=2, participants=["me"], last_committed_round=2),
                held_round=2,
                peer_id="me",
            ),
            E.UNPLANNED,
        ),
    ],
)
def test_a_pass_runs_the_first_event_in_precedence_order(view: View, event: Event) -> None:
    assert next_event(view) is event


def walk(state: PeerState, *events: Event, offline: bool = False) -> list[PeerState]:
    seen = []
    for event in events:
        state = after(state, event, offline=offline)
        seen.append(state)
    return seen


def test_a_round_goes_training_exchanging_deciding_ready_and_offline_decides_without_the_coordinator() -> None:
    round_trip = (E.PLANNED, E.EXCHANGE, E.DECIDE, E.ROUND_ENDED)
    assert walk(S.READY, *round_trip) == [S.TRAINING, S.EXCHANGING, S.DECIDING, S.READY]
    assert walk(S.READY, E.GROUP_GOES_ON, E.EXCHANGE, E.DECIDE, E.ROUND_ENDED, offline=True) == [
        S.TRAINING,
        S.EXCHANGING,
        S.OFFLINE_DECIDING,
        S.READY,
    ]
    # with overlap the next round trains while the carried one is decided
    assert walk(S.EXCHANGING, E.CARRIED, E.DECIDE, E.EXCHANGE) == [S.TRAINING, S.DECIDING, S.EXCHANGING]


def test_joining_syncs_then_waits_and_the_end_is_finishing_or_leaving() -> None:
    assert walk(S.JOINING, E.BEHIND, E.UNPLANNED, E.FINISHED) == [S.SYNCING, S.READY, S.FINISHING]
    assert walk(S.SYNCING, E.SYNC_FAILED_AT_END) == [S.LEAVING]
    assert all(after(s, E.STOP) is S.LEAVING for s in PeerState)
    assert {to for (s, _), to in TRANSITIONS.items() if s is S.LEAVING} == {S.LEAVING}  # nothing comes back
    assert {(s, e) for (s, e) in TRANSITIONS if s in (S.FINISHING, S.LEAVING)} == {
        (S.FINISHING, E.STOP),
        (S.LEAVING, E.STOP),
    }


def test_waiting_or_reporting_a_backlog_changes_nothing_the_coordinator_sees() -> None:
    for state in (S.READY, S.SYNCING, S.DECIDING, S.OFFLINE_DECIDING):
        assert after(state, E.COORDINATOR_DOWN) is state and after(state, E.BACKLOG) is state


def test_a_pair_the_table_lacks_is_a_bug_raised_in_tests_and_logged_in_a_running_peer(caplog) -> None:
    with pytest.raises(BadTransition, match="no transition from READY on EXCHANGE"):
        after(S.READY, E.EXCHANGE)
    with caplog.at_level(logging.ERROR, logger=lifecycle.__name__):
        assert after(S.READY, E.EXCHANGE, strict=False) is S.EXCHANGING
        assert after(S.FINISHING, E.PLANNED, strict=False) is S.TRAINING
    assert len(caplog.records) == 2


def test_every_state_but_the_ends_is_left_by_some_event_and_every_wire_state_is_reachable() -> None:
    leaving = {s for (s, _), to in TRANSITIONS.items() if to is not s}
    assert leaving == set(PeerState) - {S.LEAVING}
    reachable = {to for to in TRANSITIONS.values()} | {S.JOINING}
    assert reachable == set(PeerState)


def test_the_daemon_changes_state_only_through_the_table() -> None:
    source = inspect.getsource(daemon) + inspect.getsource(joining)  # the start is the daemon's too
    assert "enter(PeerState." not in source and "self.state = PeerState." not in source.replace(
        "self.state = PeerState.JOINING", ""
    )
    assert "PeerState(" not in source  # no state made from a name
