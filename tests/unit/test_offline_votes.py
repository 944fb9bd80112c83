"""A round a group decided by its signed DHT votes while the coordinator was down is taken as the group decided
it, also when members died meanwhile and the coordinator, back, opened the round with other peers.

The scenario is one a chaos soak (scripts/chaos.py) found: five peers decided a round by their votes
during an outage, two of them were restarted, the restarted coordinator opened the round with the peers ready
then, ignored the survivors' reports (their group named peers outside the round) and committed a restarted
peer's lone round; the survivors had to resync.
"""

from __future__ import annotations

import dataclasses

import pytest

from coordinator.api.errors import BadRequest
from coordinator.engine import CoordinatorEngine
from coordinator.rounds.offline_votes import checked_votes
from coordinator.store.database import Store
from coordinator.store.records import READY
from swarm.config import RoundConfig, RunConfig
from swarm.core.trust.credential import Member, PeerKey
from swarm.core.trust.round_vote import Vote, group_id, group_key, vote_key
from swarm.core.trust.signed_entry import sign_entry
from swarm.net.exchange.group import signed_votes
from swarm.v1 import coordinator_pb2 as pb
from tests.unit.fake_swarm import engine_join
from tests.unit.test_rounds import FakeClock

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@dataclasses.dataclass
class Peer:
    key: PeerKey
    peer_id: str
    dht_id: str
    member: Member


def join(engine: CoordinatorEngine, name: str, *, key: PeerKey | None = None) -> Peer:
    """A peer (a new process of ``key``'s peer) joined, with its credential, and ready."""
    key = key or PeerKey.generate()
    dht_id = f"dht-{name}"
    record, _ = engine_join(engine, key=key, dht_peer_id=dht_id)
    member = Member(
        key=key,
        credential=engine.issue_credential(record.peer_id),
        run_id=engine.run.run_id,
        coordinator_public_key=engine.public_key,
    )
    peer = Peer(key, record.peer_id, dht_id, member)
    beat(engine, peer)
    return peer


def beat(engine: CoordinatorEngine, peer: Peer, state: int = READY) -> None:
    engine.heartbeat(
        pb.HeartbeatRequest(
            peer_id=peer.peer_id,
            metrics=pb.PeerMetrics(
                state=state,
                state_round=0,
                state_hash=engine.run.initial_hash,
                model_fingerprint=engine.run.model_fingerprint,
                param_count=1000,
                dht_peer_id=peer.dht_id,
            ),
        )
    )


def vote(
    engine: CoordinatorEngine,
    peer: Peer,
    round_no: int,
    state_hash: str,
    group: list[Peer],
    *,
    fragment: int = 0,
    ok: bool = True,
) -> dict:
    entry = Vote(
        peer_id=peer.peer_id,
        dht_peer_id=peer.dht_id,
        ok=ok,
        state_hash=state_hash,
        group=group_id([p.peer_id for p in group]) if ok else "",
    )
    return sign_entry(peer.member, vote_key(group_key(engine.run.run_id, round_no, fragment)), entry)


def group_report(
    engine: CoordinatorEngine,
    reporter: Peer,
    round_no: int,
    state_hash: str,
    group: list[Peer],
    votes: dict[str, dict] | None = None,
) -> pb.ReportRoundRequest:
    """What a member sends for a round its group decided by these votes (by default every member's, for the hash)."""
    if votes is None:
        votes = {p.peer_id: vote(engine, p, round_no, state_hash, group) for p in group}
    request = pb.ReportRoundRequest(
        peer_id=reporter.peer_id,
        round=round_no,
        ok=True,
        state_hash=state_hash,
        group=[p.peer_id for p in group],
        inner_steps=10,
        loss=2.0,
    )
    request.group_votes.extend(signed_votes(votes))
    return request


def make_engine(clock: FakeClock) -> CoordinatorEngine:
    config = RunConfig(rounds=RoundConfig(round_timeout_s=100.0, min_peers=2, report_grace_s=10.0))
    return CoordinatorEngine(Store(":memory:"), config=config, lease_s=30.0, clock=clock)


def ids(peers: list[Peer]) -> set[str]:
    return {p.peer_id for p in peers}


def test_the_groups_round_commits_with_the_votes_of_its_dead_members_and_only_the_living_hold_it(
    clock, tmp_path
) -> None:
    """Five planned peers go on without the coordinator for two rounds; two die after voting. The restarted
    coordinator decides the first round with their votes and opens the next with the three alive, and the
    survivors' report of that round, carrying the five votes, takes the group back into it."""
    config = RunConfig(rounds=RoundConfig(round_timeout_s=100.0, min_peers=2, report_grace_s=10.0))
    signing_key = PeerKey.generate()
    before = CoordinatorEngine(
        Store(tmp_path / "c.sqlite3"), config=config, lease_s=30.0, clock=clock, signing_key=signing_key
    )
    s1, s2, s3, r1, r2 = group = [join(before, name) for name in ("s1", "s2", "s3", "r1", "r2")]
    assert set(before.round_info(s1.peer_id, 1).participants) == ids(group)
    votes = {n: {p.peer_id: vote(before, p, n, f"g{n}", group) for p in group} for n in (1, 2)}  # the DHT's
    clock.now += 5
    # back; r1's and r2's processes are gone meanwhile
    engine = CoordinatorEngine(
        Store(tmp_path / "c.sqlite3"), config=config, lease_s=30.0, clock=clock, signing_key=signing_key
    )
    for _ in range(9):
        clock.now += 5
        for survivor in (s1, s2, s3):
            beat(engine, survivor)
    for survivor in (s1, s2, s3):
        engine.report(group_report(engine, survivor, 1, "g1", group, votes[1]))
    first = engine.round_info(s1.peer_id, 1)
    assert first.outcome == pb.ROUND_OUTCOME_COMMITTED and first.committed_hash == "g1"
    assert set(first.holders) == {s1.dht_id, s2.dht_id, s3.dht_id}  # r1 and r2 voted; they hold nothing now
    assert set(engine.round_info(s1.peer_id, 2).participants) == ids([s1, s2, s3])  # opened with those alive
    engine.report(group_report(engine, s1, 2, "g2", group, votes[2]))
    stored = engine._store.get_round(2)  # (a round's info lists its live participants only)
    # the round is the group's now (s1, having reported, is out of the plan the others match by)
    assert set(stored.participants) | {s1.peer_id} == ids(group) and len(stored.budgets) == 4
    info = engine.round_info(s1.peer_id, 2)
    assert info.outcome == pb.ROUND_OUTCOME_OPEN  # s2 and s3 are alive in the processes that voted: they report
    for survivor in (s2, s3):
        engine.report(group_report(engine, survivor, 2, "g2", group, votes[2]))
    decided = engine.round_info(s1.peer_id, 2)
    assert decided.outcome == pb.ROUND_OUTCOME_COMMITTED and decided.committed_hash == "g2"
    assert set(decided.holders) == {s1.dht_id, s2.dht_id, s3.dht_id}


def test_votes_of_identities_the_coordinator_did_not_plan_count_for_nothing(clock) -> None:
    """With the coordinator never down, one member's report carries the signed votes of two of its own identities
    that had left before the round opened, all for an invented hash: they are not added to the round, the
    report (whose group names them) supports nothing, and the honest pair commits."""
    engine = make_engine(clock)
    y, z = join(engine, "y"), join(engine, "z")
    for gone in (y, z):  # their round 1 ends with them: void, nobody left to report
        engine.leave(gone.peer_id, "done")
    h1, h2, x = (join(engine, name) for name in ("h1", "h2", "x"))
    fakes = [x, y, z]
    number = engine.round_info(h1.peer_id, 0).open_round
    assert number == 2 and set(engine.round_info(h1.peer_id, number).participants) == ids([h1, h2, x])
    fake_votes = {p.peer_id: vote(engine, p, number, "f" * 64, fakes) for p in fakes}
    engine.report(group_report(engine, x, number, "f" * 64, fakes, fake_votes))
    stored = engine._store.get_round(number)  # nobody added by the votes; x, a round of its own, out of the plan
    assert set(stored.participants) == ids([h1, h2]) and stored.left_out == (x.peer_id,)
    # x's report supports nothing: no quorum, no grace
    assert engine.round_info(h1.peer_id, number).outcome == pb.ROUND_OUTCOME_OPEN
    for honest in (h1, h2):
        engine.report(
            pb.ReportRoundRequest(
                peer_id=honest.peer_id,
                round=number,
                ok=True,
                state_hash="a" * 64,
                group=[h1.peer_id, h2.peer_id],
                inner_steps=10,
                loss=2.0,
            )
        )
    decided = engine.round_info(h1.peer_id, number)
    assert decided.outcome == pb.ROUND_OUTCOME_COMMITTED and decided.committed_hash == "a" * 64
    assert set(decided.holders) == {h1.dht_id, h2.dht_id}


def test_without_the_votes_neither_the_survivors_reports_nor_a_lone_round_commit(clock) -> None:
    """The same reports sent without the group's votes: the survivors' group names peers outside the round, and
    the restarted peer's lone report is one of the two planned participants, not a quorum: the round is void."""
    engine = make_engine(clock)
    s1, r1 = join(engine, "s1"), join(engine, "r1-old")
    r1_new = join(engine, "r1-new", key=r1.key)
    engine.report(
        pb.ReportRoundRequest(
            peer_id=r1_new.peer_id, round=1, ok=True, state_hash="lone", group=[r1.peer_id], inner_steps=3
        )
    )
    s2, s3 = join(engine, "s2"), join(engine, "s3")
    group = [s1, s2, s3, r1]
    for survivor in (s1, s2, s3):
        bare = group_report(engine, survivor, 1, "g", group)
        del bare.group_votes[:]
        engine.report(bare)
    clock.now += 101  # the round's timeout: no hash had a quorum, so no grace ran
    engine.tick()
    decided = engine._store.get_round(1)
    assert decided.outcome == pb.ROUND_OUTCOME_VOIDED and "no quorum (needs 2)" in decided.reason


def test_a_stand_in_vote_counts_until_the_peers_own_process_reports(clock) -> None:
    engine = make_engine(clock)
    s1, r1 = join(engine, "s1"), join(engine, "r1-old")
    s2 = join(engine, "s2")
    group = [s1, s2, r1]
    votes = {p.peer_id: vote(engine, p, 1, "g", group) for p in group}
    join(engine, "r1-new", key=r1.key)  # r1 restarted: its vote stands in for it
    engine.report(group_report(engine, s1, 1, "g", group, votes))
    engine.report(group_report(engine, s2, 1, "g", group, votes))
    decided = engine.round_info(s1.peer_id, 1)
    assert decided.outcome == pb.ROUND_OUTCOME_COMMITTED  # 3 of 3 agree, nobody left to wait for
    assert set(decided.holders) == {s1.dht_id, s2.dht_id}


def bad(engine: CoordinatorEngine, request: pb.ReportRoundRequest, match: str) -> None:
    with pytest.raises(BadRequest, match=match):
        checked_votes(request, run_id=engine.run.run_id, coordinator_public_key=engine.public_key, now=engine._clock())


def test_votes_that_do_not_prove_the_report_are_refused_with_the_reason(clock) -> None:
    engine = make_engine(clock)
    a, b, c = join(engine, "a"), join(engine, "b"), join(engine, "c")
    group = [a, b, c]
    good = {p.peer_id: vote(engine, p, 1, "g", group) for p in group}
    assert set(
        checked_votes(
            group_report(engine, a, 1, "g", group, good),
            run_id=engine.run.run_id,
            coordinator_public_key=engine.public_key,
            now=clock.now,
        )
    ) == {a.peer_id, b.peer_id, c.peer_id}

    missing = {p: v for p, v in good.items() if p != c.peer_id}
    bad(engine, group_report(engine, a, 1, "g", group, missing), "not one from each member")
    outsider = join(engine, "d")
    extra = {**good, outsider.peer_id: vote(engine, outsider, 1, "g", group)}
    bad(engine, group_report(engine, a, 1, "g", group, extra), "not one from each member")
    other_round = {**good, b.peer_id: vote(engine, b, 2, "g", group)}
    bad(engine, group_report(engine, a, 1, "g", group, other_round), "not all for one fragment")
    other_fragment = {**good, b.peer_id: vote(engine, b, 1, "g", group, fragment=1)}
    bad(engine, group_report(engine, a, 1, "g", group, other_fragment), "not all for one fragment")
    forged = {**good, b.peer_id: {**good[b.peer_id], "signature": bytes(64)}}
    bad(engine, group_report(engine, a, 1, "g", group, forged), f"vote of {b.peer_id} does not check out")
    # a vote is signed by its voter alone: a's key cannot vote for b
    by_a = sign_entry(
        a.member,
        vote_key(group_key(engine.run.run_id, 1, 0)),
        Vote(
            peer_id=b.peer_id, dht_peer_id=b.dht_id, ok=True, state_hash="g", group=group_id([p.peer_id for p in group])
        ),
    )
    bad(engine, group_report(engine, a, 1, "g", group, {**good, b.peer_id: by_a}), "does not check out")
    elsewhere = {**good, b.peer_id: vote(engine, b, 1, "g", [a, b])}  # b averaged with another group
    bad(engine, group_report(engine, a, 1, "g", group, elsewhere), "voted with another group")
    disagrees = {**good, a.peer_id: vote(engine, a, 1, "other", group)}
    bad(engine, group_report(engine, a, 1, "g", group, disagrees), "its own vote says other")


def test_a_refused_report_changes_nothing_and_the_round_goes_on(clock) -> None:
    engine = make_engine(clock)
    a, b = join(engine, "a"), join(engine, "b")
    group = [a, b]
    forged = {
        a.peer_id: vote(engine, a, 1, "g", group),
        b.peer_id: {**vote(engine, b, 1, "g", group), "signature": bytes(64)},
    }
    with pytest.raises(BadRequest):
        engine.report(group_report(engine, a, 1, "g", group, forged))
    assert engine.round_info(a.peer_id, 1).outcome == pb.ROUND_OUTCOME_OPEN
    engine.report(group_report(engine, a, 1, "g", group))
    engine.report(group_report(engine, b, 1, "g", group))
    assert engine.round_info(a.peer_id, 1).committed_hash == "g"


def test_a_report_with_more_votes_than_any_sent_group_is_refused_before_the_engine(clock) -> None:
    from coordinator.api.limits import check_request
    from swarm.core.trust.round_vote import MAX_SENT_VOTES

    request = pb.ReportRoundRequest(peer_id="p-1", round=1, ok=True, state_hash="g")
    request.group_votes.extend(pb.SignedVote(peer_id="p-1", key="k") for _ in range(MAX_SENT_VOTES + 1))
    with pytest.raises(BadRequest, match=f"group_votes has {MAX_SENT_VOTES + 1} entries, more than {MAX_SENT_VOTES}"):
        check_request("ReportRound", request)
    del request.group_votes[MAX_SENT_VOTES:]
    check_request("ReportRound", request)  # within the caps: the engine checks what they prove


def test_votes_of_a_group_without_the_reporter_are_refused(clock) -> None:
    engine = make_engine(clock)
    a, b, c = join(engine, "a"), join(engine, "b"), join(engine, "c")
    report = group_report(engine, b, 1, "g", [b, c])
    report.peer_id = a.peer_id  # a sends its groupmates' votes as its own report
    bad(engine, report, "not one from each member")


def _link(last_group: set[str], asked: list):
    """A CoordinatorLink whose group decision records what it was asked (the coordinator unreachable)."""
    import threading

    from peer.faults import FaultPlan
    from peer.link.coordinator_link import CoordinatorLink

    link = CoordinatorLink(
        client=None,
        stop=threading.Event(),
        faults=FaultPlan.parse(""),
        poll_s=0.01,
        leave_grace_s=0.0,
        tag=lambda r: f"[r{r}]",
    )
    link.group_decision = lambda vote: asked.append(vote) or None
    link.last_group = last_group
    return link


def _vote(round_no: int, group: list[str]):
    import torch

    from swarm.train.contribution import Contribution, TrainStats
    from swarm.train.round import Vote as RoundVote

    return RoundVote(
        round_no=round_no,
        fragment=0,
        ok=True,
        state_hash="h",
        group=group,
        contribution=Contribution(0, torch.zeros(1), 1),
        train=TrainStats(1, 1, 1, 1.0, 0.1),
    )


def _decided_alone(link, vote):
    from swarm.control.client import CoordinatorUnreachable

    return link.decide_by_group(vote, link.report_request(vote), CoordinatorUnreachable("down"))


def test_a_peer_that_averaged_alone_where_others_were_planned_waits_for_the_coordinator() -> None:
    """A process restarted into the round the coordinator last had open, while its group went on offline, finds
    nobody to average with; deciding that round alone would split it off from them. It waits instead."""
    asked: list = []
    link = _link({"p-me", "p-b", "p-c"}, asked)
    link.coordinator_decided = True  # it has taken part in a round the coordinator decided
    vote = _vote(29, ["p-me"])
    assert _decided_alone(link, vote) is None
    assert not asked and not link.backlog  # no decision of its own, nothing to report later
    link.last_group = {"p-me"}  # the run's only peer: deciding alone is its group's decision
    _decided_alone(link, vote)
    assert asked == [vote]


def test_a_restarted_process_that_has_not_yet_taken_part_in_a_round_the_coordinator_decided_waits_for_it() -> None:
    """Restarted while the coordinator was behind its group, a process is planned into a round the group played long
    ago; with others restarted alike they form a group of their own (a chaos soak: three of five, two rounds
    decided among themselves, then resynced). Their votes must not decide that round. (A first process may: its
    ``join`` sets ``coordinator_decided`` for a peer's first session.)"""
    asked: list = []
    link = _link({"p-a", "p-b", "p-c", "p-d", "p-e"}, asked)
    vote = _vote(26, ["p-a", "p-b", "p-c"])
    assert _decided_alone(link, vote) is None
    assert not asked and not link.backlog
    link.coordinator_decided = True
    _decided_alone(link, vote)
    assert asked == [vote]


class _BehindCoordinator:
    """A coordinator back from a restart at round ``behind``: it refuses reports of later rounds until this peer
    has reported the rounds its group decided without it, then decides every round it is told of."""

    def __init__(self, behind: int) -> None:
        self.open_round, self.reports, self.voided, self.stalls = behind, [], set(), False

    def report_round(self, request: pb.ReportRoundRequest) -> pb.ReportRoundResponse:
        self.reports.append(request.round)
        if request.round == self.open_round and self.stalls:  # voided, and the next round not opened yet
            self.voided.add(request.round)
        elif request.round == self.open_round:
            self.open_round += 1
        return pb.ReportRoundResponse(round=pb.RoundInfo(round=request.round, open_round=self.open_round))

    def get_round(self, *, peer_id: str, round_no: int) -> pb.RoundInfo:
        outcome = (
            pb.ROUND_OUTCOME_COMMITTED
            if round_no < self.open_round
            else pb.ROUND_OUTCOME_VOIDED
            if round_no in self.voided
            else pb.ROUND_OUTCOME_OPEN
        )
        return pb.RoundInfo(
            round=round_no,
            open_round=self.open_round,
            outcome=outcome,
            committed_hash="h" if outcome == pb.ROUND_OUTCOME_COMMITTED else "",
        )


def test_a_coordinator_back_but_behind_hears_the_groups_rounds_at_once_instead_of_after_the_votes() -> None:
    """Back from a restart, the coordinator is at round 20 while the group, which decided round 20 by its votes,
    averaged round 21; a groupmate died before voting on 21, so its votes cannot decide it. The peer reports round 20
    from its backlog at once and the coordinator decides 21, instead of the peer first waiting out the votes' timeout
    (a chaos soak: every peer 8 s)."""
    from peer.link.coordinator_link import Backlogged, GroupDecided

    asked: list = []
    link = _link({"p-me", "p-b", "p-c", "p-d"}, asked)
    link.coordinator_decided = True
    link.client = coordinator = _BehindCoordinator(behind=20)
    link.backlog.append(Backlogged(pb.ReportRoundRequest(peer_id="p-me", round=20, ok=True, state_hash="h"), "h"))
    decision = link.decide(_vote(21, ["p-me", "p-b", "p-c", "p-d"]))
    assert decision.committed_hash == "h" and not decision.by_group
    assert not asked  # the votes were not waited for
    assert coordinator.reports == [21, 20, 21]  # refused (behind), the backlog, then this round again

    link.backlog.clear()  # with nothing to tell it, the group's votes are still what decide
    link.group_decision = lambda vote: asked.append(vote) or GroupDecided("h2", [], [])
    coordinator.open_round = 22
    assert link.decide(_vote(23, ["p-me", "p-b", "p-c", "p-d"])).by_group and len(asked) == 1

    # told the backlog, it is still behind (it voided round 25 and has not opened 26 yet): the votes decide after all
    link.backlog[:] = [Backlogged(pb.ReportRoundRequest(peer_id="p-me", round=25, ok=True, state_hash="h"), "h")]
    coordinator.open_round, coordinator.reports, coordinator.stalls = 25, [], True
    assert link.decide(_vote(26, ["p-me", "p-b", "p-c", "p-d"])).by_group and len(asked) == 2
    assert coordinator.reports[:3] == [26, 25, 26]


@pytest.mark.parametrize("failure_first", [True, False], ids=["its-failure-first", "the-votes-first"])
def test_a_restarted_members_failure_does_not_undo_the_vote_its_old_process_gave_the_group(
    clock, failure_first
) -> None:
    """A group of four decided the round by its votes while the coordinator was away; two members died and their next
    processes, sent into that round by the restarted coordinator, failed it (their groupmates refused them: the
    exchange had completed without them). Their failures must not outvote what their old processes signed: a chaos
    soak saw the coordinator void such a round 2 of 4, after the group had committed it and gone on."""
    engine = make_engine(clock)
    s1, s2, r1, r2 = (join(engine, name) for name in ("s1", "s2", "r1-old", "r2-old"))
    group = [s1, s2, r1, r2]
    votes = {p.peer_id: vote(engine, p, 1, "g", group) for p in group}  # before r1's and r2's processes died
    restarted = [join(engine, "r1-new", key=r1.key), join(engine, "r2-new", key=r2.key)]

    def failures() -> None:
        for process in restarted:
            engine.report(
                pb.ReportRoundRequest(
                    peer_id=process.peer_id,
                    round=1,
                    ok=False,
                    group=[process.peer_id],
                    error="this peer's exchange of the round is over: it completed in a group without this sender",
                )
            )

    def survivors() -> None:
        for survivor in (s1, s2):
            engine.report(group_report(engine, survivor, 1, "g", group, votes))

    for reports in (failures, survivors) if failure_first else (survivors, failures):
        reports()
    clock.now += 11  # past the report grace, should the round still be open
    engine.tick()
    decided = engine.round_info(s1.peer_id, 1)
    assert decided.outcome == pb.ROUND_OUTCOME_COMMITTED and decided.committed_hash == "g"
    assert set(decided.holders) == {s1.dht_id, s2.dht_id}  # the restarted processes do not hold it: they resync
