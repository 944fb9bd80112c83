"""`swarm status` and `swarm history` on an 80-column terminal keep their key columns whole (fewer columns, or one
block per peer), print every column in full when piped, and `--watch` piped prints a snapshot per interval."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
from rich.console import Console

from coordinator.engine import CoordinatorEngine
from coordinator.server import CoordinatorServer
from coordinator.store.database import Store
from peer.report.stats import PeerStats
from swarm.app.cli import main as cli_main
from swarm.app.history import TABLE_COLUMNS, history_to_dict, print_history
from swarm.app.status import PEER_COLUMNS, render_status, status_to_dict
from swarm.config import RoundConfig, RunConfig
from swarm.v1 import coordinator_pb2 as pb
from tests.unit.fake_swarm import engine_join

pytestmark = [pytest.mark.slow, pytest.mark.timeout(30)]

HASH = "9f86d081884c7d65"


def _status() -> tuple[dict, list[str]]:
    engine = CoordinatorEngine(Store(":memory:"), config=RunConfig())
    ids = []
    for name, site in (("gpu-box-in-the-basement", "lab-a"), ("b", "datacenter-east-1")):
        peer_id = engine_join(engine, name=name, site=site)[0].peer_id
        metrics = PeerStats().metrics()
        metrics.MergeFrom(
            pb.PeerMetrics(
                state=pb.PEER_STATE_TRAINING,
                state_round=12,
                state_hash=HASH,
                upload_mbit_s=18.7,
                download_mbit_s=19.2,
                rtt_ms=42.0,
                step_time_s=0.35,
                tokens_per_s=123456.0,
                loss=2.5,
            )
        )
        engine.heartbeat(pb.HeartbeatRequest(peer_id=peer_id, metrics=metrics))
        ids.append(peer_id)
    return status_to_dict(engine.status(engine.run.token)), ids


def _terminal(width: int) -> tuple[Console, io.StringIO]:
    out = io.StringIO()
    return Console(file=out, width=width, force_terminal=True, color_system=None), out


def test_the_peers_table_at_80_columns_keeps_id_state_round_and_hash_whole() -> None:
    status, ids = _status()
    console, out = _terminal(80)
    render_status(status, console)
    lines = out.getvalue().splitlines()
    assert all(len(line) <= 80 for line in lines)
    for peer_id in ids:
        (row,) = [line for line in lines if peer_id in line]
        assert "…" not in row and "training" in row and " 12 " in f"{row} " and HASH in row, row
    assert "columns hidden at 80 columns" in out.getvalue()  # it says what it left out, and how to see it


def test_a_terminal_too_narrow_for_the_key_columns_gets_one_block_per_peer() -> None:
    status, ids = _status()
    console, out = _terminal(40)
    render_status(status, console)
    text = out.getvalue()
    assert all(peer_id in text for peer_id in ids)
    assert f"θg hash: {HASH}" in text and "state: training" in text and "round: 12" in text
    assert "site: datacenter-east-1" in text


def test_piped_status_prints_every_column_of_each_peer_on_one_line() -> None:
    status, ids = _status()
    out = io.StringIO()
    render_status(status, Console(file=out))  # not a terminal: rich would otherwise wrap at 80 columns
    lines = out.getvalue().splitlines()
    header = next(line for line in lines if line.startswith("id "))
    assert header.split() == " ".join(c.header for c in PEER_COLUMNS).split()
    for peer_id in ids:
        (row,) = [line for line in lines if peer_id in line]
        assert "…" not in row and "│" not in row and row == row.rstrip()
        for shown in ("training", HASH, "123,456", "18.7/19.2", "42", "0.35", "2.500"):
            assert shown in row, row
    assert "datacenter-east-1" in out.getvalue() and "gpu-box-in-the-basement" in out.getvalue()


def _history() -> dict:
    rounds = [
        pb.RoundHistory(
            round=r,
            outcome=pb.ROUND_OUTCOME_COMMITTED,
            participants=12,
            holders=12,
            group_size=4,
            codec="int4",
            inner_steps=500,
            fragments=1,
            bytes_sent=123_456_789_012,
            ddp_equivalent_bytes=98_765_432_109_876,
            exchange_s=12.345,
            inner_s=456.7,
            mean_loss=3.21,
            eval_loss=3.3,
            tokens=1_234_567_890,
            utilization=0.97,
            committed_hash=HASH,
        )
        for r in (1, 2)
    ]
    rounds.append(pb.RoundHistory(round=3, outcome=pb.ROUND_OUTCOME_VOIDED, codec="int4"))
    return history_to_dict(pb.GetHistoryResponse(rounds=rounds))


def test_the_history_table_at_80_columns_keeps_round_outcome_and_hash_whole() -> None:
    console, out = _terminal(80)
    print_history(_history(), fmt="table", console=console)
    lines = out.getvalue().splitlines()
    assert all(len(line) <= 80 for line in lines) and "…" not in out.getvalue()
    rows = [line.split() for line in lines if HASH in line]
    assert [r[:3] for r in rows] == [["1", "committed", HASH], ["2", "committed", HASH]]
    assert any(line.split()[:2] == ["3", "voided"] for line in lines)


def test_piped_history_prints_every_column_in_full() -> None:
    out = io.StringIO()
    print_history(_history(), fmt="table", console=Console(file=out))
    lines = out.getvalue().splitlines()
    assert "…" not in out.getvalue()
    assert any(line.split() == " ".join(c.header for c in TABLE_COLUMNS).split() for line in lines)
    (first,) = [line.split() for line in lines if line.split()[:1] == ["1"]]
    assert len(first) == len(TABLE_COLUMNS) and "98765432109876" in first and "1234567890" in first


def test_status_watch_piped_prints_a_snapshot_every_interval(tmp_path: Path, capsys) -> None:
    server = CoordinatorServer(run=RunConfig(rounds=RoundConfig(max_rounds=3, inner_steps=5)), state_dir=tmp_path / "c")
    server.start()
    try:
        join = str(server.join_string)
        assert cli_main(["status", join, "--watch", "--interval", "0.1", "--count", "2"]) == 0
        tables = capsys.readouterr().out
        assert cli_main(["status", join, "--json", "--watch", "--interval", "0.1", "--count", "2"]) == 0
        objects = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    finally:
        server.stop()
    assert tables.count("\n--- ") == 1 and tables.startswith("--- ") and tables.count("rounds committed") == 2
    assert len(objects) == 2 and all(o["run"]["run_id"] == objects[0]["run"]["run_id"] for o in objects)


def test_count_must_be_positive(capsys) -> None:
    with pytest.raises(SystemExit) as info:
        cli_main(["status", "swarm://127.0.0.1:9?token=t&fp=" + "0" * 64, "--count", "0"])
    assert info.value.code == 2 and "--count must be from 1" in capsys.readouterr().err
