"""The coordinator's SQLite state survives a restart: same run, peers, rounds, reports and totals."""

from pathlib import Path

import pytest

from coordinator.engine import CoordinatorEngine
from coordinator.store.database import SCHEMA_VERSION, STORE_FILE, Store
from coordinator.store.records import COMMITTED, OPEN, READY, PeerRecord, ReportRecord, RoundRecord, RunRecord, to_json
from coordinator.store.run_identity import with_data_fingerprint
from swarm.config import ConfigError, RoundConfig, RunConfig
from swarm.core.trust.credential import PeerKey
from swarm.v1 import coordinator_pb2 as pb
from tests.unit.fake_swarm import engine_join

pytestmark = pytest.mark.timeout(20)


def test_records_survive_close_and_reopen(tmp_path: Path) -> None:
    store = Store.in_dir(tmp_path)
    run = RunRecord(run_id="run-1", token="t", run_spec_json="{}", created_at=1.0, ddp_equivalent_bytes=42)
    metrics = pb.PeerMetrics(state=READY, state_hash="h0", loss=float("nan"), dht_maddrs=["/ip4/1.2.3.4/tcp/5"])
    peer = PeerRecord(
        peer_id="p-1", peer_index=0, joined_at=1.0, last_seen=2.0, lease_expiry=3.0, state=READY, metrics=metrics
    )
    committed = RoundRecord(
        round=1, opened_at=1.0, participants=("p-1",), outcome=COMMITTED, committed_hash="h1", holders=("p-1",)
    )
    with store.transaction():
        store.put_run(run)
        store.put_peer(peer)
        store.put_round(committed)
        store.put_round(RoundRecord(round=2, opened_at=5.0, participants=("p-1",)))
    assert store.add_report(ReportRecord(round=2, peer_id="p-1", reported_at=6.0, ok=True, group=("p-1",)))
    assert not store.add_report(ReportRecord(round=2, peer_id="p-1", reported_at=7.0))  # first one stands
    store.close()

    assert (tmp_path / STORE_FILE).exists()
    store = Store.in_dir(tmp_path)
    assert to_json(store.get_run()) == to_json(run)  # (NaN fields never compare equal)
    (again,) = store.peers()
    assert to_json(again) == to_json(peer) and again.metrics.SerializeToString() == metrics.SerializeToString()
    assert to_json(store.get_round(1)) == to_json(committed)
    assert store.latest_round().outcome == OPEN and store.latest_round().round == 2
    assert store.latest_committed_round().committed_hash == "h1"
    assert store.count_rounds(COMMITTED) == 1
    (report,) = store.reports(2)
    assert report.reported_at == 6.0 and report.group == ("p-1",)
    store.close()


def test_failed_transaction_writes_nothing() -> None:
    store = Store(":memory:")
    with pytest.raises(RuntimeError):
        with store.transaction():
            store.put_peer(PeerRecord(peer_id="p-1", peer_index=0, joined_at=0, last_seen=0, lease_expiry=1))
            raise RuntimeError("crash in the middle")
    assert store.peers() == []


def _beat(engine: CoordinatorEngine, peer_id: str, state_round: int, state_hash: str) -> None:
    engine.heartbeat(
        pb.HeartbeatRequest(
            peer_id=peer_id,
            metrics=pb.PeerMetrics(
                state=READY,
                state_round=state_round,
                state_hash=engine.run.initial_hash if state_hash == "h0" else state_hash,
                model_fingerprint=engine.run.model_fingerprint,
                param_count=1000,
                tokens=500,
                bytes_sent=7,
                wall_time_s=2.0,
                inner_time_s=1.0,
            ),
        )
    )


def test_restarted_coordinator_continues_where_it_stopped(tmp_path: Path) -> None:
    now = [1_000.0]
    config = RunConfig(rounds=RoundConfig(min_peers=2))

    def engine() -> CoordinatorEngine:
        return CoordinatorEngine(Store.in_dir(tmp_path), config=config, clock=lambda: now[0])

    first = engine()
    a, _ = engine_join(first)
    b, _ = engine_join(first)
    for p in (a, b):
        _beat(first, p.peer_id, 0, "h0")
    for p in (a, b):
        first.report(
            pb.ReportRoundRequest(
                peer_id=p.peer_id, round=1, ok=True, state_hash="h1", inner_steps=3, group=[a.peer_id, b.peer_id]
            )
        )
    before = first.status(first.run.token)
    assert before.run.open_round == 2
    first._store.close()

    now[0] += 5
    second = engine()
    after = second.status(second.run.token)
    assert (after.run.run_id, after.run.open_round, after.run.rounds_committed) == (before.run.run_id, 2, 1)
    assert after.run.committed_hash == "h1" and after.run.param_count == first.run.param_count > 0
    assert [(p.id, p.rounds_joined) for p in after.peers] == [(a.peer_id, 1), (b.peer_id, 1)]
    assert after.totals == before.totals
    assert second.run.token == first.run.token
    c, _ = engine_join(second)
    assert c.peer_index == 2  # indices are not reused after a restart
    for p in (a, b):
        second.report(
            pb.ReportRoundRequest(peer_id=p.peer_id, round=2, ok=True, state_hash="h2", group=[a.peer_id, b.peer_id])
        )
    assert second.status(second.run.token).run.open_round == 3


def test_a_different_config_for_an_existing_run_is_refused(tmp_path: Path) -> None:
    CoordinatorEngine(Store.in_dir(tmp_path), config=RunConfig())._store.close()
    other = RunConfig(rounds=RoundConfig(inner_steps=7))
    with pytest.raises(ConfigError, match=r"different config \(rounds.inner_steps differs\).*original --config"):
        CoordinatorEngine(Store.in_dir(tmp_path), config=other)
    resumed = CoordinatorEngine(Store.in_dir(tmp_path), config=None)  # no config: resume as stored
    assert resumed.config.rounds.inner_steps == 50
    resumed._store.close()
    defaulted = CoordinatorEngine(Store.in_dir(tmp_path), config=other, check_config=False)
    assert defaulted.config.rounds.inner_steps == 50  # a default config does not override the kept run
    defaulted._store.close()


def test_a_restart_may_send_the_logs_elsewhere(tmp_path: Path) -> None:
    from swarm.config import LoggingConfig

    CoordinatorEngine(Store.in_dir(tmp_path), config=RunConfig())._store.close()
    moved = RunConfig().replace(logging=LoggingConfig(tensorboard=str(tmp_path / "tb")))
    restarted = CoordinatorEngine(Store.in_dir(tmp_path), config=moved)
    assert restarted.config.logging.tensorboard == str(tmp_path / "tb")
    assert restarted.run.run_spec_json == with_data_fingerprint(moved).to_json(), (
        "peers that join now are told the new log dir"
    )
    restarted._store.close()


def test_a_restarted_peer_keeps_its_record_and_index_across_a_coordinator_restart(tmp_path: Path) -> None:
    config = RunConfig()
    engine = CoordinatorEngine(Store.in_dir(tmp_path), config=config, lease_s=10)
    key = PeerKey.generate()
    old, _ = engine_join(engine, key=key, name="laptop")
    engine.heartbeat(pb.HeartbeatRequest(peer_id=old.peer_id, metrics=pb.PeerMetrics(state=READY, bytes_sent=1000)))
    engine_join(engine, name="desktop")

    reopened = CoordinatorEngine(Store.in_dir(tmp_path), config=config, lease_s=10)
    new, _ = engine_join(reopened, key=key, name="laptop")  # the peer restarts too: same key, same id
    assert (new.peer_id, new.peer_index, new.session) == (old.peer_id, old.peer_index, old.session + 1)
    assert new.public_key == key.public_key.hex()
    peers = {p.id: p for p in reopened.status(reopened.run.token).peers}
    assert len(peers) == 2 and peers[old.peer_id].state == "joining"


def test_a_store_of_another_schema_version_is_refused_in_one_sentence(tmp_path: Path) -> None:
    import sqlite3

    db = sqlite3.connect(tmp_path / STORE_FILE)  # a file from before the schema was versioned
    db.execute("CREATE TABLE peers (peer_id TEXT PRIMARY KEY, peer_index INTEGER NOT NULL UNIQUE, data TEXT NOT NULL)")
    db.commit()
    db.close()
    with pytest.raises(
        ConfigError,
        match=r"holds a run written by another swarm version \(store schema 0, this "
        rf"version reads {SCHEMA_VERSION}\); .* or use a new --state-dir\.$",
    ):
        Store.in_dir(tmp_path)
    Store.in_dir(tmp_path / "new").close()
    Store.in_dir(tmp_path / "new").close()  # a file this version wrote opens again
