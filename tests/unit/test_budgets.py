"""Time-budgeted rounds: each participant's inner steps from its measured speed, and participants not
ready by the round's deadline plus report_grace_s left out (pure functions, then the engine on a clock)."""

import dataclasses
import math

import pytest

from coordinator.rounds import budgets, opening, outcome
from coordinator.store import records
from coordinator.store.records import COMMITTED, EXCHANGING, OPEN, TRAINING, ReportRecord, RoundRecord
from swarm.config import RoundConfig
from swarm.v1 import coordinator_pb2 as pb
from tests.unit.test_rounds import FakeClock, make_engine, send

pytestmark = pytest.mark.timeout(20)

H = 12


@pytest.mark.parametrize(
    "step_times, slack_s, expected_steps, expected_budget_s",
    [
        # no measurement yet: everyone does H, no budget, no deadline
        ({}, 0.0, {"a": H, "b": H}, 0.0),
        # equal speeds: H each, the budget is the fastest's H steps
        ({"a": 0.5, "b": 0.5}, 0.0, {"a": H, "b": H}, 6.0),
        # a 3x slower peer does a third
        ({"a": 0.5, "b": 1.5}, 0.0, {"a": H, "b": 4}, 6.0),
        # ... unless it would finish within the slack of the fastest
        ({"a": 0.5, "b": 1.5}, 12.0, {"a": H, "b": H}, 6.0),
        # a peer not measured yet does H; the others are budgeted by the measured fastest
        ({"a": 0.5, "c": 2.0}, 0.0, {"a": H, "b": H, "c": 3}, 6.0),
        # floor, and never below one step
        ({"a": 0.1, "b": 0.7, "c": 0.399}, 0.0, {"a": H, "b": 1, "c": 3}, 1.2),
        # one peer claiming to be 1000x faster is believed down to a quarter of the lower median only
        ({"a": 0.001, "b": 1.0, "c": 1.0, "d": 1.0}, 0.0, {"a": H, "b": 3, "c": 3, "d": 3}, 3.0),
    ],
)
def test_budgets_follow_measured_speeds(step_times, slack_s, expected_steps, expected_budget_s) -> None:
    plan = budgets.plan_budgets(sorted(expected_steps), step_times, full_steps=H, slack_s=slack_s)
    assert {p: b.inner_steps for p, b in plan.budgets.items()} == expected_steps
    assert plan.budget_s == pytest.approx(expected_budget_s)
    assert plan.deadline_s == (pytest.approx(expected_budget_s + slack_s) if expected_budget_s else 0.0)


@pytest.mark.parametrize("h, fastest", [(10, 0.1), (7, 0.3), (50, 0.013), (3, 1e-3)])
def test_the_fastest_peer_always_does_all_its_steps(h: int, fastest: float) -> None:
    plan = budgets.plan_budgets(["a", "b"], {"a": fastest, "b": fastest * 3}, full_steps=h, slack_s=0.0)
    assert plan.budgets["a"].inner_steps == h and plan.budgets["b"].inner_steps == max(1, h // 3)


@pytest.mark.parametrize(
    "times, expected",
    [
        # the demo's three equal peers, probed while the machine was busy starting them: nobody is cut
        ({"a": 0.09, "b": 0.35, "c": 0.09}, {"a": H, "b": H, "c": H}),
        # a device 6x slower (a CPU among GPUs would be 10-100x) is, from its first round
        ({"a": 0.1, "b": 0.6, "c": 0.1}, {"a": H, "b": 2, "c": H}),
    ],
)
def test_a_start_up_probe_cuts_a_peers_steps_only_when_it_is_far_slower(times, expected) -> None:
    plan = budgets.plan_budgets(sorted(times), times, full_steps=H, slack_s=0.0, probed=set(times))
    assert {p: b.inner_steps for p, b in plan.budgets.items()} == expected
    measured = budgets.plan_budgets(sorted(times), times, full_steps=H, slack_s=0.0)  # a round's measurements
    assert measured.budgets["b"].inner_steps < H


def test_a_given_round_time_sets_the_budgets_but_never_more_than_the_full_steps() -> None:
    plan = budgets.plan_budgets(["a", "b"], {"a": 0.5, "b": 1.0}, full_steps=H, slack_s=0.0, budget_s=3.0)
    assert {p: b.inner_steps for p, b in plan.budgets.items()} == {"a": 6, "b": 3}
    plan = budgets.plan_budgets(["a", "b"], {"a": 0.5, "b": 1.0}, full_steps=H, slack_s=0.0, budget_s=100.0)
    assert {p: b.inner_steps for p, b in plan.budgets.items()} == {"a": H, "b": H}


def planned(*participants: str, steps=(H, 4), times=(0.5, 1.5), budget_s=6.0, deadline_s=6.0) -> RoundRecord:
    row = RoundRecord(round=1, opened_at=0.0, participants=participants, outcome=OPEN)
    return (
        RoundRecord(
            round=1,
            opened_at=0.0,
            participants=participants,
            outcome=OPEN,
            budget_s=budget_s,
            deadline_s=deadline_s,
            budgets=steps[: len(participants)],
            step_times_s=times[: len(participants)],
        )
        if budget_s
        else row
    )


def report(peer: str, *, at: float = 7.0, group=("a", "b")) -> ReportRecord:
    return ReportRecord(round=1, peer_id=peer, reported_at=at, ok=True, state_hash="h1", group=group)


# (now, reports, exchanging) -> who is left out; the deadline is 6 s, the grace 2 s: due at 8 s
@pytest.mark.parametrize(
    "now, reported, exchanging, left_out, look_again",
    [
        (7.9, ["a"], [], (), 8.0),  # before the deadline plus grace: nobody
        (8.0, ["a"], [], ("b",), math.inf),  # a reported, b did not: b is left out
        (8.0, [], ["a"], ("b",), math.inf),  # a is exchanging (waiting for b in its group): b is left out
        (8.0, [], ["a", "b"], (), math.inf),  # both are exchanging: nobody
        (8.0, ["a", "b"], [], (), math.inf),  # both reported
        (9.0, [], [], (), 10.0),  # nobody ready: the round waits as before (round_timeout_s), looking again
    ],
)
def test_participants_not_ready_by_the_deadline_plus_grace_are_left_out(
    now, reported, exchanging, left_out, look_again
) -> None:
    row = planned("a", "b")
    after, when = outcome.leave_out(
        now, row, [report(p, group=(p,)) for p in reported], set(exchanging), report_grace_s=2.0
    )
    assert after.left_out == left_out and when == look_again
    assert after.participants == tuple(p for p in row.participants if p not in left_out)
    if not left_out:
        assert dataclasses.replace(after, grace_from=0.0) == row
    else:
        assert after.budgets == (H,) and after.step_times_s == (0.5,)


def test_when_most_participants_are_late_nobody_is_left_out() -> None:
    """A machine that slowed down makes most participants miss the deadline: the one ready first must not
    commit alone and throw the others' work away; a single late one among three is still left out."""
    row = planned("a", "b", "c", steps=(H, H, H), times=(0.5, 0.5, 0.5))
    waiting, when = outcome.leave_out(9.0, row, [report("a", group=("a",))], set(), report_grace_s=2.0)
    assert (waiting.left_out, waiting.participants, when) == ((), row.participants, 10.0)
    after, _ = outcome.leave_out(9.0, row, [report("a", group=("a",))], {"b"}, report_grace_s=2.0)
    assert after.left_out == ("c",)


def test_when_most_were_late_past_the_deadline_the_last_ones_get_the_grace_from_when_more_than_half_are_ready():
    """Start-up probes taken on an idle machine promised 6 s; four peers sharing two cores took 20. Peers as slow as
    the first ones ready (a few seconds behind them) are not left out at once when more than half are ready: the
    grace (2 s) starts then, and only a peer still not ready after it is left out."""
    row = planned("a", "b", "c", steps=(H, H, H), times=(0.5, 0.5, 0.5))
    waiting, when = outcome.leave_out(9.0, row, [], {"a"}, report_grace_s=2.0)
    assert (waiting.left_out, when) == ((), 10.0)  # most are late: the round waits
    assert outcome.leave_out(10.0, waiting, [], {"a"}, report_grace_s=2.0) == (waiting, 11.0)  # unchanged meanwhile
    ready, when = outcome.leave_out(20.0, waiting, [report("a", group=("a",))], {"b"}, report_grace_s=2.0)
    assert (ready.left_out, ready.grace_from, when) == ((), 20.0, 22.0)  # b ready at 20 s: c gets until 22 s
    assert outcome.leave_out(21.9, ready, [report("a", group=("a",))], {"b"}, report_grace_s=2.0) == (ready, 22.0)
    assert outcome.leave_out(21.0, ready, [report("a", group=("a",))], {"b", "c"}, report_grace_s=2.0)[0] is ready
    after, when = outcome.leave_out(22.0, ready, [report("a", group=("a",))], {"b"}, report_grace_s=2.0)
    assert (after.left_out, after.participants, when) == (("c",), ("a", "b"), math.inf)
    assert records.from_json(RoundRecord, records.to_json(waiting)).grace_from == math.inf  # kept across a restart


def test_a_participant_a_report_names_in_its_group_is_not_left_out() -> None:
    """A restarted coordinator hears a's report long after the deadline, while b (a's groupmate in that
    exchange) is still reporting its backlog: b took part, it is not a straggler."""
    row = planned("a", "b")
    assert outcome.leave_out(100.0, row, [report("a", group=("a", "b"))], set(), report_grace_s=2.0) == (row, math.inf)


def test_a_round_without_a_deadline_leaves_nobody_out() -> None:
    row = planned("a", "b", budget_s=0.0)
    assert outcome.leave_out(1e9, row, [report("a")], set(), report_grace_s=2.0) == (row, math.inf)


def test_the_round_commits_without_the_left_out_peer_and_ignores_its_late_report() -> None:
    row, _ = outcome.leave_out(
        8.0,
        planned("a", "b", "c", steps=(H, H, 4), times=(0.5, 0.5, 1.5)),
        [report("a", group=("a", "b"))],
        {"b"},
        report_grace_s=2.0,
    )
    assert row.participants == ("a", "b") and row.left_out == ("c",)
    late = ReportRecord(round=1, peer_id="c", reported_at=9.0, ok=True, state_hash="other", group=("a", "b", "c"))
    reports = [report("a", group=("a", "b")), report("b", group=("a", "b")), late]
    d = outcome.decide_round(9.0, row, {"a", "b", "c"}, reports, 900.0, report_grace_s=2.0)
    assert d.decided and d.round.outcome == COMMITTED and d.round.committed_hash == "h1"
    assert d.joined == ("a", "b") and d.missed == ("c",)


def test_a_left_out_peer_is_not_admitted_back() -> None:
    row = RoundRecord(round=1, opened_at=0.0, participants=("a",), left_out=("c",))
    assert opening.with_late_joiners(row, [], ["a", "b", "c"]).participants == ("a", "b")


def test_a_late_joiner_gets_the_budget_of_the_time_left() -> None:
    row = planned("a", "b")  # budget 6 s from 0
    assert budgets.late_budget(row, 0.5, now=3.0, full_steps=H).inner_steps == 6
    assert budgets.late_budget(row, 0.0, now=3.0, full_steps=H).inner_steps == 6  # unmeasured: as the fastest
    assert budgets.late_budget(row, 1.0, now=5.5, full_steps=H).inner_steps == 1
    assert budgets.late_budget(row, 1.0, now=9.0, full_steps=H).inner_steps == 1


# --- through the engine ---------------------------------------------------------------------------


def beat(engine, peer_id: str, *, step_time_s: float = 0.0, state: int = pb.PEER_STATE_READY, round_no: int = 0):
    return engine.heartbeat(
        pb.HeartbeatRequest(
            peer_id=peer_id,
            metrics=pb.PeerMetrics(
                state=state,
                round=round_no,
                state_round=0,
                state_hash=engine.run.initial_hash,
                step_time_s=step_time_s,
                model_fingerprint=engine.run.model_fingerprint,
                param_count=1000,
                dht_peer_id="dht-" + peer_id,
            ),
        )
    )


@pytest.mark.parametrize("ready_state, ready_round", [(EXCHANGING, 1), (TRAINING, 2)])
def test_the_engine_plans_budgets_and_goes_on_without_a_straggler(ready_state, ready_round) -> None:
    """(TRAINING, 2): with overlap the ready peers already train round 2 while round 1's exchange waits in
    matchmaking for the straggler; they count as ready (they used to look late, and the round waited for it)."""
    from tests.unit.fake_swarm import engine_join

    clock = FakeClock()
    engine = make_engine(clock, min_peers=3, inner_steps=H, report_grace_s=2.0, straggler_slack_s=1.0)
    a, b, c = (engine_join(engine)[0].peer_id for _ in range(3))
    for peer, step in ((a, 0.5), (b, 0.5), (c, 1.5)):
        beat(engine, peer, step_time_s=step)
    info = engine.round_info(a, 0)
    assert info.open_round == 1 and list(info.participants) == [a, b, c]
    assert {p.peer_id: p.inner_steps for p in info.plan.peers} == {a: H, b: H, c: 4}
    assert info.plan.budget_s == pytest.approx(6.0) and info.plan.deadline_s == pytest.approx(7.0)
    clock.now += 7.0
    beat(engine, a, step_time_s=0.5, state=ready_state, round_no=ready_round)
    beat(engine, b, step_time_s=0.5, state=ready_state, round_no=ready_round)
    beat(engine, c, step_time_s=1.5, state=TRAINING, round_no=1)
    assert list(engine.round_info(a, 1).participants) == [a, b, c]  # not yet: the grace runs
    clock.now += 2.0
    info = engine.round_info(a, 1)
    assert list(info.participants) == [a, b] and list(info.plan.left_out) == [c]
    send(engine, a, 1)
    send(engine, b, 1)
    info = engine.round_info(a, 1)
    assert info.outcome == COMMITTED and set(info.holders) == {"dht-" + a, "dht-" + b}
    missed = {p.id: p.rounds_missed for p in engine.status(engine.run.token).peers}
    assert missed == {a: 0, b: 0, c: 1}


def test_a_restarted_coordinator_gives_an_old_round_its_deadline_anew() -> None:
    """The coordinator was down past the round's deadline while the peers decided rounds with their group: it
    counts the deadline from its own start, so nobody is left out for the time it could not see."""
    row = planned("a", "b")  # opened at 0, deadline 6 s, grace 2 s
    reports = [report("a", group=("a",))]
    assert outcome.leave_out(50.0, row, reports, set(), report_grace_s=2.0, not_before=45.0) == (row, 53.0)
    after, _ = outcome.leave_out(53.0, row, reports, set(), report_grace_s=2.0, not_before=45.0)
    assert after.left_out == ("b",)


def test_a_claimed_step_time_at_the_cap_budgets_the_round_no_longer_than_its_timeout() -> None:
    """Step times are what the peers say: one saying 1e10 s a step (the largest a heartbeat may carry), alone in
    its round, would otherwise set a budget and a deadline of 1e11 s, and nobody late would ever be left out."""
    config = RoundConfig(inner_steps=10, round_timeout_s=90.0)
    liar = records.PeerRecord(
        peer_id="x",
        peer_index=0,
        joined_at=0.0,
        last_seen=0.0,
        lease_expiry=60.0,
        state=records.READY,
        metrics=pb.PeerMetrics(step_time_s=1e10),
    )
    planned = budgets.budgeted(RoundRecord(round=1, opened_at=0.0, participants=("x",)), {"x": liar}, config)
    assert planned.budget_s == 90.0 and planned.deadline_s <= 90.0 + config.straggler_slack_s
