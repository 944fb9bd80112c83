"""A decided round of thousands is counted for its participants and written to the history a chunk per session
after the decision, not in the one hold of the engine's lock that decides it: every participant ends counted once
and has its history row, the round's own row is there at once, and a small round is still booked in full at once."""

import pytest

from coordinator.api.limits import LISTED_PARTICIPANTS
from coordinator.rounds.settling import BOOKKEEPING_CHUNK, SETTLE_EVERY_S
from swarm.v1 import coordinator_pb2 as pb
from tests.unit.test_round_info_bounded import polled, swarm

pytestmark = pytest.mark.timeout(120)


def _commit_round_one(peers: int) -> tuple:
    now = [1_000.0]
    engine, ids = swarm(peers, clock=lambda: now[0])
    for p in ids:
        now[0] += 0.001
        engine.report(pb.ReportRoundRequest(peer_id=p, round=1, ok=True, state_hash="cd" * 8, group=ids,
                                            samples=10, inner_steps=10))
    now[0] += SETTLE_EVERY_S
    engine.tick()  # decides round 1
    return engine, ids, now


def _joined(engine) -> list[int]:
    return [p.rounds_joined for p in engine.status(engine.run.token).peers]


def test_a_large_rounds_participants_are_counted_and_written_a_chunk_per_session_after_its_decision() -> None:
    peers = 2 * BOOKKEEPING_CHUNK + 7  # over LISTED_PARTICIPANTS: a large round
    assert peers > LISTED_PARTICIPANTS
    engine, ids, now = _commit_round_one(peers)
    assert sum(_joined(engine)) == BOOKKEEPING_CHUNK  # the decision counted nobody; this call's session one chunk
    history = engine.history(engine.run.token, max_rounds=1)  # the round's own row at once
    assert history.rounds[0].participants == peers and history.rounds[0].outcome == pb.ROUND_OUTCOME_COMMITTED
    assert polled(engine, ids[0], 1)[0].outcome == pb.ROUND_OUTCOME_COMMITTED
    for _ in range(3):
        now[0] += 0.5
        engine.tick()
    assert _joined(engine) == [1] * peers  # each counted once, however many sessions followed
    rows = engine.history(engine.run.token, max_rounds=1).peer_rounds
    assert sorted(r.peer_id for r in rows) == sorted(ids) and all(r.ok for r in rows)


def test_a_small_round_is_counted_and_written_in_full_by_its_decision() -> None:
    engine, ids, _ = _commit_round_one(8)
    assert _joined(engine) == [1] * 8
    assert len(engine.history(engine.run.token, max_rounds=1).peer_rounds) == 8
