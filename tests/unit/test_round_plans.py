"""The peer's plan cache (``peer.link.round_plans``): what the coordinator said about the rounds, kept consistent while
the main thread and the round runner's executor both feed it."""

from __future__ import annotations

import threading

import pytest

from peer.link.round_plans import MAX_CHOICES_KEPT, RoundPlans
from swarm.v1 import coordinator_pb2 as pb

pytestmark = [pytest.mark.timeout(30)]


def _plans() -> RoundPlans:
    return RoundPlans(tag=lambda round_no=None: "[p]")


def _open(round_no: int, participants: list[str], dht_ids: list[str]) -> pb.RoundInfo:
    return pb.RoundInfo(
        round=round_no,
        open_round=round_no,
        outcome=pb.ROUND_OUTCOME_OPEN,
        participants=participants,
        participant_dht_ids=dht_ids,
    )


def test_a_rounds_first_choice_holds_and_only_the_latest_rounds_are_kept() -> None:
    plans = _plans()
    plans.remember(pb.RoundInfo(round=1, choice=pb.RoundChoice(inner_steps=10)), 1)
    plans.remember(pb.RoundInfo(round=1, choice=pb.RoundChoice(inner_steps=99)), 1)
    assert plans.choice(1).inner_steps == 10  # a round's choice never changes
    for r in range(2, 2 + MAX_CHOICES_KEPT):
        plans.remember(pb.RoundInfo(round=r, choice=pb.RoundChoice(inner_steps=r)), r)
    assert not plans.knows_choice(1) and plans.choice(1 + MAX_CHOICES_KEPT).inner_steps == 1 + MAX_CHOICES_KEPT


def test_a_budget_is_this_peers_share_of_the_plan_capped_at_a_full_speed_round() -> None:
    plans = _plans()
    plan = pb.RoundPlan(
        peers=[pb.PlannedPeer(peer_id="p-slow", inner_steps=3), pb.PlannedPeer(peer_id="p-x", inner_steps=50)]
    )
    plans.remember(pb.RoundInfo(round=4, plan=plan), 4)
    assert plans.budget(4, plans.plan(4), "p-slow", (2, 10)) == (2, 3)
    assert plans.budget(4, plans.plan(4), "p-x", (2, 10)) == (2, 10)
    assert plans.budget(4, plans.plan(4), "p-unplanned", (2, 10)) == (2, 10)
    plans.remember(pb.RoundInfo(round=7, plan=plan), 7)
    assert plans.plan(4) is None and plans.plan(7) is not None  # only the latest rounds' plans are kept


def test_while_the_coordinator_does_not_answer_the_last_group_is_the_plan() -> None:
    plans = _plans()
    assert plans.planned(3, _open(3, ["a", "b"], ["A", "B"])) == {"a", "b"}
    assert plans.plan_open and plans.processes() == {"a": "A", "b": "B"}
    assert plans.planned(4, None) == {"a", "b"}
    assert not plans.plan_open and plans.processes() == {}  # the processes are unknown without an answer


def test_the_run_finished_is_remembered_with_its_final_state() -> None:
    plans = _plans()
    plans.heard(
        pb.RoundInfo(round=5, finished=True, last_committed_round=5, last_committed_hash="ab", poll_interval_s=2)
    )
    assert plans.final == (5, "ab") and plans.paced_poll_s == 2.0


def test_two_threads_feeding_the_cache_leave_it_consistent() -> None:
    """The executor plans rounds while the main thread polls: every answer lands, none is lost or torn."""
    plans, errors = _plans(), []

    def feed(first: int) -> None:
        try:
            for r in range(first, first + 400, 2):
                plans.remember(pb.RoundInfo(round=r, choice=pb.RoundChoice(inner_steps=r), plan=pb.RoundPlan()), r)
                plans.planned(r, _open(r, [f"p{r}"], [f"d{r}"]))
                assert len(plans.processes()) <= 1  # one answer's processes, never a mix
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=feed, args=(start,)) for start in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert sorted(r for r in range(390, 401) if plans.knows_choice(r)) == list(range(401 - MAX_CHOICES_KEPT, 401))
