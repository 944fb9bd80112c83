"""A round's answer costs the same in a swarm of hundreds or thousands: a peer polling a large round gets its own
entries and the round's size, not every participant; a small round's peers still get the whole plan they match
their group by (and a large round's match by who posts); and a large round is decided again on new reports at most
every SETTLE_EVERY_S."""

import pytest

from coordinator.api.limits import LISTED_PARTICIPANTS
from coordinator.engine import CoordinatorEngine
from coordinator.rounds.settling import SETTLE_EVERY_S
from coordinator.store.database import Store
from peer.link.round_plans import RoundPlans
from swarm.config import RoundConfig, RunConfig
from swarm.train.round_plan import plan_round
from swarm.v1 import coordinator_pb2 as pb
from tests.unit.fake_swarm import engine_join

pytestmark = pytest.mark.timeout(120)


def swarm(peers: int, clock=None, controller: str = "off") -> tuple[CoordinatorEngine, list[str]]:
    """An engine whose round 1 opens with ``peers`` ready peers, all of them planned; their measured uplinks differ
    (10 to 100 Mbit/s), so an adaptive controller gives them different shares."""
    rounds = RoundConfig(min_peers=peers, controller=controller)
    engine = CoordinatorEngine(
        Store(":memory:"), config=RunConfig(rounds=rounds), **({"clock": clock} if clock else {})
    )
    ids = [engine_join(engine, dht_peer_id=f"dht-{i}")[0].peer_id for i in range(peers)]
    for i, p in enumerate(ids):
        engine.heartbeat(
            pb.HeartbeatRequest(
                peer_id=p,
                metrics=pb.PeerMetrics(
                    state=pb.PEER_STATE_READY,
                    state_round=0,
                    state_hash=engine.run.initial_hash,
                    dht_peer_id="dht-" + p,
                    upload_mbit_s=10.0 + 90.0 * i / peers,
                    download_mbit_s=100.0,
                    rtt_ms=20.0,
                    step_time_s=0.5,
                ),
            )
        )
    return engine, ids


def polled(engine: CoordinatorEngine, peer_id: str, number: int = 0) -> tuple[pb.RoundInfo, int]:
    """GetRound's answer as it goes over the wire, and its size in bytes."""
    data = engine.round_info_encoded(peer_id, number)
    return pb.RoundInfo.FromString(data), len(data)


def test_a_large_rounds_answer_names_the_requesters_own_entries_and_does_not_grow_with_the_swarm() -> None:
    sizes = []
    for peers in (LISTED_PARTICIPANTS + 40, 2 * LISTED_PARTICIPANTS + 80):
        engine, ids = swarm(peers)
        me = ids[17]
        info, size = polled(engine, me)
        assert info.open_round == 1 and info.outcome == pb.ROUND_OUTCOME_OPEN
        assert info.participant_count == peers and list(info.participants) == [me]
        assert list(info.participant_dht_ids) == ["dht-17"]
        assert [p.peer_id for p in info.plan.peers] in ([], [me])
        assert len(info.holders) <= 16 and info.live_peers == peers
        beat = engine.heartbeat(
            pb.HeartbeatRequest(
                peer_id=me,
                metrics=pb.PeerMetrics(
                    state=pb.PEER_STATE_READY,
                    state_round=0,
                    state_hash=engine.run.initial_hash,
                    dht_peer_id="dht-" + me,
                ),
            )
        )
        assert list(beat.participants) == [me] and beat.participant_count == peers
        sizes.append(size)
    assert (
        max(sizes) < 2000 and abs(sizes[1] - sizes[0]) < 64
    )  # twice the swarm: the same answer (a list would be 20 KB)


def test_a_small_rounds_answer_lists_every_participant_the_group_is_matched_by() -> None:
    engine, ids = swarm(30)
    info, _ = polled(engine, ids[3])
    assert sorted(info.participants) == sorted(ids) and info.participant_count == 30
    assert list(info.participant_dht_ids) == [f"dht-{ids.index(p)}" for p in info.participants]
    beat = engine.heartbeat(
        pb.HeartbeatRequest(
            peer_id=ids[3],
            metrics=pb.PeerMetrics(
                state=pb.PEER_STATE_READY,
                state_round=0,
                state_hash=engine.run.initial_hash,
                dht_peer_id="dht-" + ids[3],
            ),
        )
    )
    assert list(beat.participants) == [ids[3]] and beat.participant_count == 30


def test_a_peer_that_left_a_large_round_is_told_so_in_its_own_answer() -> None:
    now = [1_000.0]
    engine, ids = swarm(LISTED_PARTICIPANTS + 10, clock=lambda: now[0])
    late, reporter = ids[5], ids[6]
    group = list(polled(engine, ids[0])[0].participants)
    assert group == [ids[0]]
    engine.report(
        pb.ReportRoundRequest(
            peer_id=reporter, round=1, ok=True, state_hash="ab" * 8, group=ids, samples=10, inner_steps=10
        )
    )
    now[0] += SETTLE_EVERY_S
    engine.tick()
    now[0] += SETTLE_EVERY_S
    info, _ = polled(engine, reporter)
    assert list(info.plan.left_out) == [reporter]  # reported: the others match without it
    assert late not in polled(engine, late)[0].plan.left_out


def test_a_large_round_commits_within_a_settle_interval_of_its_last_report() -> None:
    now = [1_000.0]
    engine, ids = swarm(LISTED_PARTICIPANTS + 20, clock=lambda: now[0])
    for p in ids:
        now[0] += 0.001
        engine.report(
            pb.ReportRoundRequest(
                peer_id=p, round=1, ok=True, state_hash="cd" * 8, group=ids, samples=10, inner_steps=10
            )
        )
    now[0] += SETTLE_EVERY_S
    engine.tick()
    info, _ = polled(engine, ids[0], 1)
    assert info.outcome == pb.ROUND_OUTCOME_COMMITTED and info.committed_hash == "cd" * 8
    assert info.participant_count == len(ids) and len(info.holders) == 16


def test_a_large_swarms_answer_is_built_again_at_most_every_refresh_while_only_its_peers_change(monkeypatch) -> None:
    now = [1_000.0]
    engine, ids = swarm(LISTED_PARTICIPANTS + 20, clock=lambda: now[0])
    builds = []
    real = engine._info_cache._build
    monkeypatch.setattr(
        engine._info_cache, "_build", lambda number, *rest: builds.append(number) or real(number, *rest)
    )
    for i, p in enumerate(ids[:100]):
        now[0] += 0.005
        engine.heartbeat(
            pb.HeartbeatRequest(
                peer_id=p,
                metrics=pb.PeerMetrics(  # each changes the roster
                    state=pb.PEER_STATE_TRAINING,
                    round=1,
                    state_round=0,
                    state_hash=engine.run.initial_hash,
                    dht_peer_id=f"dht-{p}-{i}",
                ),
            )
        )
        assert p in polled(engine, p)[0].participants
    assert len(builds) <= 2  # 0.5 s of calls: one build, and one more at most


def test_a_peer_matches_its_group_by_a_small_rounds_plan_and_by_who_posts_in_a_large_one() -> None:
    plans = RoundPlans(tag=lambda round_no=None: "[p]")
    engine, ids = swarm(12)
    info, _ = polled(engine, ids[4])
    assert plans.planned(1, info) == set(ids) and plans.plan_open
    assert plans.processes() == {p: f"dht-{i}" for i, p in enumerate(ids)}
    engine, ids = swarm(LISTED_PARTICIPANTS + 5)
    info, _ = polled(engine, ids[4])
    assert ids[4] in info.participants  # still planned, as the peer checks before and after its steps
    assert plans.planned(1, info) is None and not plans.plan_open and plans.processes() == {}


@pytest.mark.parametrize("peers", [30, LISTED_PARTICIPANTS + 40])
def test_every_member_of_a_controlled_round_plans_the_same_slices_whatever_the_rounds_size(peers: int) -> None:
    """Members whose plans differ do not exchange: every member must derive the same codec, shares and digest
    from its own answer, in a round its answer lists whole and in one it names only the requester in."""
    engine, ids = swarm(peers, controller="auto")
    rounds = engine.config.rounds
    plans = {p: plan_round(rounds, 1, polled(engine, p)[0].choice) for p in ids[::7]}
    assert all(polled(engine, p)[0].HasField("choice") for p in ids[:3])
    assert len({(plan.codec, plan.shares, plan.digest) for plan in plans.values()}) == 1
    plan = next(iter(plans.values()))
    assert plan.chosen
    if peers <= LISTED_PARTICIPANTS:  # uplinks differ: so do the slices, and every member has every share
        assert len(plan.shares) == peers and len({s for _, s in plan.shares}) > 1
    else:  # too many to list: equal slices
        assert plan.shares == () and plan.shares_of(ids[:8]) is None
