"""A large decided round's history and counters reach the store over the calls after its decision, a part each, and
nothing of them is lost: the history read back always has all of a round's participants, and a coordinator stopped
before the rows were all written writes them when it starts again."""

from pathlib import Path

import pytest

from coordinator.engine import CoordinatorEngine
from coordinator.rounds.recording import PART
from coordinator.rounds.settling import SETTLE_EVERY_S
from coordinator.store.database import Store
from coordinator.store.records import COMMITTED
from swarm.config import RoundConfig, RunConfig
from swarm.v1 import coordinator_pb2 as pb
from tests.unit.fake_swarm import engine_join

pytestmark = pytest.mark.timeout(120)

PEERS = 2 * PART + 30  # three parts


def committed_round(store: Store, now: list[float]) -> tuple[CoordinatorEngine, list[str]]:
    """An engine on ``store`` whose round 1, of ``PEERS`` participants, was just committed."""
    engine = CoordinatorEngine(store, config=RunConfig(rounds=RoundConfig(min_peers=PEERS)), clock=lambda: now[0])
    ids = [engine_join(engine, dht_peer_id=f"dht-{i}")[0].peer_id for i in range(PEERS)]
    for p in ids:
        engine.heartbeat(
            pb.HeartbeatRequest(
                peer_id=p,
                metrics=pb.PeerMetrics(
                    state=pb.PEER_STATE_READY, state_round=0, state_hash=engine.run.initial_hash, dht_peer_id="d-" + p
                ),
            )
        )
    for p in ids:
        now[0] += 0.001
        engine.report(
            pb.ReportRoundRequest(
                peer_id=p, round=1, ok=True, state_hash="cd" * 8, group=ids, samples=10, inner_steps=10, loss=2.0
            )
        )
    now[0] += SETTLE_EVERY_S
    engine.tick()
    assert store.get_round(1).outcome == COMMITTED  # read from the store: a call would write another part
    return engine, ids


def stored_history(store: Store) -> tuple[list[pb.RoundHistory], list[pb.PeerRoundHistory]]:
    return store.history(), store.peer_history(first_round=1, last_round=1)


def test_a_large_rounds_rows_are_written_a_part_a_call_and_its_own_row_last() -> None:
    now = [1_000.0]
    store = Store(":memory:")
    engine, ids = committed_round(store, now)
    rounds, peer_rows = stored_history(store)
    assert rounds == [] and 0 < len(peer_rows) < PEERS  # a part: the round's own row waits for the rest
    seen = [len(peer_rows)]
    while not rounds:
        engine.tick()
        rounds, peer_rows = stored_history(store)
        seen.append(len(peer_rows))
        assert len(seen) < 10
    assert len(peer_rows) == PEERS and {r.peer_id for r in peer_rows} == set(ids)
    assert rounds[0].participants == rounds[0].reported == PEERS and rounds[0].holders == PEERS
    assert rounds[0].tokens == PEERS * 10 * RunConfig().data.seq_len
    assert all(b - a <= 2 * PART for a, b in zip(seen, seen[1:]))  # no call wrote more than two parts
    counters = {p.peer_id: (p.rounds_joined, p.rounds_missed) for p in store.peers()}
    assert set(counters.values()) == {(1, 0)}  # every participant's counted record on disk


def test_reading_the_history_right_after_a_decision_gets_the_whole_round() -> None:
    now = [1_000.0]
    engine, ids = committed_round(Store(":memory:"), now)
    history = engine.history(engine.run.token)
    assert [r.round for r in history.rounds] == [1] and history.rounds[0].participants == PEERS
    assert len(history.peer_rounds) == PEERS


def test_a_coordinator_stopped_before_a_rounds_rows_were_written_writes_them_when_it_starts(tmp_path: Path) -> None:
    now = [1_000.0]
    path = tmp_path / "coordinator.db"
    committed_round(Store(path), now)  # its process dies: no further call, no close
    store = Store(path)
    assert stored_history(store)[0] == []
    restarted = CoordinatorEngine(store, config=None, clock=lambda: now[0])
    history = restarted.history(restarted.run.token)
    assert [r.round for r in history.rounds] == [1] and history.rounds[0].reported == PEERS
    assert history.rounds[0].committed_hash == "cd" * 8 and len(history.peer_rounds) == PEERS


def test_closing_the_engine_writes_every_unwritten_row(tmp_path: Path) -> None:
    now = [1_000.0]
    path = tmp_path / "coordinator.db"
    engine, _ = committed_round(Store(path), now)
    engine.close()
    rounds, peer_rows = stored_history(Store(path, read_only=True))
    assert [r.round for r in rounds] == [1] and len(peer_rows) == PEERS
