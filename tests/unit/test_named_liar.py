"""A liar that reports the moment it is planned, naming honest members in its invented group, every round: it leaves
the plan the others match by, so they do not hold their matchmaking for it until the round's timeout, and the honest
result commits in the same round, round after round (the coordinator's engine, an injected clock)."""

import pytest

from coordinator.store.records import COMMITTED, OPEN
from tests.unit.test_rounds import TIMEOUT_S, FakeClock, beat, join_ready, make_engine, send

pytestmark = pytest.mark.timeout(20)

LIE = "0" * 64


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


def test_a_liar_naming_honest_members_in_its_group_leaves_the_plan_they_match_by(clock: FakeClock) -> None:
    engine = make_engine(clock)
    a, b, c, liar = (join_ready(engine) for _ in range(4))
    assert set(engine.round_info(a, 1).participants) == {a, b, c, liar}
    send(engine, liar, 1, state_hash=LIE, group=[liar, a, b, c])
    assert set(engine.round_info(a, 1).participants) == {a, b, c}  # the plan a, b and c match by
    for peer in (a, b, c):
        send(engine, peer, 1, group=[a, b, c])
    info = engine.round_info(a, 1)
    assert (info.outcome, info.committed_hash) == (COMMITTED, "h1")
    assert sorted(info.holders) == sorted("dht-" + p for p in (a, b, c))
    assert clock.now < 1_000.0 + TIMEOUT_S  # decided by the reports, not by the round's timeout
    decided = engine._store.get_round(1)
    assert "3 of 3 group members (4 planned participants in the round) agree on h1; 1 reported other" in decided.reason
    assert set(decided.participants) == {a, b, c, liar}  # as the history shows it: every participant that reported


def test_an_honest_member_reporting_first_leaves_the_plan_and_still_holds_the_committed_state(clock: FakeClock) -> None:
    engine = make_engine(clock)
    a, b, c = (join_ready(engine) for _ in range(3))
    send(engine, a, 1, group=[a, b, c])  # the fastest of the group: b and c had sent it their contributions
    assert set(engine.round_info(b, 1).participants) == {b, c}
    assert engine.round_info(b, 1).outcome == OPEN
    send(engine, b, 1, group=[a, b, c])
    send(engine, c, 1, group=[a, b, c])
    info = engine.round_info(a, 1)
    assert (info.outcome, info.committed_hash) == (COMMITTED, "h1")
    assert sorted(info.holders) == sorted("dht-" + p for p in (a, b, c))


def test_a_liar_naming_the_honest_members_every_round_never_stalls_the_run(clock: FakeClock) -> None:
    """The liar reports first in every round it is planned into, with a group of itself and every other participant;
    each round commits the honest hash with the honest members as holders, none waits for the round's timeout."""
    engine = make_engine(clock, max_rounds=6)
    honest = [join_ready(engine) for _ in range(3)]
    liar = join_ready(engine)
    for number in range(1, 7):
        opened = engine.round_info(honest[0], number)
        assert opened.outcome == OPEN and liar in opened.participants, f"round {number}: the liar is planned"
        send(engine, liar, number, state_hash=LIE, group=[liar, *honest])
        assert liar not in engine.round_info(honest[0], number).participants
        for peer in honest:
            send(engine, peer, number, state_hash=f"h{number}", group=honest)
        info = engine.round_info(honest[0], number)
        assert (info.outcome, info.committed_hash) == (COMMITTED, f"h{number}"), engine._store.get_round(number).reason
        assert sorted(info.holders) == sorted("dht-" + p for p in honest)
        clock.now += 1.0
        for peer in honest:
            beat(engine, peer, number, f"h{number}")
        beat(engine, liar, number, f"h{number}")  # it claims to hold the committed state: planned again
        engine.tick()
    run = engine.status(engine.run.token).run
    assert (run.rounds_committed, run.rounds_voided, run.finished) == (6, 0, True)
    assert clock.now < 1_000.0 + TIMEOUT_S


def test_attackers_tying_the_honest_group_void_the_round_as_a_tie_and_the_honest_result_commits_once_they_leave(
    clock: FakeClock,
) -> None:
    """Two identities report the smallest hash with a group of both, as the round opens: the same support as the
    honest pair's hash. The honest pair matches without them (they reported), the round voids as a tie, and once the
    attackers leave the next round commits the honest result."""
    engine = make_engine(clock, max_rounds=2)
    a, b, x, y = (join_ready(engine) for _ in range(4))
    for attacker in (x, y):
        send(engine, attacker, 1, state_hash=LIE, group=[x, y])
    assert set(engine.round_info(a, 1).participants) == {a, b}
    for peer in (a, b):
        send(engine, peer, 1, group=[a, b])
    info = engine.round_info(a, 1)
    assert info.outcome != COMMITTED and not info.committed_hash
    assert engine._store.get_round(1).reason.startswith("voided: a tie: 2 hashes or groups reported by 2 members each")
    for attacker in (x, y):
        engine.leave(attacker, "the attack is over")
    for peer in (a, b):
        beat(engine, peer)
    engine.tick()
    assert set(engine.round_info(a, 2).participants) == {a, b}
    for peer in (a, b):
        send(engine, peer, 2, state_hash="h2", group=[a, b])
    info = engine.round_info(a, 2)
    assert (info.outcome, info.committed_hash) == (COMMITTED, "h2")
    assert clock.now < 1_000.0 + TIMEOUT_S
