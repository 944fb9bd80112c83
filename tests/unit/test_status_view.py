"""`swarm status` shows what strangers chose as names safely, and the coordinator's secrets stay private."""

from __future__ import annotations

import io
import math
import stat
from pathlib import Path

import pytest
from rich.console import Console

from coordinator.api.errors import BadRequest
from coordinator.api.limits import check_request
from coordinator.engine import CoordinatorEngine
from coordinator.store.database import STORE_FILE, Store
from coordinator.store.private_files import private_dir, private_files, write_private
from peer.report.stats import PeerStats
from swarm.app.status import render_status, status_to_dict
from swarm.config import RunConfig
from swarm.v1 import coordinator_pb2 as pb
from tests.unit.fake_swarm import engine_join

pytestmark = pytest.mark.timeout(30)


def _status_with(name: str, site: str) -> dict:
    engine = CoordinatorEngine(Store(":memory:"), config=RunConfig())
    engine_join(engine, name=name, site=site)
    return status_to_dict(engine.status(engine.run.token))


def test_markup_in_peer_names_is_shown_literally_and_long_names_are_cut() -> None:
    status = _status_with(name="[/oops]", site="[bold red]evil[/]" + "s" * 200)
    out = io.StringIO()
    render_status(status, Console(file=out, width=300, color_system=None))  # crashed on [/oops] before
    text = out.getvalue()
    assert "[/oops]" in text and "[bold red]evil" in text
    assert "s" * 30 not in text  # cut for display


def test_a_stored_oversized_name_is_cut_in_the_status_answer() -> None:
    status = _status_with(name="n" * 3_000_000, site="")  # a row stored before requests were bounded
    assert len(status["peers"][0]["name"]) == 256


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_the_state_dir_and_the_files_holding_the_token_are_owner_only(tmp_path: Path) -> None:
    state_dir = tmp_path / "state"
    state_dir.mkdir(mode=0o755)
    (state_dir / "join-string").write_text("old")
    (state_dir / "join-string").chmod(0o644)
    private_dir(state_dir)
    private_files(state_dir)
    store = Store.in_dir(state_dir)
    CoordinatorEngine(store, config=RunConfig())  # writes: WAL and shared-memory files appear
    write_private(state_dir / "join-string", "swarm://...")
    assert _mode(state_dir) == 0o700
    for name in (STORE_FILE, f"{STORE_FILE}-wal", f"{STORE_FILE}-shm", "join-string"):
        assert _mode(state_dir / name) == 0o600, name
    store.close()
    with pytest.raises(NotADirectoryError, match="is a file; give --state-dir a directory"):
        private_dir(state_dir / "join-string")


def test_status_shows_each_peers_link_speeds_rtt_and_step_time_and_json_carries_them() -> None:
    engine = CoordinatorEngine(Store(":memory:"), config=RunConfig())
    measured = engine_join(engine, name="measured")[0].peer_id
    engine_join(engine, name="fresh")  # has not exchanged yet: nothing measured
    metrics = PeerStats().metrics()
    metrics.MergeFrom(pb.PeerMetrics(upload_mbit_s=18.7, download_mbit_s=19.2, rtt_ms=42.0, step_time_s=0.35))
    heartbeat = pb.HeartbeatRequest(peer_id=measured, metrics=metrics)
    check_request("Heartbeat", heartbeat)
    engine.heartbeat(heartbeat)

    status = status_to_dict(engine.status(engine.run.token))
    out = io.StringIO()
    render_status(status, Console(file=out, width=400, color_system=None))
    text = out.getvalue()
    assert "up/down Mbit/s" in text and "rtt ms" in text and "s/step" in text
    assert "18.7/19.2" in text and " 42 " in text and "0.35" in text
    assert "—/—" in text  # the fresh peer's
    by_name = {p["name"]: p["metrics"] for p in status["peers"]}
    assert by_name["measured"]["upload_mbit_s"] == 18.7 and by_name["measured"]["rtt_ms"] == 42.0
    assert by_name["fresh"]["upload_mbit_s"] is None and by_name["fresh"]["rtt_ms"] is None


def test_a_negative_or_infinite_link_speed_is_refused_in_one_sentence() -> None:
    for bad in (-1.0, math.inf):
        with pytest.raises(BadRequest, match="upload_mbit_s"):
            check_request("Heartbeat", pb.HeartbeatRequest(peer_id="p", metrics=pb.PeerMetrics(upload_mbit_s=bad)))
