"""Rounds: when they open, who takes part, how they are decided; pure functions and an injected clock."""

import pytest

from coordinator.api.errors import PeerGone
from coordinator.engine import CoordinatorEngine
from coordinator.rounds import opening, outcome
from coordinator.store.database import Store
from coordinator.store.records import COMMITTED, OPEN, READY, VOIDED, ReportRecord, RoundRecord
from swarm.config import RoundConfig, RunConfig
from swarm.control.signing import CallProof, CallSigner
from swarm.core.trust.credential import PeerKey
from swarm.v1 import coordinator_pb2 as pb
from tests.unit.fake_swarm import engine_join

pytestmark = pytest.mark.timeout(20)

TIMEOUT_S = 100.0
LEASE_S = 10.0


def report(
    peer: str,
    state_hash: str = "h1",
    ok: bool = True,
    *,
    group: tuple[str, ...] = ("a", "b"),
    at: float = 0.0,
    **fields: object,
) -> ReportRecord:
    """A report of round 1 by ``peer``, which averaged with ``group`` (the reporter included)."""
    return ReportRecord(round=1, peer_id=peer, reported_at=at, ok=ok, state_hash=state_hash, group=group, **fields)


def open_round(*participants: str) -> RoundRecord:
    return RoundRecord(round=1, opened_at=0.0, participants=participants)


def decide(
    participants: str, reports: list[ReportRecord], *, now: float = 1.0, alive: str | None = None, grace_s: float = 10.0
) -> outcome.Decision:
    return outcome.decide_round(
        now,
        open_round(*participants),
        set(participants if alive is None else alive),
        reports,
        TIMEOUT_S,
        report_grace_s=grace_s,
    )


# --- decide_round ---------------------------------------------------------------------------------


def test_all_identical_hashes_commit() -> None:
    d = decide("ab", [report("a"), report("b")])
    assert d.decided and d.round.outcome == COMMITTED and d.round.committed_hash == "h1"
    assert d.round.holders == ("a", "b") and d.joined == ("a", "b") and d.missed == ()
    assert "committed: 2 of 2 group members agree on h1" in d.reason and "all 2 participants reported" in d.reason


def test_majority_hash_wins_and_dissenters_miss_the_round() -> None:
    abc = ("a", "b", "c")
    d = decide("abc", [report("a", group=abc), report("b", "bad", group=abc), report("c", group=abc)])
    assert d.round.committed_hash == "h1" and d.round.holders == ("a", "c") and d.missed == ("b",)


def test_two_members_that_disagree_void_the_round() -> None:
    d = decide("ab", [report("a", "hz"), report("b", "ha")])
    assert d.round.outcome == VOIDED and d.missed == ("a", "b")
    assert "a tie: 2 hashes or groups reported by 1 members each" in d.reason


def test_all_failed_voids_the_round() -> None:
    reports = [report("a", "", ok=False, error="exchange timed out"), report("b", "h1", ok=False)]
    d = decide("ab", reports)
    assert d.decided and d.round.outcome == VOIDED and d.round.committed_hash == ""
    assert d.missed == ("a", "b") and d.ddp_equivalent_bytes == 0


@pytest.mark.parametrize("size, needed", [(1, 1), (2, 2), (3, 2), (4, 3), (5, 3)])
def test_a_hash_commits_with_a_strict_majority_of_its_group_and_at_least_two(size: int, needed: int) -> None:
    group = tuple("abcde"[:size])
    if needed > 1:
        short = decide(group, [report(p, group=group) for p in group[: needed - 1]], alive=group[: needed - 1])
        assert short.round.outcome == VOIDED and f"reported by {needed - 1} of {size} group members" in short.reason
    enough = decide(group, [report(p, group=group) for p in group[:needed]], alive=group[:needed])
    assert enough.round.outcome == COMMITTED and enough.round.holders == group[:needed]
    assert f"committed: {needed} of {size} group members agree on h1" in enough.reason


def test_fakes_reporting_groups_of_their_own_do_not_outvote_the_honest_group() -> None:
    honest, fakes = ("a", "b", "c"), ("x", "y")
    reports = [report(p, group=honest) for p in honest] + [report(f, "ffff", group=(f,)) for f in fakes]
    d = decide(honest + fakes, reports)
    assert (d.round.committed_hash, d.round.holders) == ("h1", honest)
    assert set(d.missed) == set(fakes)


def test_a_minority_group_of_the_plan_does_not_commit_even_when_the_others_are_fakes() -> None:
    """Three fakes in groups of their own and an honest two of the five planned: nobody has a majority of the
    plan, so the round is void rather than committed for two."""
    honest, fakes = ("a", "b"), ("x", "y", "z")
    reports = [report("a"), report("b")] + [report(f, "ffff", group=(f,)) for f in fakes]
    d = decide(honest + fakes, reports)
    assert d.round.outcome == VOIDED and "no quorum (needs 3)" in d.reason


def test_a_lone_fake_reporting_first_is_no_quorum_and_the_honest_majority_reporting_later_commits() -> None:
    """One identity reports an invented hash with a group of itself as the round opens: a group of one when
    others were planned with it is one vote of the plan, so no grace starts and the honest pair wins later."""
    planned = ("a", "b", "x")
    early = decide("abx", [report("x", "0000", group=("x",), at=0.0)], now=30.0)
    assert not early.decided and early.wait_until == TIMEOUT_S  # no quorum: no grace is running
    later = [report("x", "0000", group=("x",), at=0.0), report("a", at=40.0), report("b", at=41.0)]
    d = decide(planned, later, now=41.0)
    assert (d.round.outcome, d.round.committed_hash, d.round.holders) == (COMMITTED, "h1", ("a", "b"))


def test_a_tie_voids_the_round_with_the_reason_whatever_the_hashes() -> None:
    for fake in ("0000", "ffff"):
        one = decide("ax", [report("a", group=("a", "x")), report("x", fake, group=("a", "x"))])
        assert one.round.outcome == VOIDED and "a tie" in one.reason
        two = decide(
            "abxy",
            [report(p, group=tuple("abxy")) for p in "ab"] + [report(p, fake, group=tuple("abxy")) for p in "xy"],
        )
        assert two.round.outcome == VOIDED and "a tie" in two.reason and "reported by 2 members each" in two.reason


def test_a_group_naming_peers_outside_the_round_does_not_count() -> None:
    honest = ("a", "b", "c")
    invented = ("x", "y", "z", "strangerA", "strangerB")
    reports = [report("a", group=honest), report("b", group=honest)]
    reports += [report("x", "ffff", group=invented)]  # were its group real, it would count
    d = decide(honest + ("x",), reports, now=20.0, alive="abx")  # c is gone: decided after the grace
    assert (d.round.committed_hash, d.round.holders) == ("h1", ("a", "b"))  # 2 of the 3 standing
    assert "1 reports ignored" in d.reason


def test_a_report_whose_group_lacks_the_reporter_neither_votes_nor_holds() -> None:
    group = ("a", "b", "c")
    reports = [report("a", group=group), report("b", group=group), report("x", group=group)]
    d = decide("abcx", reports, alive="abx")
    assert d.round.holders == ("a", "b") and "x" in d.missed


def test_a_lone_fake_cannot_commit_against_a_group_that_names_it() -> None:
    group = ("a", "b", "x")
    d = decide("abx", [report("a", group=group), report("b", group=group), report("x", "ffff", group=("x",))])
    assert (d.round.committed_hash, d.round.holders) == ("h1", ("a", "b"))


def test_waits_for_a_live_participant_until_the_timeout_without_a_quorum() -> None:
    abc = ("a", "b", "c")
    reports = [report("a", group=abc)]
    assert not decide("abc", reports, now=TIMEOUT_S - 1).decided
    timed_out = decide("abc", reports, now=TIMEOUT_S)
    assert timed_out.round.outcome == VOIDED and "did not report within 100s" in timed_out.reason


def test_a_quorum_waits_only_the_grace_for_the_rest_of_its_group() -> None:
    abc = ("a", "b", "c")
    reports = [report("a", group=abc, at=5.0), report("b", group=abc, at=7.0)]  # quorum at 7
    assert not decide("abc", reports, now=16.9).decided
    d = decide("abc", reports, now=17.0)
    assert d.round.outcome == COMMITTED and d.round.holders == ("a", "b") and d.missed == ("c",)
    assert "1 participants did not report within 10s of a quorum" in d.reason
    everyone = decide("abc", reports + [report("c", group=abc, at=8.0)], now=8.0)
    assert everyone.decided and everyone.round.holders == abc  # no need to wait once all reported


def test_a_gone_participant_is_not_waited_for() -> None:
    d = decide("ab", [report("a", group=("a",))], alive="a")
    assert d.decided and d.round.holders == ("a",) and d.missed == ("b",)


def test_reports_from_non_participants_do_not_vote() -> None:
    reports = [
        report("a", "h1", group=("a",)),
        report("x", "h2", group=("x", "y")),
        report("y", "h2", group=("x", "y")),
    ]
    d = decide("a", reports)
    assert d.round.committed_hash == "h1"


def test_the_offline_rule_is_the_coordinators_rule() -> None:
    """A group deciding from its DHT votes (coordinator down) decides what the coordinator does on the
    same reports."""
    from swarm.net.votes import Vote, group_decision

    cases = [
        {"a": "h1", "b": "h1", "c": "h2"},
        {"a": "h1", "b": "h2"},
        {"a": "h1"},
        {"a": "h1", "b": ""},
        {"a": "h1", "b": "h1", "c": "h2", "d": "h2"},
        {"a": "h2", "b": "h2", "c": "h2", "d": "h1"},
        {"a": "", "b": "", "c": "h1"},
    ]
    for hashes in cases:
        group = tuple(sorted(hashes))
        votes = {p: Vote(peer_id=p, dht_peer_id="dht-" + p, ok=bool(h), state_hash=h) for p, h in hashes.items()}
        online = decide(group, [report(p, h, ok=bool(h), group=group) for p, h in hashes.items()])
        assert group_decision(votes) == (online.round.committed_hash or None), hashes
        for extra in ("x", "xy"):  # planned with peers outside the group, alive and silent: the same quorum
            planned = group + tuple(extra)
            online = decide(planned, [report(p, h, ok=bool(h), group=group) for p, h in hashes.items()], now=1e9)
            assert group_decision(votes, set(planned)) == (online.round.committed_hash or None), (hashes, extra)


def test_mean_loss_of_the_round() -> None:
    reports = [report("a", loss=2.0), report("b", loss=4.0)]
    d = decide("ab", reports)
    assert d.round.mean_loss == 3.0


def test_ddp_equivalent_bytes() -> None:
    # K = 3 holders: each inner step of data-parallel training sends 2(K-1)/K * 4 bytes per parameter.
    abc = ("a", "b", "c")
    holders = [
        report(p, inner_steps=steps, param_count=300, group=abc) for p, steps in (("a", 10), ("b", 20), ("c", 30))
    ]
    assert outcome.ddp_equivalent_bytes(holders) == round(60 * (4 / 3) * 4 * 300)
    assert outcome.ddp_equivalent_bytes(holders[:1]) == 0  # one peer sends nothing
    without_count = [report("a", inner_steps=5), report("b", inner_steps=5)]
    assert outcome.ddp_equivalent_bytes(without_count, param_count=1000) == 10 * 1 * 4 * 1000
    d = decide("abc", holders)
    assert d.ddp_equivalent_bytes == round(60 * (4 / 3) * 4 * 300)


def test_plan_needs_min_peers_for_round_one_only() -> None:
    assert opening.new_round(now=0.0, round_number=1, ready=["a"], min_peers=2)[0] is None
    planned, _ = opening.new_round(now=0.0, round_number=1, ready=["a", "b"], min_peers=2)
    assert planned.participants == ("a", "b") and planned.outcome == OPEN
    later, _ = opening.new_round(now=0.0, round_number=5, ready=["b"], carried=["a", "b"], min_peers=2)
    assert later.participants == ("a", "b")
    assert opening.new_round(now=0.0, round_number=5, ready=[], min_peers=2)[0] is None


def test_late_admission_only_before_the_first_report() -> None:
    row = open_round("a")
    assert opening.with_late_joiners(row, [], ["a", "b"]).participants == ("a", "b")
    assert opening.with_late_joiners(row, [report("a")], ["a", "b"]).participants == ("a",)
    assert opening.with_late_joiners(row, [], ["a", "b"], exchange_started=True).participants == ("a",)


# --- through the engine ---------------------------------------------------------------------------


class FakeClock:
    def __init__(self) -> None:
        self.now = 1_000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


def make_engine(clock: FakeClock, **round_fields: object) -> CoordinatorEngine:
    config = RunConfig(rounds=RoundConfig(round_timeout_s=TIMEOUT_S, **round_fields))
    return CoordinatorEngine(Store(":memory:"), config=config, lease_s=LEASE_S, clock=clock)


def join_ready(engine: CoordinatorEngine, state_round: int = 0, state_hash: str = "h0") -> str:
    peer, _ = engine_join(engine)
    beat(engine, peer.peer_id, state_round, state_hash)
    return peer.peer_id


def beat(engine: CoordinatorEngine, peer_id: str, state_round: int = 0, state_hash: str = "h0") -> pb.RoundInfo:
    """A ready peer's heartbeat; "h0" stands for the run's θ0 hash (the coordinator derives it from the config)."""
    return engine.heartbeat(
        pb.HeartbeatRequest(
            peer_id=peer_id,
            metrics=pb.PeerMetrics(
                state=READY,
                state_round=state_round,
                state_hash=_h0(engine, state_hash),
                model_fingerprint=engine.run.model_fingerprint,
                param_count=1000,
                dht_peer_id="dht-" + peer_id,
            ),
        )
    )


def _h0(engine: CoordinatorEngine, state_hash: str) -> str:
    return engine.run.initial_hash if state_hash == "h0" else state_hash


def send(
    engine: CoordinatorEngine,
    peer_id: str,
    number: int,
    state_hash: str = "h1",
    ok: bool = True,
    group: list[str] | None = None,
) -> pb.RoundInfo:
    """Report round ``number``, averaged (by default) with every live participant the coordinator planned."""
    if group is None:  # the plan the group was matched by: participants that reported first have left it since
        info = engine.round_info(peer_id, number)
        reported = {r.peer_id for r in engine._state.reports.by_peer_id()}
        group = [*info.participants, *(p for p in info.plan.left_out if p in reported)]
    return engine.report(
        pb.ReportRoundRequest(
            peer_id=peer_id, round=number, ok=ok, state_hash=state_hash, inner_steps=10, loss=2.0, group=group
        )
    )


def test_round_one_opens_at_min_peers_and_admits_late_peers(clock: FakeClock) -> None:
    engine = make_engine(clock, min_peers=2)
    a = join_ready(engine)
    assert engine.round_info(a, 0).open_round == 0  # one ready peer is not enough
    b = join_ready(engine)
    info = engine.round_info(a, 0)
    assert (info.round, info.outcome, list(info.participants)) == (1, OPEN, [a, b])
    assert list(info.holders) == ["dht-" + a, "dht-" + b]  # they hold round 0's state
    c = join_ready(engine)  # ready before any report: joins round 1
    assert list(engine.round_info(a, 1).participants) == [a, b, c]
    send(engine, a, 1)
    d = join_ready(engine)  # too late for round 1
    assert d not in engine.round_info(a, 1).participants


def test_late_admission_closes_once_a_participant_exchanges(clock: FakeClock) -> None:
    engine = make_engine(clock)
    a = join_ready(engine)
    engine.heartbeat(
        pb.HeartbeatRequest(
            peer_id=a,
            metrics=pb.PeerMetrics(
                state=pb.PEER_STATE_EXCHANGING,
                round=1,
                state_round=0,
                state_hash=engine.run.initial_hash,
                model_fingerprint=engine.run.model_fingerprint,
            ),
        )
    )
    b = join_ready(engine)
    assert list(engine.round_info(a, 1).participants) == [a]
    assert b not in engine.round_info(b, 1).participants


def test_commit_opens_the_next_round_with_the_holders(clock: FakeClock) -> None:
    engine = make_engine(clock)
    a, b, c = join_ready(engine), join_ready(engine), join_ready(engine)
    send(engine, a, 1)
    send(engine, b, 1)
    info = send(engine, c, 1, state_hash="diverged")
    assert (info.round, info.outcome, info.last_committed_round, info.last_committed_hash) == (2, OPEN, 1, "h1")
    assert list(info.participants) == [a, b]  # c must resync before it is ready again
    committed = engine.round_info(a, 1)
    assert (committed.outcome, committed.committed_hash) == (COMMITTED, "h1")
    assert list(committed.holders) == ["dht-" + a, "dht-" + b]
    beat(engine, c, state_round=1, state_hash="h1")  # resynced before round 2's first report
    assert list(engine.round_info(a, 2).participants) == [a, b, c]
    status = engine.status(engine.run.token)
    assert {p.id: (p.rounds_joined, p.rounds_missed) for p in status.peers} == {a: (1, 0), b: (1, 0), c: (0, 1)}
    assert status.totals.ddp_equivalent_bytes == 2 * 10 * 1 * 4 * engine.run.param_count  # from the config
    assert status.run.loss == 2.0 and status.run.rounds_committed == 1


def test_peers_that_resumed_the_committed_state_are_its_holders_after_its_voters_die(clock: FakeClock) -> None:
    engine = make_engine(clock)
    a, b = join_ready(engine), join_ready(engine)
    send(engine, a, 1)
    send(engine, b, 1)
    c = join_ready(engine)  # restarted, still holding round 0
    engine.leave(a, "killed")
    engine.leave(b, "killed")
    assert list(engine.round_info(c, 1).holders) == []  # every voter of round 1 is gone
    beat(engine, c, state_round=1, state_hash="h1")  # c resumed round 1 from its vote
    assert list(engine.round_info(c, 1).holders) == ["dht-" + c]


def test_report_for_a_decided_round_returns_its_outcome(clock: FakeClock) -> None:
    engine = make_engine(clock)
    a = join_ready(engine)
    send(engine, a, 1)
    again = send(engine, a, 1, state_hash="changed-mind")  # duplicate: the first report stands
    assert (again.round, again.outcome, again.committed_hash) == (1, COMMITTED, "h1")
    early = send(engine, a, 7)
    assert (early.round, early.outcome, early.open_round) == (7, pb.ROUND_OUTCOME_UNSPECIFIED, 2)


def test_timeout_voids_a_lone_report_while_the_silent_participant_is_alive(clock: FakeClock) -> None:
    engine = make_engine(clock)
    a, b = join_ready(engine), join_ready(engine)
    send(engine, a, 1, group=[a])  # b never came to the exchange: a averaged alone
    for _ in range(int(TIMEOUT_S // 5)):  # b keeps its lease but never reports
        clock.now += 5
        beat(engine, a)
        beat(engine, b)
    engine.tick()
    info = engine.round_info(a, 1)
    assert info.outcome == VOIDED  # a lone report where two were planned and both are alive is no quorum
    assert "no quorum (needs 2)" in engine._store.get_round(1).reason


def test_a_participant_reporting_a_round_of_its_own_leaves_the_plan_the_others_match_by(clock: FakeClock) -> None:
    """It will never post to their group: were it still planned, they would hold their matchmaking for it until
    the round's timeout, which then voids the round. Its report stays counted, as one vote of the plan."""
    engine = make_engine(clock)
    a, b, x = join_ready(engine), join_ready(engine), join_ready(engine)
    assert set(engine.round_info(a, 1).participants) == {a, b, x}
    send(engine, x, 1, state_hash="0" * 64, group=[x])
    assert set(engine.round_info(a, 1).participants) == {a, b}  # the plan a and b match by
    send(engine, a, 1, group=[a, b])
    send(engine, b, 1, group=[a, b])
    info = engine.round_info(a, 1)
    assert (info.outcome, info.committed_hash, sorted(info.holders)) == (
        COMMITTED,
        "h1",
        sorted(["dht-" + a, "dht-" + b]),
    )
    assert "2 of 2 group members (3 planned participants in the round)" in engine._store.get_round(1).reason


def test_evicted_participant_is_not_waited_for(clock: FakeClock) -> None:
    engine = make_engine(clock, report_grace_s=TIMEOUT_S)
    a, _b = join_ready(engine), join_ready(engine)
    send(engine, a, 1, group=[a])
    assert engine.round_info(a, 1).outcome == OPEN
    for _ in range(2):  # _b goes silent for longer than its lease while a keeps beating
        clock.now += 0.6 * LEASE_S
        beat(engine, a)
    engine.tick()
    info = engine.round_info(a, 1)
    assert (info.outcome, list(info.holders)) == (COMMITTED, ["dht-" + a])
    assert clock.now < 1_000.0 + TIMEOUT_S  # decided by the eviction, not by the round timeout


def test_void_keeps_the_previous_state_and_opens_the_next_round(clock: FakeClock) -> None:
    engine = make_engine(clock)
    a = join_ready(engine)
    info = send(engine, a, 1, state_hash="", ok=False)
    assert (info.round, info.last_committed_round, info.last_committed_hash) == (2, 0, engine.run.initial_hash)
    assert engine.round_info(a, 1).outcome == VOIDED
    assert engine.status(engine.run.token).run.rounds_voided == 1


def test_max_rounds_finishes_the_run(clock: FakeClock) -> None:
    engine = make_engine(clock, max_rounds=2)
    a = join_ready(engine)
    send(engine, a, 1)
    beat(engine, a, 1, "h1")
    info = send(engine, a, 2, state_hash="h2")
    assert info.finished and info.open_round == 0 and info.round == 2 and info.outcome == COMMITTED
    beat(engine, a, 2, "h2")
    engine.tick()
    assert engine.status(engine.run.token).run.open_round == 0  # no round 3
    assert not engine.done()  # waits for the last participant to leave
    engine.leave(a, "run finished")
    assert engine.done()


def test_finished_run_stops_waiting_for_goodbyes_after_the_linger(clock: FakeClock) -> None:
    engine = make_engine(clock, max_rounds=1)
    a = join_ready(engine)
    send(engine, a, 1)
    assert not engine.done(linger_s=20)
    clock.now += 20
    assert engine.done(linger_s=20)


def test_a_restarted_peer_keeps_its_id_and_index_and_its_old_process_is_refused(clock: FakeClock) -> None:
    engine = make_engine(clock)
    key = PeerKey.generate()
    join_ready(engine)
    before, _ = engine_join(engine, key=key)
    restarted, _ = engine_join(engine, key=key)  # the same state dir, hence the same key
    stranger, _ = engine_join(engine)
    assert restarted.peer_id == before.peer_id and restarted.peer_index == 1 and stranger.peer_index == 2
    assert restarted.session == before.session + 1
    old_call = pb.GetRoundRequest(peer_id=key.peer_id)
    metadata = CallSigner(key, before.session).metadata("GetRound", old_call, now=clock.now)
    with pytest.raises(PeerGone, match="another process joined with its state dir .* own --state-dir"):
        engine.authenticate(CallProof.from_metadata("GetRound", metadata, old_call), key.peer_id)


def test_round_info_counts_the_live_peers_ready_or_not_and_those_behind(clock: FakeClock) -> None:
    engine = make_engine(clock)
    a, b = join_ready(engine), join_ready(engine)
    engine_join(engine)  # a third peer joined, still downloading: live, not ready
    info = engine.round_info(a, 0)
    assert (info.live_peers, info.behind_peers) == (3, 1)  # holders of the final state wait for such a peer
    engine.leave(b, "done")
    assert engine.round_info(a, 0).live_peers == 2
    for _ in range(2):  # the joiner goes silent for longer than its lease
        clock.now += 0.6 * LEASE_S
        beat(engine, a)
    engine.tick()
    info = engine.round_info(a, 0)
    assert (info.live_peers, info.behind_peers) == (1, 0)


def test_the_engine_decides_at_the_grace_after_a_quorum_while_a_member_stays_silent(clock: FakeClock) -> None:
    engine = make_engine(clock, report_grace_s=10.0)
    a, b, c = join_ready(engine), join_ready(engine), join_ready(engine)
    group = [a, b, c]
    send(engine, a, 1, group=group)
    send(engine, b, 1, group=group)  # 2 of 3: a quorum; c keeps beating but never reports
    clock.now += 9
    beat(engine, c)
    assert engine.round_info(a, 1).outcome == OPEN
    clock.now += 1
    engine.tick()
    info = engine.round_info(a, 1)
    assert (info.outcome, list(info.holders)) == (COMMITTED, ["dht-" + a, "dht-" + b])
    assert clock.now < 1_000.0 + TIMEOUT_S


def test_a_fake_peer_reporting_its_own_group_is_not_committed_nor_a_holder(clock: FakeClock) -> None:
    """The attack seen: a planned peer reports hash ffff… with a group naming only itself."""
    engine = make_engine(clock)
    a, b, fake = join_ready(engine), join_ready(engine), join_ready(engine)
    send(engine, fake, 1, state_hash="f" * 64, group=[fake])
    send(engine, a, 1, group=[a, b])
    send(engine, b, 1, group=[a, b])
    info = engine.round_info(a, 1)
    assert (info.outcome, info.committed_hash, sorted(info.holders)) == (
        COMMITTED,
        "h1",
        sorted(["dht-" + a, "dht-" + b]),
    )


def test_a_round_nobody_reports_is_voided_at_its_timeout_by_the_tick(clock: FakeClock) -> None:
    engine = make_engine(clock)
    a = join_ready(engine)
    assert engine.round_info(a, 0).open_round == 1
    while clock.now < 1_000.0 + TIMEOUT_S:  # alive, unchanged, silent about the round
        clock.now += LEASE_S / 2
        beat(engine, a)
    engine.tick()
    assert engine.round_info(a, 1).outcome == VOIDED


def _two_peers_in_round_one(engine: CoordinatorEngine) -> tuple[str, str, PeerKey]:
    key = PeerKey.generate()
    a = join_ready(engine)
    b, _ = engine_join(engine, key=key)
    beat(engine, b.peer_id)
    assert set(engine.round_info(a, 0).participants) == {a, b.peer_id}
    return a, b.peer_id, key


def test_a_peer_restarted_mid_round_that_still_takes_part_commits_with_its_group(clock: FakeClock) -> None:
    """Its restart leaves a placeholder failure; its new process's own report replaces it, so a group of
    two is not voided for want of a quorum (it was, in every restart a helper measured)."""
    engine = make_engine(clock, min_peers=2, report_grace_s=10.0)
    a, b, key = _two_peers_in_round_one(engine)
    engine_join(engine, key=key)  # b's process was killed and restarted with its state dir
    beat(engine, b)
    clock.now += 4
    send(engine, a, 1, "h1", group=[a, b])
    assert engine.round_info(a, 1).outcome == pb.ROUND_OUTCOME_OPEN  # b's new process may still report
    send(engine, b, 1, "h1", group=[a, b])
    decided = engine.round_info(a, 1)
    assert decided.outcome == pb.ROUND_OUTCOME_COMMITTED and decided.committed_hash == "h1"
    assert set(decided.holders) == {"dht-" + a, "dht-" + b}


def test_a_restarted_peer_that_never_reports_delays_its_round_only_by_the_grace(clock: FakeClock) -> None:
    engine = make_engine(clock, min_peers=2, report_grace_s=10.0)
    a, b, key = _two_peers_in_round_one(engine)
    engine_join(engine, key=key)
    send(engine, a, 1, "h1", group=[a, b])
    clock.now += 5
    beat(engine, a)
    assert engine.round_info(a, 1).outcome == pb.ROUND_OUTCOME_OPEN
    clock.now += 6  # past the grace (not round_timeout_s): the placeholder stands for b's failure
    engine.tick()
    assert engine.round_info(a, 1).outcome == pb.ROUND_OUTCOME_VOIDED  # 1 of a group of 2 is no quorum


def test_an_open_round_names_each_participants_current_process_also_after_a_restart(clock: FakeClock) -> None:
    engine = make_engine(clock, min_peers=2)
    a, _ = engine_join(engine, dht_peer_id="dht-a")
    key = PeerKey.generate()
    b, _ = engine_join(engine, key=key, dht_peer_id="dht-b-first")
    a, b = a.peer_id, b.peer_id
    beat(engine, a)
    beat(engine, b)
    info = engine.round_info(a, 1)
    assert list(info.participants) == [a, b]
    assert list(info.participant_dht_ids) == ["dht-a", "dht-b-first"]  # the ids they joined with
    # b's process dies and its successor joins with the same key and a new libp2p id, mid-round: groupmates
    # must not take an entry its old process left for its own (swarm/net/exchange/rendezvous.py)
    engine_join(engine, key=key, dht_peer_id="dht-b-second")
    info = engine.round_info(a, 1)
    assert dict(zip(info.participants, info.participant_dht_ids)) == {a: "dht-a", b: "dht-b-second"}
    assert {p.id: p.restarts for p in engine.status(engine.run.token).peers} == {a: 0, b: 1}  # swarm status shows it
