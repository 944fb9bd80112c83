"""The run's history: recorded per decided round, served by GetHistory, printed by `swarm history` from a live
coordinator or a finished run's state dir, and kept across the schema-3 -> 4 migration."""

import csv
import dataclasses
import io
import json
import sqlite3
from pathlib import Path

import grpc
import pytest

from coordinator.server import CoordinatorServer
from coordinator.store.database import SCHEMA_VERSION, STORE_FILE, Store
from swarm.app.cli import main as cli_main
from swarm.config import RoundConfig, RunConfig
from swarm.control.client import CoordinatorClient, CoordinatorRejected
from swarm.train.model.initial_state import run_identity
from swarm.v1 import coordinator_pb2 as pb
from tests.unit.fake_swarm import member_client

pytestmark = [pytest.mark.slow, pytest.mark.timeout(60)]


RUN = RunConfig(rounds=RoundConfig(min_peers=2, max_rounds=5, inner_steps=5))
MODEL = run_identity(RUN)


def _ready(client: CoordinatorClient, peer_id: str, **extra) -> pb.HeartbeatResponse:
    return client.heartbeat(
        peer_id,
        state=pb.PEER_STATE_READY,
        state_round=0,
        state_hash=MODEL.initial_hash,
        model_fingerprint=MODEL.model_fingerprint,
        param_count=1000,
        tokens_per_s=1234.0,
        step_time_s=0.1,
        upload_mbit_s=80.0,
        rtt_ms=12.0,
        **extra,
    )


def _run_two_rounds(server: CoordinatorServer) -> list[str]:
    """Two peers: round 1 commits, round 2 is voided (their hashes differ); one evaluates round 1's state."""
    (ca, a), (cb, b) = member_client(server.join_string, name="a"), member_client(server.join_string, name="b")
    try:
        _ready(ca, a.peer_id)
        _ready(cb, b.peer_id)
        group = [a.peer_id, b.peer_id]
        common = dict(
            ok=True,
            inner_steps=5,
            samples=40,
            group=group,
            inner_time_s=3.0,
            exchange_time_s=1.0,
            bytes_sent=1000,
            bytes_received=900,
        )
        ca.report_round(a.peer_id, 1, state_hash="h1", loss=3.5, **common)
        cb.report_round(b.peer_id, 1, state_hash="h1", loss=3.0, **common)
        _ready(ca, a.peer_id, eval_loss=2.5, eval_round=1)
        ca.report_round(a.peer_id, 2, state_hash="h2a", loss=3.0, **common)
        cb.report_round(b.peer_id, 2, state_hash="h2b", loss=3.0, **common)
        assert ca.get_round(a.peer_id, 2).outcome == pb.ROUND_OUTCOME_VOIDED
    finally:
        ca.close()
        cb.close()
    return group


def test_history_is_served_live_and_read_from_the_finished_state_dir(tmp_path: Path, capsys) -> None:
    server = CoordinatorServer(run=RUN, state_dir=tmp_path / "c")
    server.start()
    try:
        group = _run_two_rounds(server)
        with CoordinatorClient(server.join_string, request_timeout_s=5) as watcher:
            live = watcher.get_history()
            assert [r.round for r in watcher.get_history(after_round=1).rounds] == [2]
            page = watcher.get_history(max_rounds=1)
            assert [r.round for r in page.rounds] == [1] and page.more
        with CoordinatorClient(dataclasses.replace(server.join_string, token="guess"), request_timeout_s=5) as stranger:
            with pytest.raises(CoordinatorRejected) as info:
                stranger.get_history()
            assert info.value.code == grpc.StatusCode.UNAUTHENTICATED
        assert cli_main(["history", str(server.join_string), "--json"]) == 0
        printed_live = json.loads(capsys.readouterr().out)
    finally:
        server.stop()

    first, second = live.rounds
    assert (first.round, first.outcome, first.participants, first.holders) == (1, pb.ROUND_OUTCOME_COMMITTED, 2, 2)
    assert (first.codec, first.inner_steps, first.fragments, first.group_size) == ("fp32", 5, 1, 2)
    assert (first.bytes_sent, first.bytes_received, first.exchange_s) == (2000, 1800, 1.0)
    assert first.mean_loss == 3.25 and first.eval_loss == 2.5 and first.utilization == 0.75
    assert first.tokens == 80 * RUN.data.seq_len and first.ddp_equivalent_bytes > 0
    assert second.outcome == pb.ROUND_OUTCOME_VOIDED and second.holders == 0
    assert second.tokens == 0  # its work carries into the peers' next contributions: counted once, there
    peer_rows = [p for p in live.peer_rounds if p.round == 1]
    assert sorted(p.peer_id for p in peer_rows) == sorted(group)
    assert all(p.holder and p.tokens_per_s == 1234.0 and p.upload_mbit_s == 80.0 for p in peer_rows)

    assert [r["outcome"] for r in printed_live["rounds"]] == ["committed", "voided"]
    assert cli_main(["history", str(tmp_path / "c"), "--csv"]) == 0  # the coordinator is gone: the file
    rows = list(csv.DictReader(io.StringIO(capsys.readouterr().out)))
    assert [(r["round"], r["outcome"], r["eval_loss"]) for r in rows] == [
        ("1", "committed", "2.5"),
        ("2", "voided", ""),
    ]


def test_history_of_a_missing_state_dir_is_one_sentence(tmp_path: Path, capsys) -> None:
    assert cli_main(["history", str(tmp_path / "nowhere")]) == 2
    err = capsys.readouterr().err
    assert "is neither a join string nor a directory" in err and "Traceback" not in err


def test_a_schema_3_store_gains_the_history_tables_and_keeps_its_run(tmp_path: Path) -> None:
    path = tmp_path / STORE_FILE
    db = sqlite3.connect(path)
    db.executescript(
        "CREATE TABLE run (id INTEGER PRIMARY KEY, data TEXT NOT NULL);"
        "CREATE TABLE rounds (round INTEGER PRIMARY KEY, outcome INTEGER NOT NULL, data TEXT NOT NULL);"
        'INSERT INTO rounds VALUES (1, 2, \'{"round": 1, "opened_at": 5.0, "outcome": 2}\');'
        "PRAGMA user_version = 3;"
    )
    db.close()
    read_only = Store(path, read_only=True)  # reading an old file changes nothing in it
    assert read_only.history() == [] and read_only.latest_round().round == 1
    read_only.close()
    store = Store(path)
    assert store.latest_round().round == 1 and store.history() == []
    store.close()
    assert sqlite3.connect(path).execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION


def test_a_round_the_controller_chose_for_records_its_codec_and_longest_budget():
    import json

    from coordinator.store.history import round_history
    from coordinator.store.records import COMMITTED, RoundRecord

    choice = json.dumps(
        {
            "round": 3,
            "codec": "int4",
            "shares": {},
            "inner_steps": 5,
            "fragments": 1,
            "overlap_steps": 0,
            "reason": "int4: fp32 would not fit",
            "predicted_exchange_s": 1.0,
            "window_s": 0.5,
        }
    )
    row = RoundRecord(
        round=3,
        opened_at=1.0,
        participants=("a", "b"),
        outcome=COMMITTED,
        decided_at=2.0,
        choice=choice,
        budgets=(5, 2),
    )
    history = round_history(row, [], RUN, ddp_equivalent_bytes=0)
    assert (history.codec, history.inner_steps) == ("int4", 5)
    plain = round_history(
        RoundRecord(round=4, opened_at=1.0, participants=("a",), outcome=COMMITTED), [], RUN, ddp_equivalent_bytes=0
    )
    assert (plain.codec, plain.inner_steps) == (RUN.rounds.codec, RUN.rounds.inner_steps)


def test_a_rounds_tokens_are_those_in_the_committed_state() -> None:
    """A participant whose exchange failed resyncs and its work is lost; the history does not count it."""
    from coordinator.store.history import round_history
    from coordinator.store.records import COMMITTED, ReportRecord, RoundRecord

    decided = RoundRecord(
        round=3,
        opened_at=1.0,
        participants=("a", "b", "c"),
        outcome=COMMITTED,
        decided_at=2.0,
        committed_hash="h",
        holders=("a", "b"),
    )
    reports = [
        ReportRecord(round=3, peer_id="a", reported_at=1.5, ok=True, state_hash="h", samples=40),
        ReportRecord(round=3, peer_id="b", reported_at=1.5, ok=True, state_hash="h", samples=40),
        ReportRecord(
            round=3, peer_id="c", reported_at=1.5, ok=False, samples=40, error="the group averaged without this peer"
        ),
    ]
    row = round_history(decided, reports, RUN, ddp_equivalent_bytes=0)
    assert row.tokens == 80 * RUN.data.seq_len and row.reported == 3
